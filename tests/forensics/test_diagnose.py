"""`diagnose`: every planted problem in the fixture logs is found at its file:line; a clean run is clean."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from mspretrain.cli import main
from mspretrain.errors import UserError
from mspretrain.forensics.diagnose import diagnose

LOGS = Path(__file__).parents[1] / "fixtures" / "logs"
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


# ---------------------------------------------------------------- --hang (heartbeats)
def _beats(run: Path, now: float, ranks: list[dict]) -> None:
    """Heartbeat files as the writer leaves them (monitor/heartbeat.py's record)."""
    import socket

    d = run / "heartbeat"
    d.mkdir(parents=True, exist_ok=True)
    for r in ranks:
        rec = {"rank": r["rank"], "world": len(ranks), "step": r["step"], "phase": r["phase"], "collectives": r["step"] * 6,
               "collectives_per_step": 6, "pid": 1000 + r["rank"], "host": r.get("host", socket.gethostname()),
               "time": now - r.get("age", 1.0), "phase_since": now - r.get("phase_s", 1.0), "started": now - 500}
        (d / f"rank_{r['rank']:05d}.json").write_text(json.dumps(rec))


def test_hang_names_the_lagging_rank_and_its_phase(tmp_path):
    from mspretrain.forensics.diagnose import hang_report

    now = 10_000.0
    running = lambda pid: "running"
    _beats(tmp_path, now, [{"rank": 0, "step": 57, "phase": "step", "phase_s": 3}, {"rank": 1, "step": 57, "phase": "data", "phase_s": 1}])
    text, lag = hang_report(tmp_path, now=now, probe=running)
    assert not lag and "all ranks agree: step 57" in text

    # rank 1 is SIGSTOPped while fetching data; rank 0 waits in the step's collectives
    _beats(tmp_path, now, [{"rank": 0, "step": 57, "phase": "step", "phase_s": 40},
                           {"rank": 1, "step": 57, "phase": "data", "phase_s": 41, "age": 41}])
    text, lag = hang_report(tmp_path, now=now, probe=lambda pid: "stopped" if pid == 1001 else "running")
    assert lag
    first = text.splitlines()[1]
    assert first.startswith("LAGGING: rank 1 is stopped") and "step 57 (phase data" in first
    assert "rank 0: step 57, phase step" in text and "waiting for the lagging rank" in text
    # the same seen from another host (no /proc): silent while the others beat
    text, lag = hang_report(tmp_path, now=now, probe=lambda pid: "running" if pid == 1000 else "dead")
    assert lag and "LAGGING: rank 1 died" in text
    _beats(tmp_path, now, [{"rank": 0, "step": 57, "phase": "step", "phase_s": 40},
                           {"rank": 1, "step": 57, "phase": "data", "phase_s": 41, "age": 41, "host": "elsewhere"}])
    text, lag = hang_report(tmp_path, now=now, probe=running)
    assert lag and "LAGGING: rank 1 went silent" in text and "phase data" in text

    # alive and beating, but stuck in data loading while the peer waits in the step
    _beats(tmp_path, now, [{"rank": 0, "step": 12, "phase": "step", "phase_s": 90},
                           {"rank": 1, "step": 12, "phase": "data", "phase_s": 90}])
    text, lag = hang_report(tmp_path, now=now, probe=running)
    assert lag and "LAGGING: rank 1 is stuck outside the step" in text and "phase data" in text
    # a rank a step behind a peer that waits for it
    _beats(tmp_path, now, [{"rank": 0, "step": 12, "phase": "step", "phase_s": 90}, {"rank": 1, "step": 11, "phase": "eval", "phase_s": 5}])
    text, lag = hang_report(tmp_path, now=now, probe=running)
    assert lag and "LAGGING: rank 1 is behind at step 11 (phase eval" in text

    _beats(tmp_path, now, [{"rank": 0, "step": 8, "phase": "done", "age": 900}, {"rank": 1, "step": 8, "phase": "done", "age": 900}])
    text, lag = hang_report(tmp_path, now=now, probe=lambda pid: "dead")
    assert not lag and "all ranks finished at step 8" in text


def test_hang_cli_errors(tmp_path, capsys):
    assert main(["diagnose", str(tmp_path), "--hang"]) == 2
    err = capsys.readouterr().err
    assert "has no heartbeats" in err and len(err.strip().splitlines()) == 2
    assert main(["diagnose", str(tmp_path), "--hang", "--stale-after", "nan"]) == 2
    assert "argument --stale-after: nan is outside" in capsys.readouterr().err


def test_process_state_sees_a_stopped_and_a_dead_process():
    import signal
    import subprocess

    from mspretrain.monitor.ranks import process_state

    p = subprocess.Popen(["sleep", "60"])
    try:
        assert process_state(p.pid) == "running"
        os.kill(p.pid, signal.SIGSTOP)
        deadline = time.time() + 5
        while process_state(p.pid) != "stopped" and time.time() < deadline:
            time.sleep(0.02)
        assert process_state(p.pid) == "stopped"
    finally:
        p.kill()
        p.wait(timeout=10)
    assert process_state(p.pid) == "dead"


def test_watchdog_names_the_first_rank_gone_and_waits_out_a_stop(tmp_path):
    from mspretrain.launcher.watchdog import Watchdog, read_verdict, record_verdict

    now = 10_000.0
    _beats(tmp_path, now, [{"rank": 0, "step": 9, "phase": "step"}, {"rank": 1, "step": 9, "phase": "data"}])
    alive = {1000: "running", 1001: "running"}
    dog = Watchdog(tmp_path, since=now - 600, stop_grace_s=5, probe=lambda pid: alive[pid])
    assert dog.check(now) is None
    alive[1001] = "stopped"
    assert dog.check(now) is None and dog.check(now + 4.9) is None  # a short stop is tolerated
    v = dog.check(now + 5)
    assert v.message().startswith("rank 1 stopped at step 9 (phase data): its process 1001")
    # rank 1 dies; a poll later msrun has ended rank 0 too: rank 1, seen gone first, is named
    dog = Watchdog(tmp_path, since=now - 600, probe=lambda pid: alive[pid])
    alive.update({1000: "running", 1001: "dead"})
    assert dog.check(now).rank == 1
    alive[1000] = "dead"
    v = dog.check(now + 0.5)
    assert (v.rank, v.what) == (1, "died")
    record_verdict(tmp_path, v)
    assert read_verdict(tmp_path)["rank"] == 1
    # heartbeats of a job started before this launch are not watched
    assert Watchdog(tmp_path, since=now, probe=lambda pid: "dead").check(now) is None
    # a remote rank that went silent while the other beats
    _beats(tmp_path, now, [{"rank": 0, "step": 9, "phase": "step"}, {"rank": 1, "step": 9, "phase": "step", "age": 30, "host": "node2"}])
    v = Watchdog(tmp_path, since=now - 600, stale_s=20, probe=lambda pid: "running").check(now)
    assert (v.rank, v.what) == (1, "went silent")


def test_launch_finds_the_run_dir_and_refuses_bad_timeouts(capsys):
    from mspretrain.launcher.supervise import train_run_dir

    assert train_run_dir(["train", "--config", "c", "--run", "runs/x"]) == Path("runs/x")
    assert train_run_dir(["train", "--run=runs/y"]) == Path("runs/y")
    assert train_run_dir(["eval", "runs/x"]) is None
    assert main(["launch", "--nproc", "2", "--stop-grace", "-1", "--", "train", "--run", "r"]) == 2
    assert "argument --stop-grace: -1 is outside" in capsys.readouterr().err
    assert main(["launch", "--nproc", "1", "--nodes", "2", "--node-rank", "1", "--log-dir", "L", "--dry-run", "--", "train"]) == 0
    assert "--log_dir=L/node_1" in capsys.readouterr().out  # each node its own log dir
