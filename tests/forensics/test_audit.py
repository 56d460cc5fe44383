"""`batches.jsonl` and `mspretrain audit`: a clean history is "exact"; each injected fault is named
with its step. The unit part runs on hand-written histories (the plan is pure arithmetic); the
run part audits real single-process runs, resumed and damaged; then runs of several sessions,
each step judged by its own session's settings; then forensics: the audit never certifies what it
cannot see (a record, a checkpoint or a config of another run). The msrun tests of
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
from mspretrain.forensics.audit import audit_run
from mspretrain.monitor.batch_log import BatchLog, truncate
from tests.conftest import NO_EVAL, ONE_LAYER, TINY, copy_run_at
from tests.forensics.planted import planted_data


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
ARGS = ["--quiet", "checkpoint.every=1", "checkpoint.keep_last=20", NO_EVAL, ONE_LAYER]  # the audit reads records, not layers


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


# ---------------------------------------------------------------- sessions: each step judged by its own session's settings
# (a raised budget, the quickstart's constant-lr continuation, --allow-data-change, --restart);
# several training sessions of their own (~80 s of CPU): make test runs them, make test-fast does not

@pytest.fixture(scope="module")
def run6(tmp_path_factory, tiny_data) -> Path:
    run = tmp_path_factory.mktemp("sessions") / "run"
    _train(tiny_data, run, 6)
    return run


def _lines(run: Path) -> list[str]:
    return (run / "batches.jsonl").read_text().splitlines()


@pytest.mark.slow
@pytest.mark.parametrize("keep", [0, 1, 4])
def test_an_empty_or_cut_record_is_incomplete_not_exact(run6, tmp_path, keep, capsys):
    run = tmp_path / "run"
    shutil.copytree(run6, run)
    lines = _lines(run)[:keep]  # the session marker and `keep - 1` steps, or nothing at all
    (run / "batches.jsonl").write_text("".join(x + "\n" for x in lines))
    a = audit_run(run)
    assert not a.exact and a.incomplete, a
    assert main(["audit", str(run)]) == 1
    out = capsys.readouterr().out
    assert "incomplete:" in out and "exact:" not in out


@pytest.mark.slow
def test_damaged_lines_are_findings_never_skipped(run6, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(run6, run)
    lines = _lines(run)
    rec = json.loads(lines[3])
    bad = [lines[0], lines[1], lines[2], json.dumps({**rec, "lr": "fast"}), *lines[4:]]
    (run / "batches.jsonl").write_text("".join(x + "\n" for x in bad))
    a = audit_run(run)
    assert not a.exact and [f.kind for f in a.findings][:1] == ["record"], a.findings


@pytest.mark.slow
def test_constant_lr_continuation_and_raised_budget_are_exact(run6, tiny_data, tmp_path, capsys):
    """quickstart "next (b)": continue at the final lr with a constant schedule; every earlier step
    was reported at the wrong lr before the record carried each session's schedule."""
    run = tmp_path / "run"
    shutil.copytree(run6, run)
    last_lr = [json.loads(x) for x in _lines(run) if '"step"' in x][-1]["lr"]
    _train(tiny_data, run, 8, "schedule.kind=constant", "schedule.warmup_steps=0", f"optim.lr={last_lr!r}")
    a = audit_run(run)
    assert a.exact, (a.findings, a.incomplete)
    assert any("schedule changed" in n for n in a.notes), a.notes
    # replay crosses the session boundary (step 5's config has a budget of 6 steps and a cosine)
    # with the lr every step ran at: bit for bit
    capsys.readouterr()
    assert main(["replay", str(run), "--from-step", "5", "--steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "reproduced steps 6..8 bit for bit" in out, out


@pytest.mark.slow
def test_allow_data_change_judges_each_session_by_its_data(run6, tiny_data, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(run6, run)
    other = planted_data(tmp_path / "other", tiny_data)  # same tokenizer, other documents
    _train(other, run, 8, "--allow-data-change")
    a = audit_run(run)
    assert a.exact, (a.findings, a.incomplete)
    assert any("data changed" in n for n in a.notes), a.notes


@pytest.mark.slow
def test_restart_starts_a_new_history(run6, tiny_data, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(run6, run)
    for d in (run / "checkpoints").iterdir():
        (d / "manifest.json").write_text("{")  # every checkpoint fails verification
    _train(tiny_data, run, 3, "--restart")
    a = audit_run(run)
    assert a.exact, (a.findings, a.incomplete)
    assert any("restarted from step 0" in n for n in a.notes), a.notes


# ----------------------------------------------------------------------------- forensics
def _resign(run: Path, seed: int) -> None:
    """Make run's batches.jsonl what a run with another seed would have written: every session's
    plan seed changed and every step's batch hash recomputed for it (self-consistent, but not
    this run's record: its checkpoints hold the run's own seed)."""
    from mspretrain.data.order import SamplePlan, batch_hash

    lines, plan, g = [], None, 0
    for line in (run / "batches.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "session" in rec:
            p = rec["session"]["plan"]
            p["seed"] = seed
            plan, g = SamplePlan(tuple(p["windows"]), tuple(p["weights"]), seed), rec["session"]["global_batch"]
        elif "step" in rec:
            rec["hash"] = batch_hash(plan.batch(rec["pos"], g))
        lines.append(json.dumps(rec))
    (run / "batches.jsonl").write_text("".join(x + "\n" for x in lines))


def _audit(run: Path):
    from mspretrain.forensics.audit import audit_run

    return audit_run(run)


def test_audit_is_not_exact_on_a_batch_record_of_another_run(reference_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(reference_run, run)
    assert _audit(run).exact
    _resign(run, 7)
    a = _audit(run)
    assert not a.exact
    assert any(f.kind == "record" and "data order seed 1234 (the record gives 7)" in f.message for f in a.findings), a.findings


def test_audit_is_not_exact_on_a_checkpoint_of_another_history(reference_run, tmp_path):
    """A checkpoint whose loader state is not where the record says the run was after that step."""
    run = tmp_path / "run"
    shutil.copytree(reference_run, run)
    ds_path = run / "checkpoints" / "step_000004" / "data_state.json"
    ds = json.loads(ds_path.read_text())
    ds["seed"] = 7
    ds_path.write_text(json.dumps(ds))
    a = _audit(run)
    assert not a.exact
    assert [(f.step, f.kind) for f in a.findings] == [(4, "record")], a.findings


def test_audit_is_not_exact_on_a_config_or_world_the_record_contradicts(reference_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(reference_run, run)
    cfg = (run / "config.toml").read_text()
    (run / "config.toml").write_text(cfg.replace("seed = 1234", "seed = 7"))
    assert "seed = 7" in (run / "config.toml").read_text()
    assert any("train.seed = 7" in f.message for f in _audit(run).findings)
    (run / "config.toml").write_text(cfg)
    lines = (run / "batches.jsonl").read_text().splitlines()
    at = next(i for i, x in enumerate(lines) if json.loads(x).get("step") == 3)
    rec = json.loads(lines[at])
    rec["world"] = 2
    lines[at] = json.dumps(rec)
    (run / "batches.jsonl").write_text("".join(x + "\n" for x in lines))
    a = _audit(run)
    assert [(f.step, f.kind) for f in a.findings] == [(3, "step")], a.findings


