"""CPU isolation: keep the training process from starving the host (field report §3.9).

Design choices:
- Preferred: cgroup v2 `cpu.max` — a hard quota of `percent` of all cores, enforced by the
  kernel for every thread the process (and MindSpore's pools) will ever start. It needs root and a
  writable cgroup v2 hierarchy with the cpu controller. We create `mspretrain-<pid>` under the
  hierarchy root, enable `+cpu` in the root's `cgroup.subtree_control`, write
  `cpu.max = "<quota> <period>"` and move this pid in. The field report's cgroup v1 recipe
  (`cfs_quota_us` / `cfs_period_us`) expresses the same ratio.
- Fallback (not root, cgroup v1, read-only /sys/fs/cgroup in a container): pin the process to
  round(percent% x cores) cores with `sched_setaffinity` and lower its priority with `nice`. This
  is softer — it bounds cores, not time — and the function says which path it took and why.
- Data-loading threads are sized to the quota (at least one), so a quota of 1.2 cores does not
  run eight loader threads that fight for it.
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Callable

from mspretrain.errors import UserError

CGROUP_ROOT = Path("/sys/fs/cgroup")
PERIOD_US = 100_000
NICE_INCREMENT = 10


def cgroup_v2_writable(root: Path = CGROUP_ROOT, *, euid: int | None = None) -> tuple[bool, str]:
    """Whether a child cgroup with a cpu quota can be made under `root`, and if not, why."""
    euid = os.geteuid() if euid is None else euid
    if euid != 0:
        return False, "not root"
    controllers = root / "cgroup.controllers"
    if not controllers.is_file():
        return False, f"{root} is not a cgroup v2 hierarchy (no cgroup.controllers)"
    try:
        if "cpu" not in controllers.read_text().split():
            return False, "the cpu controller is not available in cgroup v2"
    except OSError as exc:
        return False, f"cannot read {controllers}: {exc}"
    if not os.access(root, os.W_OK):
        return False, f"{root} is read-only"
    return True, ""


def _cgroup(percent: float, cores_equiv: float, root: Path, pid: int) -> dict:
    quota = max(1000, int(round(cores_equiv * PERIOD_US)))  # the kernel's minimum is 1 ms
    group = root / f"mspretrain-{pid}"
    subtree = root / "cgroup.subtree_control"
    if "cpu" not in subtree.read_text().split():
        subtree.write_text("+cpu")
    group.mkdir(exist_ok=True)
    (group / "cpu.max").write_text(f"{quota} {PERIOD_US}")
    (group / "cgroup.procs").write_text(str(pid))
    return {"method": "cgroup", "cgroup": str(group), "cpu_max": f"{quota} {PERIOD_US}"}


def _affinity(cores_equiv: float, pid: int) -> dict:
    allowed = sorted(os.sched_getaffinity(pid))
    keep = allowed[:max(1, min(len(allowed), int(round(cores_equiv))))]
    os.sched_setaffinity(pid, keep)
    before = os.getpriority(os.PRIO_PROCESS, pid)
    try:
        os.setpriority(os.PRIO_PROCESS, pid, min(19, before + NICE_INCREMENT))
    except OSError:
        pass  # an unprivileged process may already be at its floor
    return {"method": "affinity", "cpus": keep, "nice": os.getpriority(os.PRIO_PROCESS, pid)}


def apply_cpu_quota(percent: float, log: Callable[[str], None] = print, *, cgroup_root: Path = CGROUP_ROOT,
                    pid: int | None = None, euid: int | None = None) -> dict:
    """Limit this process to `percent` % of all cores; return what was done.

    Keys: method ("cgroup" | "affinity" | "none"), percent, cores (the quota in cores),
    data_threads, and cgroup/cpu_max or cpus/nice, plus reason when the cgroup path was not taken.
    """
    if not 0 <= percent <= 100 or math.isnan(percent):
        raise UserError(f"cpu quota {percent}% is outside 0-100", "give a share of all cores, e.g. --cpu-quota 60%")
    ncpu = os.cpu_count() or 1
    if percent == 0:
        return {"method": "none", "percent": 0.0, "cores": float(ncpu), "data_threads": ncpu}
    pid = os.getpid() if pid is None else pid
    cores_equiv = percent / 100.0 * ncpu
    result: dict = {"percent": float(percent), "cores": cores_equiv,
                    "data_threads": max(1, int(math.floor(cores_equiv)))}
    ok, why = cgroup_v2_writable(cgroup_root, euid=euid)
    if ok:
        try:
            result.update(_cgroup(percent, cores_equiv, cgroup_root, pid))
            log(f"cpu quota: {percent:g}% of {ncpu} cores = {cores_equiv:.2f} cores via cgroup v2 "
                f"({result['cgroup']}, cpu.max {result['cpu_max']}); {result['data_threads']} data threads")
            return result
        except OSError as exc:
            why = f"cgroup v2 write failed: {exc}"
    result["reason"] = why
    result.update(_affinity(cores_equiv, pid))
    log(f"cpu quota: cgroup v2 not usable ({why}); fell back to CPU affinity {result['cpus']} and nice "
        f"{result['nice']} — this bounds cores, not CPU time; {result['data_threads']} data threads")
    return result
