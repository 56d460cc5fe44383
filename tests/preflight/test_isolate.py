"""CPU quota: cgroup v2 cpu.max on a (faked) writable hierarchy; affinity + nice fallback otherwise."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mspretrain.errors import UserError
from mspretrain.preflight.isolate import PERIOD_US, apply_cpu_quota, cgroup_v2_writable

ROOT = Path(__file__).resolve().parents[2]
NCPU = os.cpu_count() or 1


def fake_cgroup2(root: Path, controllers: str = "cpuset cpu io memory pids") -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "cgroup.controllers").write_text(controllers + "\n")
    (root / "cgroup.subtree_control").write_text("\n")
    return root


def test_cgroup_v2_path_writes_cpu_max_and_moves_the_pid(tmp_path):
    root = fake_cgroup2(tmp_path / "cg")
    msgs: list[str] = []
    res = apply_cpu_quota(50, msgs.append, cgroup_root=root, pid=4242, euid=0)
    group = root / "mspretrain-4242"
    quota = round(0.5 * NCPU * PERIOD_US)
    assert res["method"] == "cgroup" and res["cgroup"] == str(group)
    assert (group / "cpu.max").read_text() == f"{quota} {PERIOD_US}" == res["cpu_max"]
    assert (group / "cgroup.procs").read_text() == "4242"
    assert "+cpu" in (root / "cgroup.subtree_control").read_text()
    assert res["data_threads"] == max(1, int(0.5 * NCPU)) and res["cores"] == pytest.approx(0.5 * NCPU)
    assert "cgroup v2" in msgs[0]


def test_cgroup_availability_reasons(tmp_path):
    assert cgroup_v2_writable(fake_cgroup2(tmp_path / "a"), euid=1000) == (False, "not root")
    assert "not a cgroup v2" in cgroup_v2_writable(tmp_path / "none", euid=0)[1]
    assert "cpu controller" in cgroup_v2_writable(fake_cgroup2(tmp_path / "b", "memory pids"), euid=0)[1]
    assert cgroup_v2_writable(fake_cgroup2(tmp_path / "c"), euid=0) == (True, "")


def run_child(code: str) -> dict:
    """Run apply_cpu_quota in a child so the affinity and nice changes do not touch the test process."""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


CHILD = """
import json, os
from pathlib import Path
from mspretrain.preflight.isolate import apply_cpu_quota
before = os.getpriority(os.PRIO_PROCESS, 0)
res = apply_cpu_quota({pct}, lambda s: None{kw})
res["affinity_now"] = sorted(os.sched_getaffinity(0))
res["nice_before"] = before
print(json.dumps(res))
"""


@pytest.mark.parametrize("kw,reason", [
    (", euid=1000", "not root"),                                       # not root
    (", cgroup_root=Path('/nonexistent/cgroup')", "not a cgroup v2"),  # no cgroup v2 (cgroup v1 host, container)
    ("", None),                                                        # this machine as it is
])
def test_fallback_to_affinity_and_nice(kw, reason):
    res = run_child(CHILD.format(pct=50, kw=kw))
    if res["method"] == "cgroup":  # only on a host whose real /sys/fs/cgroup is writable cgroup v2
        assert reason is None
        return
    assert res["method"] == "affinity"
    assert reason is None or reason in res["reason"]
    assert res["affinity_now"] == res["cpus"] and len(res["cpus"]) == max(1, round(0.5 * NCPU))
    assert res["nice"] == min(19, res["nice_before"] + 10)
    assert res["data_threads"] == max(1, int(0.5 * NCPU))


def test_write_failure_falls_back(tmp_path):
    root = fake_cgroup2(tmp_path / "cg")
    (root / "cgroup.subtree_control").unlink()
    (root / "cgroup.subtree_control").mkdir()  # reading it fails like a kernel refusal would
    res = run_child(CHILD.format(pct=100, kw=f", cgroup_root=Path({str(root)!r}), euid=0"))
    assert res["method"] == "affinity" and "cgroup v2 write failed" in res["reason"]


def test_zero_is_off_and_nonsense_is_refused():
    assert apply_cpu_quota(0)["method"] == "none"
    for bad in (-5, 150, float("nan")):
        with pytest.raises(UserError):
            apply_cpu_quota(bad)
