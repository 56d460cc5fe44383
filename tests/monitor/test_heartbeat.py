"""Heartbeat files: the format, atomic replacement, and the rate limit that keeps them off the hot path."""
from __future__ import annotations

import json
import os
import time

from mspretrain.monitor.heartbeat import Heartbeat, heartbeat_path, read_heartbeats


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_writes_are_rate_limited_except_phases_that_matter(tmp_path):
    clock = FakeClock()
    hb = Heartbeat(tmp_path, rank=3, world=4, collectives_per_step=5, interval=2.0, clock=clock, thread=False)
    assert hb.writes == 1  # the "start" record, so a rank that hangs before step 1 is visible
    path = heartbeat_path(tmp_path, 3)
    assert path.name == "rank_00003.json" and path.parent.name == "heartbeat"
    hb.phase("compile", 0)
    assert hb._flush()  # urgent: written at once
    # 1,000 steps inside one interval: data/step phases only, no write at all
    for step in range(1000):
        hb.phase("data", step)
        hb.phase("step")
        assert not hb._flush()
    assert hb.writes == 2
    clock.t = 2.0  # the interval has passed: the thread's next flush writes the newest state
    assert hb._flush()
    rec = json.loads(path.read_text())
    assert (rec["rank"], rec["world"], rec["step"], rec["phase"]) == (3, 4, 999, "step")
    assert rec["collectives"] == 999 * 5 and rec["collectives_per_step"] == 5
    assert rec["pid"] == os.getpid() and rec["host"] and abs(rec["time"] - time.time()) < 60
    hb.phase("save", 1000)
    assert hb._flush() and not hb._flush()  # urgent once, then the rate limit again
    hb.close(step=1000)
    assert json.loads(path.read_text())["phase"] == "done" and hb.writes == 5
    assert not list(path.parent.glob(".*tmp"))  # atomic writes leave no temporary file


def test_thread_writes_on_its_own_and_urgent_phases_at_once(tmp_path):
    start = time.monotonic()
    hb = Heartbeat(tmp_path, rank=0, interval=0.2)
    path = heartbeat_path(tmp_path, 0)
    t0 = json.loads(path.read_text())["time"]
    # no calls from the "loop": the thread keeps the heartbeat fresh. Waited for (two writes of
    # its own), then bounded by the time that really passed: a fixed 0.7 s sleep woken late on a
    # loaded machine let more writes happen than its bound allowed.
    while hb.writes < 3 and time.monotonic() - start < 10:
        time.sleep(0.02)
    elapsed = time.monotonic() - start
    assert json.loads(path.read_text())["time"] > t0
    assert 3 <= hb.writes <= 2 + elapsed / 0.2, (hb.writes, elapsed)  # about one per interval, not a busy loop
    hb.interval = 60.0
    time.sleep(0.3)  # let the thread sleep on the long interval
    hb.phase("save", 7)
    deadline = time.time() + 5
    while json.loads(path.read_text())["phase"] != "save" and time.time() < deadline:
        time.sleep(0.02)
    assert json.loads(path.read_text())["phase"] == "save"  # woken at once, not after 60 s
    hb.close()
    assert json.loads(path.read_text())["phase"] == "done"


def test_read_heartbeats_keeps_the_current_world(tmp_path):
    for rank in range(4):  # an old 4-rank job
        Heartbeat(tmp_path, rank=rank, world=4, thread=False)
    d = tmp_path / "heartbeat"
    for rank in range(4):
        rec = json.loads((d / f"rank_{rank:05d}.json").read_text())
        rec["time"] -= 1000
        (d / f"rank_{rank:05d}.json").write_text(json.dumps(rec))
    for rank in range(2):  # relaunched on 2 ranks
        Heartbeat(tmp_path, rank=rank, world=2, thread=False)
    (d / "rank_00009.json").write_text("{not json")
    assert [b["rank"] for b in read_heartbeats(tmp_path)] == [0, 1]
    assert read_heartbeats(tmp_path / "nothing") == []


def test_loop_calls_mark_the_first_step_compile(tmp_path):
    hb = Heartbeat(tmp_path, rank=0, thread=False)
    hb.data(0)
    assert hb._phase == "compile"
    hb.running()
    assert hb._phase == "compile"
    hb.finished(1)
    hb.data(1)
    assert (hb._phase, hb._step) == ("data", 1)
    hb.running()
    assert hb._phase == "step"
    hb.close("done", 1)
    hb.close("failed", 1)  # a finally after the normal end changes nothing
    assert json.loads(heartbeat_path(tmp_path, 0).read_text())["phase"] == "done"
