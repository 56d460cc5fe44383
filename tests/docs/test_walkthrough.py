"""The quick start's newcomer path, run for real by scripts/walkthrough.sh in a temp dir (the
session's `walkthrough` fixture, tests/conftest.py, which tests/docs/test_docs.py reads too): own text →
prepare → train → Ctrl-C → resume → eval → generate → export → transformers. The checks are the
promises the docs make about each step's output."""
from __future__ import annotations

import json
import re

import pytest

from mspretrain.config import schema as cfgmod
from mspretrain.model.presets import param_count

pytestmark = pytest.mark.slow


def test_prepare_wrote_a_data_dir(walkthrough):
    work, out = walkthrough
    manifest = json.loads((work / "data" / "manifest.json").read_text())
    assert manifest["documents"]["train"] + manifest["documents"]["valid"] == 1200
    assert "$ mspretrain prepare my-text/ --out data --config configs/tiny.toml" in out


def test_ctrl_c_writes_a_checkpoint_and_the_same_command_resumes(walkthrough):
    work, out = walkthrough
    stopped = re.search(r"stopped by SIG\w+ after step (\d+); checkpoint written", out)
    assert stopped, out
    step = int(stopped.group(1))
    assert 10 <= step < 40
    assert f"resumed from step_{step:06d}: step {step}" in out
    # Every step logged exactly once across the interruption: the resumed run truncated nothing twice.
    steps = [json.loads(line)["step"] for line in (work / "runs/mine/metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 41))
    assert (work / "runs/mine/checkpoints/step_000040/manifest.json").is_file()


def test_eval_and_transformers_agree_on_perplexity(walkthrough):
    work, out = walkthrough
    ours = re.search(r"step_000040: valid perplexity ([\d.]+) .* over ([\d,]+) tokens", out)
    theirs = re.search(r"transformers: valid perplexity ([\d.]+) over ([\d,]+) tokens", out)
    assert ours and theirs, out
    assert ours.group(2) == theirs.group(2)
    assert float(theirs.group(1)) == pytest.approx(float(ours.group(1)), rel=1e-3)
    # the quickstart prints both to 3 decimals and calls them the same: at most one unit of the last digit apart
    assert abs(float(theirs.group(1)) - float(ours.group(1))) <= 1.0e-3 + 1e-9, (ours.group(1), theirs.group(1))
    vocab = json.loads((work / "data" / "manifest.json").read_text())["vocab_size"]
    assert float(ours.group(1)) < vocab / 2  # it learned something (a uniform guess scores ~vocab)


def test_generate_export_and_load(walkthrough):
    work, out = walkthrough
    gen = out.split("$ mspretrain generate", 1)[1].split("\n$ ", 1)[0]
    assert "春风" in gen and "tokens/s" in gen
    assert (work / "hf" / "config.json").is_file() and (work / "hf" / "model.safetensors").is_file()
    cfg = cfgmod.load(work / "runs/mine/config.toml")
    assert f"LlamaForCausalLM {param_count(cfg.model):,} parameters" in out
    assert re.search(r"sample: 春风\S", out)
