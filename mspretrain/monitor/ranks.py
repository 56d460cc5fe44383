"""Each rank's state, read from its heartbeat file and, for a local rank, from /proc: running,
behind, stuck, stale, stopped, dead, failed or done. What `diagnose --hang` reports and what
`launch`'s watchdog acts on; both read it here, so they agree on what a lagging rank is.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# A heartbeat older than this while another rank's is fresh means the rank is not running (the
# writer thread beats every 2 s even while the step waits in a collective).
STALE_S = 20.0
# Graph compilation may hold the interpreter: a compiling rank gets this long before it counts as stale.
COMPILE_STALE_S = 300.0


@dataclass
class RankBeat:
    rank: int
    step: int
    phase: str
    age_s: float
    host: str
    pid: int
    collectives: int
    process: str  # "running", "stopped", "dead", "zombie", or "remote" (another host: not probed)
    status: str = "ok"  # "ok", "behind", "stuck", "stale", "stopped", "dead", "failed", "done"
    phase_s: float = 0.0


def process_state(pid: int) -> str:
    """The state of a local process from /proc: "running", "stopped" (SIGSTOP, a debugger),
    "zombie" or "dead" (no such process)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "dead"
    state = stat.rsplit(")", 1)[1].split()[0]
    return {"T": "stopped", "t": "stopped", "Z": "zombie", "X": "dead"}.get(state, "running")


def rank_states(run_dir: Path, *, now: float | None = None, stale_s: float = STALE_S, probe=process_state,
                since: float | None = None) -> list[RankBeat]:
    """Each rank's last heartbeat, classified. `since`: ignore heartbeats of jobs started before
    (the launch watchdog passes its own start time, so an old job's files do not count)."""
    import socket
    import time

    from mspretrain.monitor.heartbeat import read_heartbeats

    now = time.time() if now is None else now
    host = socket.gethostname()
    beats = [b for b in read_heartbeats(run_dir) if since is None or float(b.get("started", 0)) >= since]
    out = []
    for b in beats:
        local = b.get("host") == host
        proc = probe(int(b.get("pid", 0))) if local else "remote"
        out.append(RankBeat(int(b["rank"]), int(b["step"]), str(b["phase"]), max(0.0, now - float(b["time"])), str(b.get("host", "?")),
                            int(b.get("pid", 0)), int(b.get("collectives", 0)), proc,
                            phase_s=max(0.0, now - float(b.get("phase_since", b["time"])))))
    if not out:
        return out
    top = max(r.step for r in out)
    fresh = [r for r in out if r.age_s <= stale_s]
    # ranks inside the compiled step for long, still beating: waiting for a peer in a collective
    waiting = [r for r in fresh if r.phase == "step" and r.phase_s > stale_s]
    for r in out:
        limit = COMPILE_STALE_S if r.phase == "compile" else stale_s
        if r.phase == "done":
            r.status = "done"
        elif r.phase == "failed":
            r.status = "failed"  # the rank's loop ended on an exception (the heartbeat's last word)
        elif r.process in ("dead", "zombie"):
            r.status = "dead"
        elif r.process == "stopped":
            r.status = "stopped"
        elif r.age_s > limit and any(o is not r for o in fresh):  # it went quiet while others still beat
            r.status = "stale"
        elif r.step < top - 1 or (r.step < top and waiting):
            r.status = "behind"  # ranks of a synchronous job are at most one step apart unless someone waits
        elif r.phase not in ("step", "compile") and r.phase_s > stale_s and any(o.step == r.step for o in waiting):
            r.status = "stuck"  # in data/eval/save for long while a peer waits in the step's collectives
    return out


def lagging(states: list[RankBeat]) -> list[RankBeat]:
    return [r for r in states if r.status not in ("ok", "done")]


def describe(r: RankBeat) -> str:
    """One rank in one line: what it is, where it is, since when."""
    what = {"dead": f"died (process {r.pid} on {r.host} is gone)", "stopped": f"is stopped (process {r.pid} on {r.host}: SIGSTOP or a debugger)",
            "stale": f"went silent (no heartbeat for {r.age_s:.0f} s while the other ranks still beat)",
            "failed": "stopped on an error (its worker log has it)", "behind": "is behind",
            "stuck": "is stuck outside the step while the others wait for it", "ok": "ok",
            "done": "finished"}[r.status]
    return (f"rank {r.rank} {what} at step {r.step} (phase {r.phase} for {r.phase_s:.0f} s, collective #{r.collectives}); "
            f"heartbeat {r.age_s:.0f} s old")

