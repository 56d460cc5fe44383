"""CPU seconds per test, children included: `pytest -p tests.cpu_plugin` appends one JSON line per
test (setup + call + teardown, so a session fixture counts in the first test that needs it) and
one per process at its end (collection and imports included) to the file named by
$MSPRETRAIN_TEST_CPU, and one per wait for the msrun lock (`lock_wait`, wall seconds: conftest.py).
Children are counted once they are reaped, and so are theirs (msrun's workers, a CLI run's pool):
the box's other load does not enter, as it does into wall times.
docs/benchmarks.md, "The suite's time: round seven", sums these per file."""
from __future__ import annotations

import json
import os
import resource

import pytest


def _cpu() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def record(rec: dict) -> None:
    """One JSON line into $MSPRETRAIN_TEST_CPU, when it is set (also conftest's msrun lock waits)."""
    _write(rec)


def _write(rec: dict) -> None:
    path = os.environ.get("MSPRETRAIN_TEST_CPU")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(rec) + "\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    start = _cpu()
    yield
    _write({"test": item.nodeid.split("@")[0], "cpu": round(_cpu() - start, 3),
            "worker": os.environ.get("PYTEST_XDIST_WORKER", "main")})


def pytest_sessionfinish(session):
    _write({"process": os.environ.get("PYTEST_XDIST_WORKER", "main"), "cpu": round(_cpu(), 3)})
