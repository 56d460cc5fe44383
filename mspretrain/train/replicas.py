"""Data-parallel replicas must hold identical weights: each rank records a hash of its own at the
end of a run (RUN_DIR/ranks/rank_R.json), which `diagnose` and the tests compare."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable


def record_weights_hash(run_dir: Path, *, rank: int, world: int, step: int, model: Any,
                        weights: Callable[[], dict[str, Any]] | None = None) -> None:
    """`weights`: the whole weights where the model holds slices or pieces (ZeRO-3, tensor
    parallel: a collective every rank calls). Where `weights` is a step's `full_weights`, the
    step's `weights_digest` is used instead: the same digest, read one parameter at a time, where
    `full_weights` gathered the whole model onto every rank's host and device at once (61 GiB for
    Qwen3-14B under ZeRO-3: the job exited non-zero after its final checkpoint, issue 51.4)."""
    if world == 1:
        return
    digest = getattr(getattr(weights, "__self__", None), "weights_digest", None)
    if digest is not None:
        value = digest()
    else:
        from mspretrain.model.decoder import state_numpy

        h = hashlib.sha256()
        for name, arr in sorted((weights() if weights is not None else state_numpy(model)).items()):
            h.update(name.encode())
            h.update(arr.tobytes())
        value = h.hexdigest()
    ranks = Path(run_dir) / "ranks"
    ranks.mkdir(parents=True, exist_ok=True)
    (ranks / f"rank_{rank}.json").write_text(
        json.dumps({"rank": rank, "step": step, "weights_sha256": value}), encoding="utf-8")
