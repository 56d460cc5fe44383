"""Optimizer shards of a sharded run (and, under ZeRO-3, per-rank weight files): every rank writes
its own, rank 0 publishes the checkpoint.

Protocol (all ranks see the same filesystem: one node's disk, or the shared storage a multi-node
job writes checkpoints to):
  rank R > 0   writes `checkpoints/step_NNNNNN.rankR.tmp/optimizer-R-of-N.safetensors` (and under
               ZeRO-3 `model-R-of-N.safetensors`, model_shards.py), fsyncs them, then writes
               `shard.json` (each file's SHA-256 and size) last; on failure `error.json`.
  rank 0       writes the rest into `step_NNNNNN.tmp/`, waits for every `shard.json`, moves the
               shards in (a rename on the same filesystem), writes the manifest and renames the
               directory: the checkpoint appears whole or not at all, as unsharded ones do.
A staging dir ends in `.tmp`, so one left by a crash is removed by the next start's cleanup
(rank 0 cleans before the first step; other ranks cannot save before that step's all-reduce).
Each rank hashes its own shard, so rank 0 does not re-read 7/8 of the optimizer state.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

from mspretrain.checkpoint.model_shards import model_shard_name
from mspretrain.checkpoint.store import SaveError, _sha256, optimizer_shard_name, step_dir_name
from mspretrain.checkpoint.tensor_file import save_tensors
from mspretrain.fsutil import atomic_write, chmod_like_open, fsync_path

# How long rank 0 waits for another rank's shard after writing its own files. Generous: a 7B
# run's shard is ~10 GB (moments and masters), written while rank 0 writes its 14 GB.
WAIT_S = 1800.0


def staging_dir(root: Path, step: int, rank: int) -> Path:
    return Path(root) / f"{step_dir_name(step)}.rank{rank}.tmp"


def write_shard(root: Path, step: int, rank: int, world: int, tensors: dict[str, np.ndarray],
                model: dict[str, np.ndarray] | None = None, model_metadata: dict[str, str] | None = None,
                extra: dict[str, tuple[dict[str, np.ndarray], dict[str, str]]] | None = None) -> None:
    """Rank R's part of a checkpoint: its optimizer shard, and (ZeRO-3, `model`) its weight slices,
    and `extra` files {name: (tensors, metadata)} (the EMA's per-rank file, train/ema.py); raises
    SaveError (after telling rank 0) when it cannot."""
    d = staging_dir(root, step, rank)
    plain = {"format": "mspretrain", "step": str(step)}
    files = [(optimizer_shard_name(rank, world), tensors, plain)]
    if model is not None:
        files.append((model_shard_name(rank, world), model, model_metadata or plain))
    files += [(name, part, meta) for name, (part, meta) in sorted((extra or {}).items())]
    try:
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)
        entries = []
        for name, part, meta in files:
            save_tensors(part, d / name, meta)
            chmod_like_open(d / name)
            fsync_path(d / name)
            entries.append({"file": name, "sha256": _sha256(d / name), "bytes": (d / name).stat().st_size})
        _publish(d / "shard.json", {"files": entries})
    except Exception as exc:
        msg = str(exc).replace("Error while serializing: ", "")
        try:  # best effort: rank 0 stops waiting and reports this rank's reason
            _publish(d / "error.json", {"error": msg})
        except OSError:
            pass
        raise SaveError(f"rank {rank}: {msg}") from exc


def _publish(path: Path, obj: dict[str, Any]) -> None:
    """Write a small JSON file so that a reader (rank 0, polling) never sees it half written."""
    atomic_write(path, json.dumps(obj))


def collect(root: Path, step: int, world: int, into: Path, *, wait_s: float = WAIT_S,
            poll_s: float = 0.05) -> dict[str, dict[str, Any]]:
    """Wait for ranks 1..N-1, move their shards into `into`; their manifest entries."""
    entries: dict[str, dict[str, Any]] = {}
    deadline = time.monotonic() + wait_s
    for rank in range(1, world):
        d = staging_dir(root, step, rank)
        while not (d / "shard.json").is_file():
            if (d / "error.json").is_file():
                reason = json.loads((d / "error.json").read_text(encoding="utf-8")).get("error", "unknown error")
                shutil.rmtree(d, ignore_errors=True)
                raise SaveError(f"rank {rank} could not write its optimizer shard: {reason}")
            if time.monotonic() > deadline:
                raise SaveError(f"rank {rank} did not deliver its optimizer shard for step {step} within {wait_s:.0f} s "
                                "(with optim.shard_optimizer the run dir must be on storage every rank shares)")
            time.sleep(poll_s)
        for meta in json.loads((d / "shard.json").read_text(encoding="utf-8"))["files"]:
            src = d / meta["file"]
            if src.stat().st_size != meta["bytes"]:
                raise SaveError(f"rank {rank}'s {meta['file']} has {src.stat().st_size} bytes, it reported {meta['bytes']}")
            os.replace(src, into / meta["file"])
            entries[meta["file"]] = {"sha256": meta["sha256"], "bytes": meta["bytes"]}
        shutil.rmtree(d, ignore_errors=True)
    return entries
