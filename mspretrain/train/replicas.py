"""Data-parallel replicas must hold identical weights: each rank records a hash of its own at the
end of a run (RUN_DIR/ranks/rank_R.json), which `diagnose` and the tests compare."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable


def record_weights_hash(run_dir: Path, *, rank: int, world: int, step: int, model: Any,
                        weights: Callable[[], dict[str, Any]] | None = None) -> None:
    """`weights`: the whole weights where the model holds slices (ZeRO-3: a collective every rank calls)."""
    if world == 1:
        return
    from mspretrain.model.decoder import state_numpy

    h = hashlib.sha256()
    for name, arr in sorted((weights() if weights is not None else state_numpy(model)).items()):
        h.update(name.encode())
        h.update(arr.tobytes())
    ranks = Path(run_dir) / "ranks"
    ranks.mkdir(parents=True, exist_ok=True)
    (ranks / f"rank_{rank}.json").write_text(
        json.dumps({"rank": rank, "step": step, "weights_sha256": h.hexdigest()}), encoding="utf-8")
