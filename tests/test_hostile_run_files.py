"""Issue 33 class 6: a run file that is /dev/zero (or a symlink to it), a FIFO, or damaged, never
drives a reader past its size cap or into a hang: every reader command ends at once with a result
or one `error:` / `hint:` pair, never a traceback. Runs in-process against one tiny run; each
case replaces one file of a copy."""
from __future__ import annotations

import os
import resource
import shutil
from pathlib import Path

import pytest

from mspretrain.cli import main
from tests.conftest import TINY

FILES = ["metrics.jsonl", "train.log", "run_meta.json", "batches.jsonl", "heartbeat/rank_00000.json",
         "checkpoints/step_000003/train_state.json"]


@pytest.fixture(scope="module")
def run3(tmp_path_factory, tiny_data) -> Path:
    run = tmp_path_factory.mktemp("hostile") / "run"
    assert main(["train", "--config", str(TINY), "--data", str(tiny_data), "--run", str(run), "--quiet",
                 "checkpoint.every=1", "checkpoint.keep_last=5", "train.max_steps=3"]) == 0
    return run


def _commands(run: Path, out: Path) -> list[list[str]]:
    return [["report", str(run), "--out", str(out / "report")], ["diagnose", str(run)], ["audit", str(run)],
            ["spike", str(run), "--step", "2", "--no-replay"], ["recover", str(run)]]


def _max_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@pytest.mark.parametrize("name", FILES)
@pytest.mark.parametrize("kind", ["devzero", "fifo"])
def test_special_run_files_end_every_reader_in_one_line(run3, tmp_path, capsys, name, kind):
    run = tmp_path / "run"
    shutil.copytree(run3, run, symlinks=True)
    target = run / name
    target.parent.mkdir(parents=True, exist_ok=True)
    target.unlink(missing_ok=True)
    if kind == "devzero":
        target.symlink_to("/dev/zero")
    else:
        os.mkfifo(target)
    before = _max_rss_mb()
    for argv in _commands(run, tmp_path):
        code = main(argv)
        err = capsys.readouterr().err
        assert code in (0, 1, 2), (argv, code, err)
        assert "Traceback" not in err, (argv, err)
        if code == 2:
            lines = err.strip().splitlines()
            assert len(lines) == 2 and lines[0].startswith("error:") and lines[1].startswith("hint:"), (argv, err)
    assert _max_rss_mb() - before < 1024, "a reader read far past its cap"


def test_replay_refuses_a_special_metrics_file(run3, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(run3, run, symlinks=True)
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").symlink_to("/dev/zero")
    assert main(["replay", str(run), "--from-step", "1", "--steps", "1"]) == 2
    assert "not a regular file" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["audit", "diagnose", "recover", "checkpoints"])
def test_commands_that_read_no_config_refuse_overrides(run3, capsys, command):
    """`mspretrain --help` used to promise overrides to every command; those that read no config
    ignored them silently. Now they are refused in one line (issue 33, docs item)."""
    assert main([command, str(run3), "train.max_steps=5"]) == 2
    err = capsys.readouterr().err
    assert "takes no section.key=value overrides" in err and err.count("\n") == 2


def test_quickstart_creates_my_text_with_the_walkthroughs_own_lines():
    root = Path(__file__).resolve().parents[1]
    quick = (root / "docs" / "quickstart.md").read_text(encoding="utf-8")
    block = quick.split("## 1. Your own text", 1)[1].split("```bash\n", 1)[1].split("\n```", 1)[0]
    assert block.startswith("mkdir -p my-text") and block in (root / "scripts" / "walkthrough.sh").read_text(encoding="utf-8")
