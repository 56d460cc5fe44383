"""`RUN_DIR/spikes/step_SSSSSS.json`: the batch of a step the spike detector flagged, kept when it fires.

`mspretrain spike RUN --step S` lists a step's samples from `batches.jsonl` and the loader's pure
plan; this record keeps the same list for the steps that matter most, in a file a person can read
and that survives the data dir being moved or re-prepared (the plan would then give other windows).

Each record holds the step, the loader position before it (per-source consumed counts), the hash
of the global batch (`data/order.batch_hash`), the loss, the world size and micro-batch, and every
sample: its global position, rank, micro-batch, source (data dir), window and the ids of the
documents the window overlaps (their index in the source's train split); the samples this rank
(rank 0) trained on also carry their mean token loss as the step computed it (`_row_nll`).

Design choices:
- A train loop callback (`post_step`), rank 0 only, doing nothing on an ordinary step: the
  document ends of a source (O(documents) int64) are read on the first spike, not at start-up.
- Everything comes from the callback's arguments: the loader state before the step names the
  sources, their window counts, the seed, the world and the micro-batch, so the plan is rebuilt
  from it and the record needs no handle on the loader.
- The step that ran is counted like `batch_log.BatchLog` does: a spike with `spike.action =
  "rewind"` has already moved the loop's counter back when the callback runs.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from mspretrain.budget import position_of_row, row_of_position
from mspretrain.data.order import SamplePlan, batch_hash
from mspretrain.data.origin import docs_in_window
from mspretrain.data.shards import IndexedDataset
from mspretrain.fsutil import atomic_write
from mspretrain.monitor.callback import Callback, DataState, Values
from mspretrain.paths import DataPaths, step_dir_name

DIR = "spikes"


def record_path(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / DIR / f"{step_dir_name(step)}.json"


def doc_ends(data_dir: str | Path, split: str = "train") -> np.ndarray:
    """Cumulative token end of every document of a split (document d is [ends[d-1], ends[d]))."""
    return np.cumsum(IndexedDataset(DataPaths(data_dir).prefix(split)).lengths, dtype=np.int64)


def window_docs(ends: np.ndarray, seq_len: int, window: int) -> list[int]:
    """Ids of the documents that window `window` overlaps (any of its seq_len + 1 tokens)."""
    return [d for d, _, _ in docs_in_window(ends, seq_len, int(window))]


def plan_of_state(data_state: dict[str, Any]) -> SamplePlan:
    """The sample plan of a loader state (`Loader.state()`): its sources' windows, weights and seed."""
    src = data_state["sources"]
    return SamplePlan(windows=tuple(int(s["samples_per_epoch"]) for s in src),
                      weights=tuple(float(s["weight"]) for s in src), seed=int(data_state["seed"]))


def batch_samples(ids: np.ndarray, *, sources: list[str], ends: list[np.ndarray], seq_len: int, micro: int,
                  world: int) -> list[dict[str, Any]]:
    """One dict per sample of a global batch `ids` ((n, 2): source index, window), in global order."""
    out = []
    for p, (j, w) in enumerate(ids.tolist()):
        rank, row = row_of_position(p, micro=micro, world=world)
        out.append({"position": p, "rank": rank, "micro": row // micro, "source": sources[j], "window": int(w),
                    "documents": window_docs(ends[j], seq_len, w)})
    return out


class SpikeRecord(Callback):
    """Writes RUN_DIR/spikes/step_SSSSSS.json when a step's values carry `spike` (rank 0 only).

    `global_batch` is the run's (train.global_batch): the loader state knows the micro-batch and the
    world, not the accumulation. `resume_step` is the step the run resumed at (None: from 0)."""

    def __init__(self, run_dir: str | Path, *, global_batch: int, enabled: bool = True,
                 resume_step: int | None = None) -> None:
        self.run_dir, self.global_batch, self.enabled = Path(run_dir), int(global_batch), enabled
        self._last = resume_step
        self._ends: dict[str, np.ndarray] = {}

    def post_step(self, step: int, data_state: DataState, values: Values) -> None:
        ran = step if self._last is None or "rewind" not in values else self._last + 1
        self._last = int(values["rewind"]) if "rewind" in values else ran
        if self.enabled and "spike" in values:
            self.write(ran, data_state, values)

    def write(self, step: int, data_state: dict[str, Any], values: dict[str, float]) -> Path:
        pos = [int(s["consumed"]) for s in data_state["sources"]]
        paths = [str(s["path"]) for s in data_state["sources"]]
        for p in paths:
            if p not in self._ends:
                self._ends[p] = doc_ends(p)
        ids = plan_of_state(data_state).batch(pos, self.global_batch)
        rec = {"step": step, "pos": pos, "hash": batch_hash(ids), "loss": float(values["loss"]),
               "grad_norm": float(values.get("grad_norm", float("nan"))), "world": int(data_state["world"]),
               "micro_batch": int(data_state["batch_size"]), "global_batch": self.global_batch,
               "seq_len": int(data_state["seq_len"]),
               "samples": batch_samples(ids, sources=paths, ends=[self._ends[p] for p in paths],
                                        seq_len=int(data_state["seq_len"]), micro=int(data_state["batch_size"]),
                                        world=int(data_state["world"]))}
        rows = values.get("_row_nll")  # this rank's (rank 0's) samples' NLL sums, in micro-batch order
        if rows is not None:
            micro, world, seq = int(data_state["batch_size"]), int(data_state["world"]), int(data_state["seq_len"])
            for k, nll in enumerate(np.asarray(rows, dtype=np.float64).reshape(-1).tolist()):
                rec["samples"][position_of_row(k, rank=0, micro=micro, world=world)]["loss"] = nll / seq
        path = record_path(self.run_dir, step)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps(rec, indent=1) + "\n")
        return path
