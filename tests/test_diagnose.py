"""`diagnose`: every planted problem in the fixture logs is found at its file:line; a clean run is clean."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from mspretrain.cli import main
from mspretrain.errors import UserError
from mspretrain.ops.diagnose import diagnose

LOGS = Path(__file__).parent / "fixtures" / "logs"
BAD, CLEAN = LOGS / "run_bad", LOGS / "run_clean"

# kind -> (file, line) of the first evidence, as planted in tests/fixtures/logs/run_bad.
PLANTED = {
    "killed": ("msrun_log/scheduler.log", 2),
    "oom": ("msrun_log/worker_2.log", 15),
    "disk_full": ("train.log", 17),
    "comm_timeout": ("msrun_log/worker_1.log", 16),
    "nonfinite": ("metrics.jsonl", 90),
    "overflow": ("metrics.jsonl", 90),
    "loss_spike": ("metrics.jsonl", 60),
    "grad_norm": ("metrics.jsonl", 60),
    "straggler": ("msrun_log/worker_3.log", 4),
    "exception": ("msrun_log/worker_1.log", 20),
}


def line_of(rel: str, no: int) -> str:
    return (BAD / rel).read_text(encoding="utf-8").splitlines()[no - 1]


def test_each_planted_problem_found_with_its_evidence_line():
    found = {f.kind: f for f in diagnose(BAD)}
    assert set(found) == set(PLANTED)
    for kind, (rel, no) in PLANTED.items():
        f = found[kind]
        assert (f.file, f.line) == (rel, no), kind
        assert f.advice
    assert found["oom"].evidence == line_of("msrun_log/worker_2.log", 15).strip()
    assert found["nonfinite"].count == 5 and "step 90" in found["nonfinite"].evidence
    assert "rank 3" in found["straggler"].evidence
    assert "Error code: -9" in found["killed"].evidence


def test_clean_run_has_no_findings(capsys):
    assert diagnose(CLEAN) == []
    assert main(["diagnose", str(CLEAN)]) == 0
    assert "no problems found" in capsys.readouterr().out


def test_single_logfile_and_metrics_file():
    assert [f.kind for f in diagnose(BAD / "msrun_log" / "worker_2.log")] == ["oom"]
    kinds = {f.kind for f in diagnose(BAD / "metrics.jsonl")}
    assert kinds == {"nonfinite", "overflow", "loss_spike", "grad_norm"}


def test_kernel_oom_killer_is_killed_not_device_oom(tmp_path):
    log = tmp_path / "dmesg.log"
    log.write_text("[12345.6] Out of memory: Killed process 4312 (python) total-vm:99999kB\n"
                   "bash: line 1:  4312 Killed                  python train.py\n")
    found = diagnose(log)
    assert [(f.kind, f.line, f.count) for f in found] == [("killed", 1, 2)]


def test_cli_json_and_errors(capsys, tmp_path):
    assert main(["diagnose", str(BAD), "--json"]) == 1
    rows = json.loads(capsys.readouterr().out)
    assert {r["kind"] for r in rows} == set(PLANTED)
    assert main(["diagnose", str(tmp_path / "missing")]) == 2
    with pytest.raises(UserError):
        diagnose(tmp_path)  # an empty dir: nothing to read
