"""MindSpore's own check of the collectives' runtime order across ranks, for `selftest` (issue 51.7).

The kernel order a rank runs is built by the backend from its graph (not the IR listing the
collective-sequence test reads), and 2.10 gives each communication group a stream of its own, so
only the runtime shows what HCCL pairs. MindSpore 2.10 records it: `mindspore.utils.
comm_exec_order_check("start")` ... `("end")` around the steps collects each communication
kernel as it runs (group, its ranks, primitive, root, shapes) into `rank_R/execute_order/
comm_execute_order.csv`, and `mindspore.utils.runtime_execution_order_check(folders)` pairs every
rank's n-th collective of each kind and group with the others' and looks for a cycle among the
ranks' waits (mindspore/utils/runtime_execution_order_check.py; it logs its verdict through
mindspore's logger and returns nothing). Both are documented "Supported Platforms: Ascend": the
collection is selected by device (`wanted`); the verdict runs MindSpore's checker on whatever
files are found, which a CPU test feeds with hand-written files. Where the C++ side writes the
files (`execute_order_tracker.cc`: "execute_order/comm_execute_order.csv" under a dump path it
does not document) is a guess here: a `rank_R` folder in the worker's working directory, where
MindSpore puts its other per-rank files (`rank_R/om/analyze_fail.ir`). Only a 910B confirms it.
The checker reads a record's `root_rank` as a world rank (`parse_and_validate` expects the record
on every rank named in its first two brackets, commRank and rootRank); whether the tracker writes a
sub-group Broadcast's root as the world rank or as the rank inside the group (what HCCL reads,
issue 51.1) only a 910B shows: in the latter case MindSpore's check would report a correct
broadcast on `dp_1` as unpaired.
"""
from __future__ import annotations

import logging
from pathlib import Path

COMM_FILE = Path("execute_order") / "comm_execute_order.csv"
# The steps the selftest's workers run inside the collection, in this order (preflight/selftest_order.py):
# a ZeRO-2, a tensor-parallel and a ZeRO-3 step, each layout's collectives on its own groups.
STEPS = ("zero2", "tp", "zero3")


def wanted(target: str) -> bool:
    """Collect the runtime order: on Ascend only (MindSpore's check supports Ascend only)."""
    return target == "ascend"


def steps(target: str) -> list[str]:
    """The steps the workers run: all of STEPS where the order is collected; elsewhere only the
    ZeRO-2 step, which the selftest compares with one process (the others exist for the order)."""
    return list(STEPS) if wanted(target) else ["zero2"]


def collect(target: str, action: str) -> None:
    """`comm_exec_order_check(action)` ("start" / "end") where it is wanted, nothing elsewhere."""
    if not wanted(target):
        return
    from mindspore.utils import comm_exec_order_check

    comm_exec_order_check(action)


def rank_folders(roots: list[Path]) -> list[Path]:
    """The `rank_R` folders holding a comm_execute_order.csv under any of `roots`, by rank."""
    found = {}
    for root in roots:
        for d in Path(root).glob("rank_*"):
            if (d / COMM_FILE).is_file() and d.name.split("_", 1)[1].isdigit():
                found.setdefault(d.name, d.resolve())
    return [found[k] for k in sorted(found, key=lambda k: int(k.split("_", 1)[1]))]


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def verdict(folders: list[Path]) -> tuple[bool | None, str]:
    """(passed, what MindSpore's checker said) for the ranks' files; (None, why) without any."""
    if not folders:
        return None, "no rank_R/execute_order/comm_execute_order.csv was written (where 2.10 writes it is unverified)"
    from mindspore.log import _get_logger
    from mindspore.utils import runtime_execution_order_check

    log = _get_logger()
    handler, level = _Records(), log.level
    log.addHandler(handler)
    log.setLevel(logging.WARNING)  # its success line is a warning; GLOG_v=3 would drop it
    try:
        runtime_execution_order_check([str(f) for f in folders], all_rank=True)
    except ValueError as exc:  # a folder it refuses
        return False, str(exc).splitlines()[0]
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    errors = [r.getMessage() for r in handler.records if r.levelno >= logging.ERROR]
    ok = any("Cycle Check success" in r.getMessage() for r in handler.records)
    if errors or not ok:
        return False, (errors[0] if errors else "MindSpore's checker did not report success").splitlines()[0][:300]
    return True, f"{len(folders)} ranks: every collective paired, no cycle (mindspore.utils.runtime_execution_order_check)"
