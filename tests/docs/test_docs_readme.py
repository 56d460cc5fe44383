"""The README's "A short tour of the CLI" runs as written: its runnable ```bash block is read from
README.md and every command in it is run in order in a fresh workdir (the repo's configs/ and
shipped C-Eval-style files copied in, as from the repo root), each must exit 0, and what a
comment of the block promises is checked (`# resumes at 20`, `--verify` verifies, ...). A renamed
flag, a changed default or a command that stops working fails here.

The block under the same heading whose first line is `CLUSTER_MARKER` (a Ray cluster, an Ascend
node) is not run: its commands must still parse with today's CLI.

`mspretrain ...` lines run in this process (`tests/helpers/cli.py` `cli`: no interpreter start-up, no
second import of MindSpore); other commands (the heredoc that writes the corpus) run in bash with
this venv's `python` first on PATH. Three short trainings of the tiny model: 93 s measured on 2 cores at load ~5.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

from tests.conftest import ROOT
from tests.helpers.cli import checksum, cli

pytestmark = pytest.mark.slow

README = ROOT / "README.md"
HEADING = "## A short tour of the CLI"
CLUSTER_MARKER = "# on a cluster or an Ascend node"  # first line of a tour block that is only parsed, never run


def tour_blocks(text: str) -> tuple[list[str], list[str]]:
    """The ```bash blocks of the tour section: (the runnable block's lines, the cluster blocks' lines)."""
    section = text[text.index(HEADING):]
    section = section[:section.find("\n## ", 1) if "\n## " in section[1:] else len(section)]
    runnable, cluster, body = [], [], None
    for line in section.splitlines():
        if line.startswith("```"):
            if body is None:
                body = [] if line.strip() == "```bash" else None
                if body is None:
                    raise AssertionError(f"README tour: a code block that is not ```bash: {line!r}")
            else:
                (cluster if body and body[0].strip() == CLUSTER_MARKER else runnable).append(body)
                body = None
        elif body is not None:
            body.append(line)
    assert len(runnable) == 1, f"README tour: expected one runnable ```bash block, found {len(runnable)}"
    return runnable[0], [line for block in cluster for line in block[1:]]


def commands(lines: list[str]) -> list[tuple[str, str]]:
    """(command, comment) per command of a block: a `<<'EOF'` heredoc with its body is one command;
    a trailing `  # ...` is the comment (the claim the test checks)."""
    out, i = [], 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if "<<'EOF'" in line:
            body = [line]
            while lines[i] != "EOF":
                body.append(lines[i])
                i += 1
            body.append(lines[i])
            i += 1
            out.append(("\n".join(body), line.split("  #", 1)[1].strip() if "  #" in line else ""))
            continue
        cmd, _, comment = line.partition("  #")
        out.append((cmd.strip(), comment.strip()))
    return out


def test_tour_blocks_reads_runnable_and_cluster_blocks():
    text = (f"x\n{HEADING}\n\n```bash\npython - <<'EOF'   # c\nprint(1)\nEOF\nmspretrain eval r  # ok\n```\n"
            f"```bash\n{CLUSTER_MARKER}\nmspretrain doctor\n```\n## Next\n```bash\nmspretrain x\n```\n")
    runnable, cluster = tour_blocks(text)
    assert commands(runnable) == [("python - <<'EOF'   # c\nprint(1)\nEOF", "c"), ("mspretrain eval r", "ok")]
    assert commands(cluster) == [("mspretrain doctor", "")]


# What a command's comment in the README promises, checked on (stdout, stderr, workdir). Keyed by
# the command's first words; every key must match a command of the block (a check that matches
# nothing would silently stop checking).
def _resumed(out: str, err: str, work: Path) -> None:
    assert "resumed from step_000020" in out + err, out + err
    assert json.loads((work / "runs/a/checkpoints/step_000040/train_state.json").read_text())["step"] == 40


def _eval_json(out: str, err: str, work: Path) -> None:
    assert set(json.loads(out)) >= {"ppl", "nll", "tokens", "bpc"}, out


def _verified(out: str, err: str, work: Path) -> None:
    rows = [line for line in out.splitlines()[1:] if line.startswith("step_")]
    assert rows and all(line.split()[-1] == "verified" for line in rows), out


def _averaged(out: str, err: str, work: Path) -> None:
    (avg,) = (work / "runs/a/averaged").iterdir()
    assert (avg / "manifest.json").is_file() and "step_000030, step_000040" in out, out


def _spike(out: str, err: str, work: Path) -> None:
    assert "at the weights of step 34" in out and "documents ranked" in out, out
    # the document the replay line below drops is in this step's batch, so dropping it changes step 35
    samples = [line.split() for line in out.splitlines() if line.split()[3:4] == ["data"]]
    assert samples and any("51" in s[7].split(",") for s in samples), out


