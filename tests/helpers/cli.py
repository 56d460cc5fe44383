"""The command line in this process (`cli`, `refused`, `assert_refusal`, `assert_user_error`) and
what a command may not change (`checksum`, `state`: a tree of files before and after)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import pytest


def cli(capsys, *argv: object) -> tuple[int, str, str]:
    """`mspretrain ARGV` in this process: (exit code, stdout, stderr) of this call alone (what was
    captured before is dropped first). argparse's own refusals leave through SystemExit
    (cli._Parser.error); their exit code is returned like any other."""
    from mspretrain.cli import main

    capsys.readouterr()
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def assert_refusal(code: int, err: str, needle: str = "") -> None:
    """The refusal contract: exit code 2, one `error:` line (holding `needle`), one `hint:` line, no traceback."""
    assert code == 2, err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("error: ") and lines[1].startswith("hint: "), err
    assert needle in lines[0], (needle, err)


def refused(capsys, *argv: object) -> str:
    """Run the command line, assert the refusal contract, return stderr."""
    code, _, err = cli(capsys, *argv)
    assert_refusal(code, err)
    return err


def assert_user_error(fn: Callable[[], object], *needles: str):
    """`fn()` raises a `UserError` whose cause (holding every needle) and fix are one line each."""
    from mspretrain.errors import UserError

    with pytest.raises(UserError) as exc:
        fn()
    e = exc.value
    assert e.cause and e.fix and "\n" not in e.cause and "\n" not in e.fix, str(e)
    for needle in needles:
        assert needle in e.cause, e.cause
    return e


def checksum(d: Path) -> dict[str, str]:
    """Every file and directory under `d` (a missing `d` is {}), files with their sha256; the lock
    file left out (a refused command may take the lock before it refuses: that is the lock's job).
    `state` is the stricter form: modes, mtimes and lock files too."""
    import hashlib

    from mspretrain.checkpoint.lock import LOCK_NAME

    if not d.exists():
        return {}
    out = {}
    for p in sorted(d.rglob("*")):
        if p.name == LOCK_NAME:
            continue
        out[str(p.relative_to(d))] = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
    return out


def state(d: Path) -> dict[str, tuple]:
    """Every entry under `d`: mode, size, mtime and (files) sha256; symlinks by their target. Equal
    before and after a command: it touched nothing there, not even a lock file or a timestamp."""
    import hashlib

    out = {}
    for dirpath, dirnames, filenames in os.walk(d):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            if p.is_symlink():
                what = "->" + os.readlink(p)
            elif p.is_file():
                what = hashlib.sha256(p.read_bytes()).hexdigest()
            else:
                what = "dir"
            out[str(p.relative_to(d))] = (st.st_mode, st.st_size if p.is_file() else 0, st.st_mtime_ns, what)
    return out
