"""Checkpoint averaging: a weighted mean of several checkpoints' weights, written as a checkpoint.

`mspretrain average` (commands/average.py) picks the checkpoints; this module checks that they can
be averaged, computes the mean and writes it as a weights-only checkpoint (model.safetensors,
config.toml, train_state.json, the tokenizer, manifest.json last) that eval, generate, export and
`train --init-from` read like any other.

Weights of the checkpoints s_1 < ... < s_n (in step order):
- uniform: 1/n each;
- EMA with decay d: the exponential moving average e_1 = w_1, e_k = d * e_{k-1} + (1 - d) * w_k
  taken over the n checkpoints, i.e. w_1 gets d^(n-1) and w_k (k >= 2) gets (1 - d) * d^(n-k);
  the weights sum to 1.

Design choices:
- Bounded memory: one piece of one tensor at a time. Each parameter is read in runs of at most
  `chunk` elements from every source (model_shards' reader, which reads just the stored pieces
  that overlap a range: rows of a whole tensor, a range of a ZeRO-3 slice), summed in float64,
  rounded once to float32 and streamed into the output file. Peak memory is a few chunks, not the
  model (tests/checkpoint/test_average.py measures it).
- The output file is written by a streaming safetensors writer (`_StreamedSafetensors`): its header
  is known from the shapes alone, so no tensor needs to be whole in memory; every value is fp32.
- Publishing reuses store.write_checkpoint_dir (tmp dir, fsync, manifest last, rename): the weights
  file is streamed into its tmp dir through the `collect` hook, so the manifest hashes it like any
  file. The output's step is the newest source's; train_state.json says what was averaged.
- Refusals come before anything is written: a missing or unverified checkpoint, different
  parameter names or shapes, different model families (one line each).
"""
from __future__ import annotations

import json
import math
import os
import re
import struct
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from mspretrain.checkpoint import store
from mspretrain.checkpoint.model_shards import MODEL_FILE, MODEL_SHARD_RE, _Index, model_shard_name
from mspretrain.config import schema as cfgmod
from mspretrain.config.schema import Config
from mspretrain.errors import UserError
from mspretrain.fsutil import fsync_path

CHUNK = 1 << 24  # elements per read (64 MB of fp32): bounds memory at any model size
EMA_FILE = "ema.safetensors"  # the run's EMA of the weights (train.ema_decay), whole
EMA_SHARD_RE = re.compile(r"^ema-(\d{5})-of-(\d{5})\.safetensors$")  # ... or one file per rank (ZeRO-1/2/3)


def ema_shard_name(rank: int, world: int) -> str:
    """Rank R's EMA file under ZeRO-1/2/3: the per-rank weight file's format (model_shards.py), another name."""
    return "ema" + model_shard_name(rank, world)[len("model"):]


def ema_files(names: Any) -> list[str]:
    return sorted(n for n in names if n == EMA_FILE or EMA_SHARD_RE.match(n))


@dataclass(frozen=True)
class Source:
    step: int
    dir: Path


def uniform_weights(n: int) -> list[float]:
    return [1.0 / n] * n


def ema_weights(n: int, decay: float) -> list[float]:
    """The weight of each of n checkpoints (oldest first) in an EMA with `decay` (module docstring)."""
    return [decay ** (n - 1)] + [(1.0 - decay) * decay ** (n - k) for k in range(2, n + 1)]


def select(run_dir: Path, *, last: int | None = None, steps: list[int] | None = None) -> list[Source]:
    """The checkpoints of RUN_DIR to average, oldest first: the newest `last` that verify, or the
    given `steps` (each must exist and verify). One-line refusal otherwise."""
    found = dict(store.list_checkpoints(run_dir))
    hint = f"list them with `mspretrain checkpoints {run_dir} --verify`"
    if steps is not None:
        chosen = sorted(set(steps))
        missing = [s for s in chosen if s not in found]
        if missing:
            raise UserError(f"{run_dir} has no checkpoint of step {missing[0]}", hint)
    else:
        assert last is not None
        chosen = []
        for s in sorted(found, reverse=True):
            if len(chosen) == last:
                break
            if store.verify(found[s], deep=False) is None:
                chosen.append(s)
        chosen.sort()
        if len(chosen) < last:
            raise UserError(f"{run_dir} has {len(chosen)} complete checkpoint(s), --last asks for {last}", hint)
    out = [Source(s, found[s]) for s in chosen]
    for src in out:
        reason = store.verify(src.dir)
        if reason:
            raise UserError(f"checkpoint {src.dir.name} does not verify: {reason}", hint)
    return out


