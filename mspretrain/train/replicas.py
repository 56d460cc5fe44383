"""Data-parallel replicas must hold identical weights: each rank records a hash of its own at the
end of a run (RUN_DIR/ranks/rank_R.json), which `diagnose` and the tests compare."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any


def record_weights_hash(run_dir: Path, *, rank: int, world: int, step: int, model: Any, step_fn: Any = None) -> None:
    """`step_fn`: the run's step. Where the model holds slices or pieces (ZeRO-3, tensor parallel:
    its plan says so, mspretrain/parallel/plan.py) the digest is the step's `weights_digest`, a
    collective every rank calls that reads one whole parameter at a time (`full_weights` gathered
    the whole model onto every rank's host and device at once: 61 GiB for Qwen3-14B under ZeRO-3,
    the job exited non-zero after its final checkpoint, issue 51.4); else the model's own weights."""
    if world == 1:
        return
    if step_fn is not None and step_fn.plan.holds_pieces:
        value = step_fn.weights_digest()
    else:
        from mspretrain.model.decoder import state_numpy

        h = hashlib.sha256()
        for name, arr in sorted(state_numpy(model).items()):
            h.update(name.encode())
            h.update(arr.tobytes())
        value = h.hexdigest()
    ranks = Path(run_dir) / "ranks"
    ranks.mkdir(parents=True, exist_ok=True)
    (ranks / f"rank_{rank}.json").write_text(
        json.dumps({"rank": rank, "step": step, "weights_sha256": value}), encoding="utf-8")
