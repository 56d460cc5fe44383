"""Issue 33 class 5 and 6 on the command line: numbers that cannot train, or that would allocate
without bound, are refused in one line before anything runs (no model is built here)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.toml")


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    from mspretrain.cli import main

    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("argv, words", [
    (["plan", "--config", TINY, "optim.lr=1e308"], "optim.lr = 1e+308 is above the limit"),
    (["plan", "--config", TINY, "optim.lr=nan"], "optim.lr"),
    (["plan", "--config", TINY, "model.n_layers=1e8"], "model.n_layers"),
    (["plan", "--config", TINY, "--tokens", "nan"], "--tokens nan"),
    (["plan", "--config", TINY, "--tokens", "-1"], "--tokens -1"),
    (["plan", "--config", TINY, "--tokens-per-s", "-5", "--tokens", "1e6"], "--tokens-per-s -5"),
    (["plan", "--config", TINY, "--device-mem-gb", "inf"], "--device-mem-gb inf"),
    (["eval", "no-such-run", "--batch-size", "100000000"], "--batch-size 100000000 must be between 1 and"),
    (["eval", "no-such-run", "--choices", "x.csv", "--batch-size", "100000000"], "--batch-size 100000000 must be between 1 and"),
])
def test_numbers_that_cannot_run_are_one_line(capsys, argv, words):
    code, _, err = _cli(capsys, *argv)
    assert code == 2 and words in err, err
    assert err.startswith("error: ") and err.count("\n") == 2 and "Traceback" not in err


def test_device_mem_gb_wins_for_an_ascend_config(capsys):
    """--device-mem-gb was ignored for Ascend configs (the 910B's 58 GB was used): a 910B4 has 32."""
    cfg = str(ROOT / "configs" / "llama2-7b-910b.toml")
    code, out, _ = _cli(capsys, "plan", "--config", cfg, "--devices", "8", "--device-mem-gb", "32", "--json")
    assert code == 0 and json.loads(out)["device_mem_gb"] == 32.0
    code, out, _ = _cli(capsys, "plan", "--config", cfg, "--devices", "8", "--json")
    assert code == 0 and json.loads(out)["device_mem_gb"] != 32.0