@contextmanager
def weight_view(src: Source, from_ema: bool) -> Iterator[Path]:
    """A dir model_shards' reader can read the chosen weights from: the checkpoint itself, or
    (from_ema) a temporary dir whose model files are links to the checkpoint's EMA files, which
    have the weight files' format (whole, or per rank: ZeRO-1/2/3's parameters and slices)."""
    if not from_ema:
        yield src.dir
        return
    names = ema_files(p.name for p in src.dir.iterdir())
    if not names:
        raise UserError(f"checkpoint {src.dir.name} holds no EMA of the weights ({EMA_FILE})",
                        "train with train.ema_decay set (e.g. 0.999) to save one, or average the weights without --from-ema")
    with tempfile.TemporaryDirectory(prefix="mspretrain-ema-") as tmp:
        for name in names:
            os.symlink((src.dir / name).resolve(), Path(tmp) / ("model" + name[len("ema"):]))
        yield Path(tmp)


def _family(cfg: Config) -> str:
    return str(cfg.model.family)


def check_compatible(sources: list[Source], indexes: list[_Index], configs: list[Config]) -> dict[str, tuple[int, ...]]:
    """The shared shapes of the sources' parameters, or a one-line refusal naming the difference."""
    first = sources[0]
    shapes = indexes[0].shape
    hint = "average checkpoints of one run (or of runs of one model shape and family)"
    for src, idx, cfg in zip(sources[1:], indexes[1:], configs[1:]):
        if _family(cfg) != _family(configs[0]):
            raise UserError(f"checkpoint {src.dir.name} is a {_family(cfg)} model, {first.dir.name} a {_family(configs[0])} model", hint)
        names = set(idx.shape) ^ set(shapes)
        if names:
            name = sorted(names)[0]
            who = src.dir.name if name in idx.shape else first.dir.name
            raise UserError(f"parameter {name} is only in checkpoint {who}", hint)
        for name in sorted(shapes):
            if idx.shape[name] != shapes[name]:
                raise UserError(f"parameter {name} has shape {list(idx.shape[name])} in {src.dir.name} but "
                                f"{list(shapes[name])} in {first.dir.name}", hint)
    return dict(shapes)


class _StreamedSafetensors:
    """A safetensors file of fp32 tensors written piece by piece: the header (names, shapes, byte
    offsets, metadata) is written first, then each tensor's bytes in name order, as they come."""

    def __init__(self, path: Path, shapes: dict[str, tuple[int, ...]], metadata: dict[str, str]) -> None:
        header: dict[str, Any] = {"__metadata__": dict(sorted(metadata.items()))}
        offset = 0
        self.order = sorted(shapes)
        for name in self.order:
            n = math.prod(shapes[name]) * 4
            header[name] = {"dtype": "F32", "shape": list(shapes[name]), "data_offsets": [offset, offset + n]}
            offset += n
        raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        raw += b" " * (-len(raw) % 8)  # the format pads the header to 8 bytes
        self.f = open(path, "wb")
        self.f.write(struct.pack("<Q", len(raw)) + raw)

    def write(self, values: np.ndarray) -> None:
        self.f.write(np.ascontiguousarray(values, dtype="<f4").tobytes())

    def close(self) -> None:
        self.f.close()


