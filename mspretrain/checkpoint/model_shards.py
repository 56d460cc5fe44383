"""A checkpoint's weights as one file or as one file per rank (ZeRO-3), read back at any layout.

Two forms of the weights in a checkpoint dir, listed in its manifest like every other file:
    model.safetensors                        every parameter whole (one process, ZeRO-0/1/2)
    model-RRRRR-of-NNNNN.safetensors         ZeRO-3: rank R's slices, `NAME@START:STOP` (elements
                                             [START, STOP) of the flattened parameter, 1-D, as the
                                             optimizer state's slices are named), and, in rank 0's
                                             file only, the parameters no rank slices (frozen ones)
                                             whole under their plain names
Each per-rank file's safetensors metadata holds `shapes`: JSON {NAME: [whole shape]} of the sliced
parameters (the file's own and every other rank's: each rank knows all of them), so a reader
rebuilds a whole tensor or cuts any range of it without the other files' headers.

Why per-rank files: at 14B+ a whole-model gather at save time costs the fp32/bf16 model on every
rank's host (step/zero3.py `full_state`); here each rank writes what it holds and nothing crosses
ranks. Reading is by range (`read_pieces`): a ZeRO-3 rank of any world size reads only the
stored pieces that overlap its own slice, with safetensors' lazy `get_slice` (rows of a whole
tensor, a range of a 1-D slice), so a resume does not load the whole model on any rank either;
every other layout and `export` / `eval` / `load_model` read whole tensors (`read_whole`). Values
keep their stored dtype (fp16 weights of precision.param_dtype=compute stay fp16 here).
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Iterable

import numpy as np
from safetensors import SafetensorError, safe_open

from mspretrain.errors import UserError
from mspretrain.fsutil import loads_json
from mspretrain.parallel.shard_key import parse_shard_key as parse_key  # the stored keys' one reader (re-exported)

MODEL_FILE = "model.safetensors"
MODEL_SHARD_RE = re.compile(r"^model-(\d{5})-of-(\d{5})\.safetensors$")
_REREAD = "resume from another checkpoint (`mspretrain checkpoints RUN --verify` lists them)"


def model_shard_name(rank: int, world: int) -> str:
    return f"model-{rank:05d}-of-{world:05d}.safetensors"


def model_files(names: Iterable[str]) -> list[str]:
    """The weight files among `names`: the whole file, or every per-rank file, sorted."""
    return sorted(n for n in names if n == MODEL_FILE or MODEL_SHARD_RE.match(n))


def model_files_problem(names: Iterable[str]) -> str | None:
    """Why a manifest's weight files are not a complete set, or None: `model.safetensors`, or
    `model-R-of-N` for every R < N of one N (a missing rank file is a missing file)."""
    names = set(names)
    if MODEL_FILE in names:
        return None
    shards = [MODEL_SHARD_RE.match(n) for n in names]
    worlds = {int(m.group(2)) for m in shards if m}
    if not worlds:
        return f"manifest lists no {MODEL_FILE}"
    if len(worlds) > 1:
        return f"manifest lists per-rank weight files of {len(worlds)} world sizes"
    (world,) = worlds
    have = {int(m.group(1)) for m in shards if m}
    missing = sorted(set(range(world)) - have)
    return f"manifest lists no {model_shard_name(missing[0], world)}" if missing else None


def shard_metadata(step: int, shapes: dict[str, tuple[int, ...]]) -> dict[str, str]:
    """The safetensors metadata of a per-rank weight file (the module docstring)."""
    return {"format": "mspretrain", "step": str(step), "shapes": json.dumps({k: list(v) for k, v in sorted(shapes.items())})}


def check_tiling(name: str, ranges: Iterable[tuple[int, int]], lo: int, hi: int, fix: str = _REREAD) -> None:
    """The stored pieces' [a, b) ranges of `name` cover [lo, hi) exactly once, or a one-line error:
    the writers' slices tile each tensor, so a gap is a missing or foreign file and an overlap a
    piece that is not this checkpoint's (summing the covered lengths let an overlap hide a gap)."""
    at = lo
    for a, b in sorted((max(a, lo), min(b, hi)) for a, b in ranges if max(a, lo) < min(b, hi)):
        if a < at:
            raise UserError(f"the checkpoint's pieces of {name} overlap at elements [{a:,}, {min(at, b):,}): "
                            "two files hold the same part of it", fix)
        if a > at:
            raise UserError(f"the checkpoint's pieces of {name} leave its elements [{at:,}, {a:,}) unwritten", fix)
        at = b
    if at < hi:
        raise UserError(f"the checkpoint's pieces of {name} leave its elements [{at:,}, {hi:,}) unwritten", fix)


def _whole_shape(file: str, pname: str, dims: object) -> tuple[int, ...]:
    """A whole shape from a file's `shapes` metadata: a list of whole numbers >= 0."""
    if not isinstance(dims, list) or len(dims) > 8 or not all(type(d) is int and 0 <= d < 1 << 62 for d in dims):
        raise UserError(f"{file}'s shape metadata for {pname[:120]} is not a list of whole numbers", _REREAD)
    return tuple(dims)


