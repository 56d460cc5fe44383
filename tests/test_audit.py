"""`batches.jsonl` and `mspretrain audit`: a clean history is "exact"; each injected fault is named
with its step. The unit part runs on hand-written histories (the plan is pure arithmetic); the
run part audits real runs (resumed, rewound, on another world size) in test_audit_runs."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from mspretrain.data.order import SamplePlan, batch_hash
from mspretrain.monitor.batch_log import BatchLog, truncate


def _log(tmp_path: Path, steps: int, plan: SamplePlan, g: int = 4) -> list[dict]:
    log = BatchLog(tmp_path, plan=plan, global_batch=g, enabled=True)
    pos = [0]
    for s in range(1, steps + 1):
        log.step(s, pos, world=1, lr=1e-3, scale=1.0, finite=True)
        pos = plan.advance(pos, g)
    log.close()
    return [json.loads(x) for x in (tmp_path / "batches.jsonl").read_text().splitlines()]


def test_records_name_the_plans_batch(tmp_path):
    plan = SamplePlan((23,), (1.0,), seed=3)
    recs = _log(tmp_path, 7, plan)
    assert [r["step"] for r in recs] == list(range(1, 8))
    assert [r["pos"] for r in recs] == [[4 * i] for i in range(7)]
    assert all(r["hash"] == batch_hash(plan.batch(r["pos"], 4)) for r in recs)


def test_truncate_keeps_the_history_of_the_saved_weights(tmp_path):
    p = tmp_path / "batches.jsonl"
    lines = [{"step": s} for s in (1, 2, 3, 4)] + [{"rewind": {"from": 4, "to": 2, "skip": 1, "pos": [0]}}] \
        + [{"step": 3}, {"step": 4}, {"step": 5}]
    p.write_text("".join(json.dumps(x) + "\n" for x in lines))
    truncate(p, 3)  # the checkpoint of step 3 was written after the rewind: keep the rewind
    got = [json.loads(x) for x in p.read_text().splitlines()]
    assert got == lines[:6]
    truncate(p, 2)
    assert [json.loads(x) for x in p.read_text().splitlines()] == lines[:2]
    np.testing.assert_equal(p.with_suffix(".jsonl.tmp").exists(), False)