def weighted_mean_file(path: Path, indexes: list[_Index], weights: list[float], shapes: dict[str, tuple[int, ...]],
                       metadata: dict[str, str], chunk: int = CHUNK) -> None:
    """Write sum_i weights[i] * tensor_i for every parameter into the safetensors file `path`,
    `chunk` elements at a time (float64 sums, rounded once to float32). Equal weights are summed
    and divided by their count, so a uniform average is the tensors' mean, not a sum of thirds."""
    uniform = len(set(weights)) == 1
    scaled, divisor = ([1.0] * len(weights), len(weights)) if uniform else (list(weights), 1)
    out = _StreamedSafetensors(path, shapes, metadata)
    try:
        for name in out.order:
            n = math.prod(shapes[name])
            for lo in range(0, n, chunk):
                hi = min(n, lo + chunk)
                acc = np.zeros(hi - lo, np.float64)
                for idx, w in zip(indexes, scaled):
                    piece = idx.read(name, lo, hi).astype(np.float64)
                    if w != 1.0:
                        piece *= w
                    acc += piece
                    del piece
                if divisor != 1:
                    acc /= divisor
                out.write(acc.astype(np.float32))
                del acc
    finally:
        out.close()


def average(sources: list[Source], weights: list[float], out_dir: Path, *, method: dict[str, Any], from_ema: bool = False,
            chunk: int = CHUNK, log: Callable[[str], None] = lambda s: None) -> Path:
    """Average `sources` with `weights` into the new checkpoint dir `out_dir` (refused if it exists)."""
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")  # store.write_checkpoint_dir's staging dir
    for p in (out_dir, tmp):
        if p.exists() or p.is_symlink():
            raise UserError(f"{p} already exists", "choose another --out (average never overwrites; "
                            "a .tmp dir is left by an interrupted average: remove it)")
    if out_dir.parent.name == "checkpoints" and store.STEP_RE.match(out_dir.name):
        raise UserError(f"{out_dir} would be taken for a training checkpoint of that run (resume, pruning)",
                        "write the average outside checkpoints/ (the default is RUN_DIR/averaged/)")
    newest = store.resolve_checkpoint(sources[-1].dir)  # its config and tokenizer go with the average
    configs = [cfgmod.load(s.dir / store.CONFIG_FILE) for s in sources[:-1]] + [newest.config]
    with _views(sources, from_ema) as dirs:
        indexes = [_Index(d) for d in dirs]
        shapes = check_compatible(sources, indexes, configs)
        record = {"weights_only": True, "averaged": dict(method, from_ema=from_ema, weights=weights,
                                                          sources=[_provenance(s, from_ema) for s in sources])}
        meta = {"format": "mspretrain", "step": str(sources[-1].step)}

        def stream(tmp: Path) -> dict[str, dict[str, Any]]:
            # store.write_checkpoint_dir calls this before it writes the manifest: the placeholder
            # weights file it wrote is replaced by the streamed mean, hashed here like any file
            target = tmp / MODEL_FILE
            weighted_mean_file(target, indexes, weights, shapes, meta, chunk)
            fsync_path(target)
            return {MODEL_FILE: {"sha256": store._sha256(target), "bytes": target.stat().st_size}}

        log(f"averaging {len(sources)} checkpoint(s) into {out_dir}")
        made = [p for p in reversed(out_dir.parents) if not p.exists()]  # removed again if the write fails
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        try:
            return store.write_checkpoint_dir(out_dir, step=sources[-1].step, model={}, optimizer=None, train_state=record,
                                              data_state=None, config=newest.config, tokenizer_path=newest.tokenizer_path,
                                              collect=stream)
        except store.SaveError as exc:
            for p in reversed(made):
                try:
                    p.rmdir()
                except OSError:
                    break
            if isinstance(exc.__cause__, UserError):  # a source that could not be read (model_shards' reader)
                raise exc.__cause__ from None
            raise UserError(f"cannot write {out_dir}: {exc}", "free disk space (or fix permissions) and run the same command") from None


def _provenance(src: Source, from_ema: bool) -> dict[str, Any]:
    """Which files were averaged: the step, the dir and the SHA-256 of its weight (or EMA) files."""
    files = store.read_json(src.dir / store.MANIFEST)["files"]
    chosen = ema_files(files) if from_ema else [k for k in files if k == MODEL_FILE or MODEL_SHARD_RE.match(k)]
    return {"step": src.step, "dir": str(src.dir.resolve()), "sha256": {k: files[k]["sha256"] for k in sorted(chosen)}}


@contextmanager
def _views(sources: list[Source], from_ema: bool) -> Iterator[list[Path]]:
    from contextlib import ExitStack

    with ExitStack() as stack:
        yield [stack.enter_context(weight_view(s, from_ema)) for s in sources]