def _replay(out: str, err: str, work: Path) -> None:
    rows = {int(line.split()[0]): line.split() for line in out.splitlines() if line.split()[:1] and line.split()[0].isdigit()}
    assert sorted(rows) == [31, 32, 33, 34, 35], out
    assert all(float(rows[s][3]) == 0 for s in (31, 32, 33, 34)) and float(rows[35][3]) != 0, out


CHECKS: dict[str, Callable[[str, str, Path], None]] = {
    "python -": lambda out, err, work: (work / "corpus/verses.txt").is_file() or pytest.fail("no corpus/verses.txt"),
    "mspretrain prepare corpus/ --out data/": lambda out, err, work: (work / "data/manifest.json").is_file()
    or pytest.fail(err),
    "mspretrain prepare --inspect": lambda out, err, work: "documents    1,200 in" in out or pytest.fail(out),
    "mspretrain train --config configs/tiny.toml --data data/ --run runs/a train.max_steps=40": _resumed,
    "mspretrain eval runs/a --json": _eval_json,
    "mspretrain checkpoints runs/a --verify": _verified,
    "mspretrain average": _averaged,
    "mspretrain export": lambda out, err, work: (work / "hf/config.json").is_file() or pytest.fail(out + err),
    "mspretrain report": lambda out, err, work: (work / "runs/a/report/report.html").is_file() or pytest.fail(out),
    "mspretrain audit": lambda out, err, work: "exact:" in out or pytest.fail(out),
    "mspretrain spike": _spike,
    "mspretrain replay": _replay,
    "mspretrain plan --config": lambda out, err, work: "recommended:" in out or pytest.fail(out),
    "mspretrain tokenizer extend": lambda out, err, work: "100 new pieces appended" in out or pytest.fail(out),
    "mspretrain train --init-from hf/": lambda out, err, work: "vocab 512 -> 612" in out + err or pytest.fail(out + err),
    "mspretrain eval runs/c --choices": lambda out, err, work: "accuracy" in out or pytest.fail(out),
}


def _workdir(tmp: Path) -> Path:
    """What the tour reads from the repo root: configs/ and the shipped multiple-choice files."""
    shutil.copytree(ROOT / "configs", tmp / "configs")
    shutil.copytree(ROOT / "mspretrain" / "eval" / "data", tmp / "mspretrain" / "eval" / "data")
    return tmp


def test_the_cluster_block_parses():
    from mspretrain.cli import COMMANDS, build_parser

    _, cluster = tour_blocks(README.read_text(encoding="utf-8"))
    cmds = commands(cluster)
    assert cmds, "README tour: the cluster block is gone; drop this test with it"
    for cmd, _ in cmds:
        argv = shlex.split(cmd)
        assert argv[0] == "mspretrain" and argv[1] in COMMANDS, cmd
        try:
            _, extra = build_parser(argv[1]).parse_known_args(argv[1:])
        except SystemExit as exc:
            raise AssertionError(f"README: `{cmd}` does not parse (exit {exc.code})") from None
        assert all("=" in e and not e.startswith("-") for e in extra), (cmd, extra)


def test_the_tour_runs_as_written(tmp_path, capsys, monkeypatch):
    runnable, _ = tour_blocks(README.read_text(encoding="utf-8"))
    cmds = commands(runnable)
    assert len(cmds) <= 25, "the README tour is meant to be short (and this test cheap)"
    for key in CHECKS:
        assert sum(cmd.startswith(key) for cmd, _ in cmds) == 1, f"no single README tour command starts with {key!r}"
    work = _workdir(tmp_path)
    monkeypatch.chdir(work)
    monkeypatch.setenv("GLOG_v", "3")
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    for cmd, _comment in cmds:
        before = checksum(work / "runs" / "a") if cmd.startswith("mspretrain replay") else None
        if cmd.startswith("mspretrain "):
            code, out, err = cli(capsys, *shlex.split(cmd)[1:])
        else:
            proc = subprocess.run(["bash", "-c", cmd], cwd=work, env=env, capture_output=True, text=True, timeout=300)
            code, out, err = proc.returncode, proc.stdout, proc.stderr
        assert code == 0, f"README tour: `{cmd}` exited {code}:\n{out[-2000:]}\n{err[-2000:]}"
        assert "Traceback" not in err, err
        for key, check in CHECKS.items():
            if cmd.startswith(key):
                check(out, err, work)
        if before is not None:  # "never writing into runs/a"
            assert checksum(work / "runs" / "a") == before, "replay wrote into runs/a"
