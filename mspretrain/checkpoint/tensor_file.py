"""safetensors files that are the same bytes for the same tensors and metadata.

`safetensors` writes a file's metadata (`{"format": ..., "step": ...}`) from a Rust hash map, whose
order changes from one write to the next: of the 8 checkpoints of one tiny run, 5 had one order
and 3 the other, so two identical runs' checkpoints did not hash alike (docs/benchmarks.md, round
three of the suite's time). The tensors' entries are already in a fixed order (by name within a
dtype alignment). `save_tensors` writes the file with `save_file`, then rewrites the header in place
with the metadata's keys sorted: the same length, so no byte of the data moves, and nothing is held
in memory but the header (a 7B checkpoint is written straight to disk, as before).
"""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Mapping

import numpy as np
from safetensors.numpy import save_file


def save_tensors(tensors: Mapping[str, np.ndarray], path: str | Path, metadata: dict[str, str] | None = None) -> None:
    """`safetensors.numpy.save_file` of `tensors` (made contiguous), metadata keys in sorted order."""
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(path), metadata=metadata)
    if metadata and len(metadata) > 1:
        sort_metadata(path)


def sort_metadata(path: str | Path) -> bool:
    """Rewrite `path`'s header with its metadata keys sorted; True if it was rewritten. A header this
    code would not write back byte for byte as found (another writer's spacing or escaping) is
    left as it is."""
    with open(path, "r+b") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        raw = f.read(length)
        body = raw.rstrip(b" ")  # the header is padded with spaces to an 8-byte boundary

        def dump(header: dict) -> bytes:
            return json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")

        header = json.loads(body)
        meta = header.get("__metadata__")
        if not isinstance(meta, dict) or dump(header) != body:
            return False
        header["__metadata__"] = dict(sorted(meta.items()))
        new = dump(header)
        if new == body:
            return False
        f.seek(8)
        f.write(new)  # same length as `body`: the padding and the data stay where they are
        return True


_MAPPABLE = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
             "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


def mapped_tensors(path: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file as a read-only `np.memmap` of its bytes in the file: no
    copy, the pages read when first touched and shared through the page cache by every process
    that maps the file (the ranks of one host starting from the same weights). A dtype numpy has
    no memmap for (bf16) is read whole by safetensors instead. Raises ValueError on a header whose
    offsets do not fit the file (the caller has verified the file's SHA-256 first)."""
    import os

    from safetensors import safe_open

    path = Path(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    start = 8 + length
    out: dict[str, np.ndarray] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        shape, (lo, hi) = tuple(int(d) for d in entry["shape"]), (int(x) for x in entry["data_offsets"])
        dtype = _MAPPABLE.get(entry["dtype"])
        if dtype is None:
            with safe_open(str(path), framework="numpy") as g:
                out[name] = g.get_tensor(name)
            continue
        if hi - lo != int(np.prod(shape)) * np.dtype(dtype).itemsize or start + hi > size or lo > hi:
            raise ValueError(f"{path.name}: tensor {name} does not fit its data offsets")
        out[name] = np.memmap(path, dtype, "r", offset=start + lo, shape=shape) if hi > lo else np.empty(shape, dtype)
    return out
