"""Disk measurements of a checkpoint: cold reads, the 7B checkpoint's files, the verify-time model.

Shared by `benchmarks/checkpoint_bench.py` (where they were measured against real resumes; see
docs/benchmarks/checkpoint.md) and `mspretrain selftest` (which measures a new node's disk).
"""
from __future__ import annotations

import mmap
import os
from pathlib import Path

from mspretrain.checkpoint import store
from mspretrain.config import schema as cfgmod
from mspretrain.model.presets import param_count

CHUNK = 16 << 20  # read size for the disk measurements, as in store._sha256


def drop_cache(path: Path) -> None:
    """Evict a (clean, fsynced) file from the page cache, so the next read comes from the disk.
    Per file, not /proc/sys/vm/drop_caches: the box is shared with other jobs."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_cold(path: Path) -> tuple[int, str]:
    """Read a whole file from the disk: O_DIRECT into a page-aligned (mmap) buffer; where O_DIRECT
    is refused (tmpfs, some overlays), evict it from the page cache and read it buffered."""
    buf = mmap.mmap(-1, CHUNK)  # anonymous mmap: page-aligned, as O_DIRECT requires
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
        try:
            total = 0
            while n := os.preadv(fd, [buf], total):
                total += n
            return total, "O_DIRECT"
        finally:
            os.close(fd)
    except OSError:
        drop_cache(path)
        with open(path, "rb", buffering=0) as f:
            total = 0
            while n := f.readinto(buf):
                total += n
        return total, "fadvise DONTNEED + read"
    finally:
        buf.close()


def layout_7b(cfg: cfgmod.Config, ranks: int = 8) -> dict[str, int]:
    """Bytes of each tensor file of a Llama-2-7B checkpoint written with `cfg` on `ranks` ranks.

    model.safetensors: the decoder matrices in the compute dtype when `precision.param_dtype =
    "compute"` (2 bytes), everything else fp32. Optimizer: 2 fp32 Adam moments per parameter plus
    an fp32 master per half-precision matrix, split evenly over `ranks` shard files when
    `optim.shard_optimizer` (the owner split is per parameter, within a few % of even at 7B), one
    file otherwise."""
    m = cfgmod.resolve_model(cfg.model, None)
    head_dim = m.head_size
    # the matrices half_eligible() picks: wq, wk, wv, wo and the three MLP matrices of each layer
    matrices = m.n_layers * (m.dim * (m.n_heads + 2 * m.n_kv_heads) * head_dim + m.n_heads * head_dim * m.dim
                             + 3 * m.dim * m.ffn_dim)
    total = param_count(m)
    half = matrices if cfg.precision.param_dtype == "compute" and cfg.precision.dtype != "fp32" else 0
    files = {store.MODEL_FILE: 2 * half + 4 * (total - half)}
    optim = 8 * total + 4 * half
    if cfg.optim.shard_optimizer:
        files.update({store.optimizer_shard_name(r, ranks): optim // ranks for r in range(ranks)})
    else:
        files[store.OPTIM_FILE] = optim
    return files


def verify_time(total: float, largest: float, bw_par: float, bw_1: float, sha_1: float, sha_all: float) -> float:
    """Cold verify of files totalling `total` bytes, read once from the disk by a thread per file.

    Three floors, the largest wins: the disk delivering every byte at its parallel-stream rate;
    the largest file, one thread that reads a chunk and then hashes it (measured on this box:
    reading and hashing do not overlap within a thread, the 16 MB read waits for the disk); and
    the CPU, every byte hashed at the rank's aggregate SHA-256 rate."""
    return max(total / bw_par, largest * (1 / bw_1 + 1 / sha_1), total / sha_all)