class _Index:
    """Where each parameter's elements are stored: its whole shape, and (file, key, range) pieces."""

    def __init__(self, ckpt: Path) -> None:
        self.ckpt = Path(ckpt)
        files = model_files(p.name for p in self.ckpt.iterdir())
        if not files:
            raise UserError(f"checkpoint {self.ckpt} has no weights ({MODEL_FILE} or model-*-of-*.safetensors)", _REREAD)
        self.shape: dict[str, tuple[int, ...]] = {}
        self.pieces: dict[str, list[tuple[str, str, tuple[int, int] | None]]] = {}
        for name in files:
            try:
                self._add_file(name)
            except (SafetensorError, OSError) as e:
                raise UserError(f"cannot read {name} in {self.ckpt} ({' '.join(str(e).split())[:200]})", _REREAD) from None
        # every parameter's pieces must tile it exactly once, checked here, before a byte is
        # allocated for it: a hostile whole shape (10^12 elements) is a gap, not a MemoryError
        for pname, pieces in self.pieces.items():
            n = math.prod(self.shape[pname])
            check_tiling(pname, [rng if rng is not None else (0, n) for _, _, rng in pieces], 0, n)

    def _add_file(self, name: str) -> None:
        with safe_open(str(self.ckpt / name), framework="numpy") as f:
            meta = f.metadata() or {}
            shapes = loads_json(meta.get("shapes", "{}"), f"{name}'s shape metadata in {self.ckpt}", _REREAD)
            if not isinstance(shapes, dict):
                raise UserError(f"{name}'s shape metadata in {self.ckpt} is not a table of shapes", _REREAD)
            for key in f.keys():
                pname, rng = parse_key(key)
                stored = tuple(f.get_slice(key).get_shape())
                if rng is None:
                    shape = stored
                elif pname in shapes:
                    shape = _whole_shape(name, pname, shapes[pname])
                    if stored != (rng[1] - rng[0],):
                        raise UserError(f"{name}'s {key[:120]} holds {stored} elements, not the {rng[1] - rng[0]:,} its name says", _REREAD)
                    if rng[1] > math.prod(shape):
                        raise UserError(f"{name}'s {key[:120]} lies past the {math.prod(shape):,} elements of {pname}", _REREAD)
                else:
                    raise UserError(f"{name} holds a slice of {pname[:120]} but no shape for it", _REREAD)
                if self.shape.setdefault(pname, shape) != shape:
                    raise UserError(f"the checkpoint's files disagree on the shape of {pname[:120]} "
                                    f"({self.shape[pname]} and {shape})", _REREAD)
                self.pieces.setdefault(pname, []).append((name, key, rng))

    def read(self, name: str, lo: int, hi: int) -> np.ndarray:
        """Elements [lo, hi) of the flattened parameter `name`, from whichever pieces hold them."""
        shape = self.shape[name]
        n = math.prod(shape)
        if not 0 <= lo <= hi <= n:
            raise UserError(f"the checkpoint's {name} has {n:,} elements, not [{lo:,}, {hi:,})", _REREAD)
        # the pieces tile [0, n) exactly once (checked in __init__), so every element is written once
        out, dtype = None, None
        for file, key, rng in self.pieces[name]:
            a, b = rng if rng is not None else (0, n)
            x, y = max(lo, a), min(hi, b)
            if x >= y:
                continue
            with safe_open(str(self.ckpt / file), framework="numpy") as f:
                sl = f.get_slice(key)
                if rng is not None:  # a 1-D slice: read just the range
                    part = np.asarray(sl[x - a:y - a]).reshape(-1)
                else:  # a whole tensor: read the rows that hold the range, then cut it
                    row = math.prod(shape[1:]) if len(shape) > 1 else 1
                    r0, r1 = x // row, -(-y // row)
                    part = np.asarray(sl[r0:r1]).reshape(-1)[x - r0 * row:y - r0 * row]
            if out is None:
                dtype = part.dtype
                out = np.empty(hi - lo, dtype)
            out[x - lo:y - lo] = part.astype(dtype, copy=False)
        if out is None:  # an empty range (a rank of a world larger than the tensor): still the stored dtype
            file, key, _ = self.pieces[name][0]
            with safe_open(str(self.ckpt / file), framework="numpy") as f:
                out = np.asarray(f.get_slice(key)[0:0]).reshape(-1)
        return out


def stored_shapes(ckpt: Path) -> dict[str, tuple[int, ...]]:
    """Every parameter's whole shape, from the headers (and metadata) only."""
    return dict(_Index(ckpt).shape)


def read_pieces(ckpt: Path, wanted: dict[str, tuple[int, int] | None]) -> dict[str, np.ndarray]:
    """For each wanted parameter, its whole tensor (None) or elements [start, stop) of its
    flattened form (1-D), in its stored dtype; only the overlapping stored pieces are read.
    Parameters the checkpoint lacks are left out (the caller's strict load names them); every
    stored parameter not wanted is returned whole, so that the caller's strict load refuses it."""
    index = _Index(ckpt)
    out: dict[str, np.ndarray] = {}
    for name, shape in index.shape.items():
        rng = wanted.get(name)
        if rng is None:
            out[name] = index.read(name, 0, math.prod(shape)).reshape(shape)
        else:
            out[name] = index.read(name, *rng)
    return out


def read_whole(ckpt: Path) -> dict[str, np.ndarray]:
    """Every parameter whole, by name, in its stored dtype (either form of the weights)."""
    return read_pieces(ckpt, {})
