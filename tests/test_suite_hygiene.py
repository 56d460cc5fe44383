"""The suite's own rules, checked on its source: a "before" taken from a live buffer is a copy,
the tests that start msrun are the ones `make test-fast` leaves out, no test module imports
another, and the msrun tests share one xdist group."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
# state_numpy(), optimizer_state() and Tensor.asnumpy() return views of live buffers on CPU
BEFORE = re.compile(r"^\s*(\w*before\w*)(\s*,\s*\w+)*\s*=(?!=)(.*)$")
LIVE = re.compile(r"state_numpy\(|optimizer_state\(\)|\.asnumpy\(\)")


def live_before(line: str) -> bool:
    """An assignment to a name with "before" in it from a live buffer, not copied."""
    m = BEFORE.match(line)
    return bool(m and LIVE.search(m.group(3)) and "snapshot(" not in m.group(3) and "copy" not in m.group(3))


def test_no_before_is_a_view_of_a_live_buffer():
    bad = [f"{p.name}:{n}: {line.strip()}" for p in sorted(TESTS.rglob("*.py")) if p.name != Path(__file__).name
           for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if live_before(line)]
    assert not bad, "take the 'before' with tests.conftest.snapshot():\n" + "\n".join(bad)


def test_the_pattern_finds_what_it_should():
    assert live_before("    before_w, before_o = state_numpy(model), step.optimizer_state()")
    assert live_before("    before = step.optimizer_state()")
    assert live_before("    w_before = model.w.asnumpy()")
    assert not live_before("    before = snapshot(state_numpy(model))")
    assert not live_before("    before = {k: v.copy() for k, v in state_numpy(model).items()}")
    assert not live_before("    before = (run / 'config.toml').read_bytes()")


def test_the_msrun_marker_covers_every_msrun_test(request):
    from tests.helpers.runs import MSRUN

    if MSRUN is None:
        pytest.skip("msrun not installed")
    items = [i for i in request.session.items if i.get_closest_marker("skipif") is not None]
    for item in items:
        if any("msrun" in str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif")):
            assert item.get_closest_marker("msrun") is not None, item.nodeid


# A test module imports what it shares from tests/helpers/ (or tests/conftest.py), never from
# another test module: importing one runs its module-level code and couples two subjects.


def modules_imported_across(tests: Path = TESTS) -> set[tuple[str, str]]:
    """(importing file, imported test module) for every import of a `tests.test_*` module."""
    import ast

    found = set()
    for p in sorted(tests.rglob("*.py")):
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tests"):
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            found |= {(p.name, n) for n in names if n.startswith("tests.") and n.rsplit(".", 1)[-1].startswith("test_")}
    return found


def test_no_test_module_imports_another():
    bad = sorted(modules_imported_across())
    assert not bad, "move what they share to tests/helpers/:\n" + "\n".join(f"{a} imports {b}" for a, b in bad)


def test_every_job_that_launches_ranks_holds_the_msrun_lock(request):
    """`make test`'s two xdist workers never run two msrun jobs at once: every msrun test takes
    conftest's `one_msrun_at_a_time` (its autouse fixture), and the two-rank session runs build
    under it; the msrun files come first in the order (`groups`)."""
    import inspect

    from tests import conftest

    items = request.session.items
    msrun = [i for i in items if i.get_closest_marker("msrun") is not None]
    assert all("_msrun_jobs_one_at_a_time" in i.fixturenames for i in msrun)
    for name in conftest.TWO_RANK_RUNS:
        assert "one_msrun_at_a_time(" in inspect.getsource(getattr(conftest, name).__wrapped__), name
    launching = {i.nodeid.split("::")[0] for i in msrun} | {
        i.nodeid.split("::")[0] for i in items if conftest.TWO_RANK_RUNS & set(i.fixturenames)}
    order = list(dict.fromkeys(i.nodeid.split("::")[0] for i in items))
    assert set(order[:len(launching)]) == launching, "the files that launch ranks run first"


def test_the_msrun_lock_excludes_a_second_holder(tmp_path_factory):
    """The lock is an flock on one file of the run's shared temp dir: a second holder (the other
    xdist worker: here another process) waits until the first lets go."""
    import fcntl

    from tests.conftest import _shared_root, one_msrun_at_a_time

    path = _shared_root(tmp_path_factory) / "msrun.lock"
    with one_msrun_at_a_time(tmp_path_factory):
        with open(path, "w") as other:
            with pytest.raises(BlockingIOError):
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with open(path, "w") as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_groups_put_a_launching_file_and_a_shared_run_together():
    from types import SimpleNamespace

    from tests.conftest import groups

    def item(nodeid, fixtures=(), msrun=False):
        return SimpleNamespace(nodeid=nodeid, fixturenames=list(fixtures),
                               get_closest_marker=lambda name: object() if msrun and name == "msrun" else None)

    got = groups([item("tests/a/test_x.py::t1"), item("tests/a/test_x.py::t2", msrun=True),
                  item("tests/b/test_y.py::t", ["two_ranks_fp32"]), item("tests/b/test_z.py::t", ["walkthrough"]),
                  item("tests/c/test_w.py::t", ["walkthrough", "tiny_data"]), item("tests/c/test_v.py::t", ["tiny_data"])])
    assert got == {"tests/a/test_x.py": "msrun", "tests/b/test_y.py": "msrun", "tests/b/test_z.py": "walkthrough",
                   "tests/c/test_w.py": "walkthrough", "tests/c/test_v.py": "tests/c/test_v.py"}


def test_a_worker_is_not_handed_a_launching_file_while_the_other_has_one_left():
    from collections import OrderedDict

    from tests.helpers.schedule import next_scope

    msrun = frozenset({"a.py", "b.py"})
    queue = OrderedDict((f, {}) for f in ("a.py", "b.py", "c.py", "d.py"))
    assert next_scope(queue, [], msrun) == "a.py"  # nobody else busy: the queue's order
    running = {"x.py": {"t1": True, "t2": False}}
    assert next_scope(queue, [running], msrun | {"x.py"}) == "c.py"  # the other runs a launching file
    done = {"x.py": {"t1": True, "t2": True}}
    assert next_scope(queue, [done], msrun | {"x.py"}) == "a.py"  # ... which it has finished
    only = OrderedDict((f, {}) for f in ("a.py", "b.py"))
    assert next_scope(only, [running], msrun | {"x.py"}) == "a.py"  # nothing else left: wait on the lock


def test_the_workers_list_of_launching_files_reaches_the_controller(tmp_path):
    from tests.helpers.schedule import read_msrun_files, write_msrun_files

    assert read_msrun_files(tmp_path) == frozenset()
    write_msrun_files(tmp_path, ["tests/step/test_tp.py", "tests/step/test_zero2.py"])
    assert read_msrun_files(tmp_path) == {"tests/step/test_tp.py", "tests/step/test_zero2.py"}
    assert [p.name for p in tmp_path.iterdir()] == ["msrun-files.json"]
