"""The suite's own rules, checked on its source: a "before" taken from a live buffer is a copy,
the tests that start msrun are the ones `make test-fast` leaves out, no test module imports
another, and tests/lanes.txt names files that exist."""
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
    from tests.helpers import MSRUN

    if MSRUN is None:
        pytest.skip("msrun not installed")
    items = [i for i in request.session.items if i.get_closest_marker("skipif") is not None]
    for item in items:
        if any("msrun" in str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif")):
            assert item.get_closest_marker("msrun") is not None, item.nodeid


# A test module imports what it shares from tests/helpers.py (or tests/conftest.py), never from
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
    assert not bad, "move what they share to tests/helpers.py:\n" + "\n".join(f"{a} imports {b}" for a, b in bad)


def test_the_lanes_name_files_that_exist():
    from tests.conftest import lane_one

    lane1 = lane_one()
    assert {"tests/train/test_distributed.py", "tests/step/test_zero2.py"} <= lane1
    missing = sorted(f for f in lane1 if not (TESTS.parent / f).is_file())
    assert not missing, f"tests/lanes.txt names files that do not exist: {missing}"
