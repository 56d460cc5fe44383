"""`batches.jsonl` and `mspretrain audit`: a clean history is "exact"; each injected fault is named
with its step. The unit part runs on hand-written histories (the plan is pure arithmetic); the
run part audits real single-process runs, resumed and damaged; the msrun tests of
test_distributed.py audit a run resumed at another world size and one with rewinds."""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from mspretrain.cli import main
from mspretrain.data.order import SamplePlan, batch_hash
from mspretrain.monitor.batch_log import BatchLog, truncate
from mspretrain.ops.audit import audit_run
from tests.conftest import TINY, copy_run_at


def _log(tmp_path: Path, steps: int, plan: SamplePlan, g: int = 4) -> list[dict]:
    log = BatchLog(tmp_path, plan=plan, global_batch=g, enabled=True)
    pos = [0]
    for s in range(1, steps + 1):
        log.step(s, pos, world=1, lr=1e-3, scale=1.0, finite=True)
        pos = plan.advance(pos, g)
    log.close()
    return [r for r in map(json.loads, (tmp_path / "batches.jsonl").read_text().splitlines()) if "step" in r]


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


# ---------------------------------------------------------------- real runs
ARGS = ["--quiet", "checkpoint.every=1", "checkpoint.keep_last=20"]


def _train(data: Path, run: Path, steps: int, *extra: str) -> None:
    assert main(["train", "--config", str(TINY), "--data", str(data), "--run", str(run), *ARGS,
                 f"train.max_steps={steps}", *extra]) == 0


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory, tiny_data) -> Path:
    """9 steps in 4 sessions: started, then resumed 3 times with a raised budget. Read-only."""
    run = tmp_path_factory.mktemp("audit") / "run"
    for steps in (3, 5, 7, 9):
        _train(tiny_data, run, steps)
    return run


@pytest.mark.slow
def test_a_resumed_run_is_exact(resumed_run, capsys):
    a = audit_run(resumed_run)
    assert a.exact, a.findings
    assert a.steps == 9 and [r["step"] for r in a.resumes] == [3, 5, 7]
    assert main(["audit", str(resumed_run)]) == 0
    assert "exact:" in capsys.readouterr().out


def _rewrite_data_state(ckpt: Path, consumed: int) -> None:
    """Set a checkpoint's loader position and refresh its manifest, so that it still verifies."""
    ds = json.loads((ckpt / "data_state.json").read_text())
    ds["sources"][0]["consumed"] = consumed
    ds["samples"] = consumed
    (ckpt / "data_state.json").write_text(json.dumps(ds))
    manifest = json.loads((ckpt / "manifest.json").read_text())
    data = (ckpt / "data_state.json").read_bytes()
    manifest["files"]["data_state.json"].update(sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.slow
@pytest.mark.parametrize("consumed, what", [(16, "4 samples replayed"), (0, "20 samples replayed")])
def test_a_resume_with_a_rewound_or_lost_loader_state_is_named(resumed_run, tiny_data, tmp_path, consumed, what, capsys):
    """Step 5's checkpoint says the loader is at sample 16 (rewound by a step) or 0 (its data state
    lost and started over): training resumes without complaint, and the audit names step 6 and the checkpoint."""
    run = copy_run_at(resumed_run, tmp_path / "run", 5)
    _rewrite_data_state(run / "checkpoints" / "step_000005", consumed)
    _train(tiny_data, run, 7)
    a = audit_run(run)
    # and the checkpoint itself disagrees with the record (its loader state is not the one step 5 ends at)
    assert [(f.step, f.kind) for f in a.findings] == [(6, "data"), (5, "record")], a.findings
    assert what in a.findings[0].message and "step_000005" in a.findings[1].message
    assert main(["audit", str(run)]) == 1
    assert "step 6: [data]" in capsys.readouterr().out


@pytest.mark.slow
def test_duplicated_metrics_lines_are_named(resumed_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(resumed_run, run)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if json.loads(line)["step"] == 4)
    (run / "metrics.jsonl").write_text("\n".join(lines[:at + 1] + [lines[at]] + lines[at + 1:]) + "\n")
    a = audit_run(run)
    assert [(f.step, f.kind) for f in a.findings] == [(4, "metrics")], a.findings


@pytest.mark.slow
def test_a_step_recorded_twice_or_missing_is_named(resumed_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(resumed_run, run)
    lines = (run / "batches.jsonl").read_text().splitlines()
    steps = [json.loads(x).get("step") for x in lines]
    twice = lines[:steps.index(4) + 1] + [lines[steps.index(4)]] + lines[steps.index(4) + 1:]
    (run / "batches.jsonl").write_text("\n".join(twice) + "\n")
    assert ("step", 4) in [(f.kind, f.step) for f in audit_run(run).findings]
    gone = [x for x, s in zip(lines, steps) if s != 6]
    (run / "batches.jsonl").write_text("\n".join(gone) + "\n")
    assert ("step", 7) in [(f.kind, f.step) for f in audit_run(run).findings]


def test_audit_refuses_what_is_not_a_run(tmp_path, capsys):
    assert main(["audit", str(tmp_path)]) == 2
    assert "not a run dir" in capsys.readouterr().err
