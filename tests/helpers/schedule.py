"""`make test`'s xdist scheduling (`--dist loadfile`, two workers): a worker is not handed a file
that launches ranks while the other worker still has one to run, if any other file is left.

Why: two msrun jobs never run at once (tests/conftest.py `one_msrun_at_a_time`), so a worker that
reaches a test with an msrun job while the other runs one waits for the lock; with the files that
launch ranks first in the queue (conftest `groups`, for the tail), both workers ran them side by
side and waited on each other: 361 s of wall in lock waits in the first 16 minutes of a fresh-clone
`make test` (round nine, the `lock_wait` lines of tests/cpu_plugin.py), a core idle wherever the
holder's job did not use both. Handed apart, one worker takes the launching files one after another
while the other runs the rest; they meet only when one kind is used up.

The workers tell the controller which files launch ranks (`write_msrun_files`, from conftest's
collection hook: the controller collects nothing), in the run's shared temp dir."""
from __future__ import annotations

import json
import os
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path

MSRUN_FILES = "msrun-files.json"


def next_scope(queue: OrderedDict[str, dict], others: list[Mapping[str, Mapping[str, bool]]], msrun: frozenset[str]) -> str:
    """The file to hand a worker next: the queue's first, unless another worker (`others`: each one's
    assigned files, test -> done) has a launching file with tests left to run and the queue holds a
    file that launches none; then the first of those."""
    first = next(iter(queue))
    busy = any(scope in msrun and not all(tests.values()) for work in others for scope, tests in work.items())
    if not busy:
        return first
    return next((s for s in queue if s not in msrun), first)


def write_msrun_files(shared_root: Path, files: list[str]) -> None:
    """A worker's list of the files that launch ranks, for the controller (written whole, then renamed)."""
    tmp = shared_root / f"{MSRUN_FILES}.{os.getpid()}"
    tmp.write_text(json.dumps(sorted(files)), encoding="utf-8")
    os.replace(tmp, shared_root / MSRUN_FILES)


def read_msrun_files(shared_root: Path) -> frozenset[str]:
    """The workers' list, or none (a run whose workers wrote nothing: the plain loadfile order)."""
    try:
        return frozenset(json.loads((shared_root / MSRUN_FILES).read_text(encoding="utf-8")))
    except (OSError, ValueError):
        return frozenset()


def make_scheduler(config, log):
    """xdist's LoadFileScheduling with `next_scope` choosing the file (xdist 3.8: the queue is an
    OrderedDict of file -> {test: done}, popped from the front by `_assign_work_unit`)."""
    from xdist.scheduler.loadfile import LoadFileScheduling

    class MsrunApart(LoadFileScheduling):
        def _assign_work_unit(self, node) -> None:
            if self.workqueue:
                msrun = read_msrun_files(self.config._tmp_path_factory.getbasetemp())
                others = [work for other, work in self.assigned_work.items() if other is not node]
                self.workqueue.move_to_end(next_scope(self.workqueue, others, msrun), last=False)
            super()._assign_work_unit(node)

    return MsrunApart(config, log)
