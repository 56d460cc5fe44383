"""What the docs promise is what happens: one test per promise.

One tiny run (4 steps) is shared by the tests that need a trained run; the rest read no model."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import tomllib

from mspretrain.config import schema as cfgmod
from mspretrain.errors import UserError
from tests.conftest import ONE_LAYER
from tests.helpers.cli import cli

ROOT = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------- no model needed

def test_did_you_mean_is_deterministic_and_picks_the_closest_key():
    # the hint names one key, the same run to run (not whichever a set's order gives)
    for typo, want in (("max_step", "train.max_steps"), ("max_tokn", "train.max_tokens"), ("global_bach", "train.global_batch")):
        with pytest.raises(UserError) as exc:
            cfgmod.apply_overrides(cfgmod.Config(), [f"train.{typo}=5"])
        assert exc.value.fix == f"did you mean {want}?"


def test_a_config_key_spelled_as_an_option_gets_the_override_spelling(capsys):
    # `--max-steps 5` names train.max_steps
    code, _, err = cli(capsys, "train", "--data", "d", "--run", "r", "--max-steps", "5")
    assert code == 2
    assert err.splitlines() == ["error: unrecognized arguments: --max-steps 5",
                                "hint: config keys are overrides after the options, not --flags: did you mean train.max_steps=5?"]


@pytest.mark.parametrize("argv", [["eval", "RUN", "foo.bar=1"], ["eval", "RUN", "eval.max_tokens=64"],
                                  ["generate", "RUN", "--prompt", "春风", "model.dim=8"], ["report", "RUN", "foo.bar=1"]])
def test_commands_that_read_a_run_refuse_overrides(capsys, tmp_path, argv):
    # refused, not accepted and silently ignored
    argv = [str(tmp_path) if a == "RUN" else a for a in argv]
    code, out, err = cli(capsys, *argv)
    assert code == 2 and out == ""
    lines = err.splitlines()
    assert len(lines) == 2 and lines[0].startswith(f"error: `mspretrain {argv[0]}` takes no config overrides")
    assert lines[1].startswith("hint: ")


def test_eval_refuses_a_negative_token_limit_and_a_data_dir(capsys, tiny_data):
    code, _, err = cli(capsys, "eval", str(tiny_data), "--max-tokens", "-5")
    assert code == 2 and err.startswith("error: argument --max-tokens: -5 is outside [0, ")
    for command in (["eval", str(tiny_data)], ["generate", str(tiny_data), "--prompt", "春风"]):
        code, _, err = cli(capsys, *command)
        assert code == 2 and "is a data dir (the output of `mspretrain prepare`), not a run or checkpoint" in err, err


def test_doctor_takes_the_checkpoint_size_from_the_plan():
    # doctor used 12 bytes per parameter where the plan (fp16 weights + fp32 masters) uses 14
    from mspretrain.model.presets import param_count
    from mspretrain.preflight.doctor import check_run_dir
    from mspretrain.preflight.plan import make_plan

    cfg = cfgmod.load(ROOT / "configs" / "llama2-7b-910b.toml")
    disk = next(f for f in check_run_dir(ROOT, cfg) if f.name == "disk")
    planned = make_plan(cfg, devices=8, tokens=1, data_dir=None, tokens_per_s_per_device=None)["checkpoint_bytes"]
    assert planned == 14 * param_count(cfg.model)  # independent: 2 (fp16 weights) + 4 (masters) + 8 (Adam m, v)
    assert f"a checkpoint is {planned / 2**30:,.3f} GB" in disk.detail


def test_plan_with_a_preset_takes_the_vocabulary_from_the_data_dir(capsys, tiny_data):
    # `plan --model 125m --data DIR` assumed Llama's 32,000
    vocab = json.loads((tiny_data / "manifest.json").read_text())["vocab_size"]
    code, out, _ = cli(capsys, "plan", "--model", "125m", "--data", str(tiny_data), "--json")
    assert code == 0
    plan = json.loads(out)
    assert plan["model"]["vocab_size"] == vocab and plan["model"]["dim"] == 768 and plan["model"]["n_layers"] == 12
    code, out, _ = cli(capsys, "plan", "--model", "125m", "--data", str(tiny_data), "--json", "model.vocab_size=1000")
    assert json.loads(out)["model"]["vocab_size"] == 1000  # an explicit override still wins


def test_train_takes_a_preset():
    # `train --model 125m` trains the preset's architecture with the data's vocabulary
    from mspretrain.commands.train import with_preset
    from mspretrain.model.presets import gpt_125m

    cfg = with_preset(cfgmod.load(ROOT / "configs" / "demo.toml"), "125m", ["model.n_layers=2", "train.max_steps=3"])
    want = gpt_125m()
    assert (cfg.model.dim, cfg.model.n_heads, cfg.model.n_layers, cfg.model.vocab_size) == (want.dim, want.n_heads, 2, 0)
    assert cfg.data.seq_len == 128  # the rest of the config is the file's


def test_schedule_notes_on_resume_say_what_changes_and_how_to_keep_the_lr():
    # the arithmetic: a finished 300-step cosine raised to 600 steps jumps back up
    from mspretrain.schedule import Schedule, resume_notes

    old = Schedule(kind="cosine", lr=1e-3, warmup=10, total=300, min_lr=1e-4)
    new = Schedule(kind="cosine", lr=1e-3, warmup=10, total=600, min_lr=1e-4)
    state = {"kind": "cosine", "warmup": 10, "total": 300, "lr": old(300)}
    notes = resume_notes(state, new, 300)
    assert old(300) == pytest.approx(1e-4) and new(300) > 4e-4
    assert "600 steps in all" in notes[0] and "jumps from 0.0001 to" in notes[1]
    overrides = notes[2].split("add: ")[1].split()
    cont = cfgmod.apply_overrides(cfgmod.Config(), overrides + ["train.max_steps=600"])
    from mspretrain.budget import build_schedule

    tail = build_schedule(cont, None)
    assert [tail(p) for p in (300, 450, 599)] == [old(300)] * 3  # continuous: the floor, held
    assert resume_notes(state, old, 300) == []  # same schedule: nothing to say


# --------------------------------------------------------------------------- one tiny run

@pytest.fixture(scope="module")
def run4(tmp_path_factory, tiny_data):
    """4 steps of the tiny config with eval.every = 0 ("only at the end")."""
    from mspretrain.train.build import build_trainer as Trainer

    run = tmp_path_factory.mktemp("promises") / "run"
    cfg = cfgmod.load(ROOT / "configs" / "tiny.toml", ["train.max_steps=4", "eval.every=0", "checkpoint.every=0", ONE_LAYER])
    summary = Trainer(cfg, tiny_data, run, log=lambda s: None).train()
    assert summary.step == 4
    return run


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_every_run_ends_with_an_eval(run4):
    # eval.every = 0 is "only at the end", and the end had none
    recs = _records(run4)
    assert [r["step"] for r in recs] == [1, 2, 3, 4]  # one record per step: the eval is in step 4's
    assert "eval/ppl" in recs[-1] and all("eval/ppl" not in r for r in recs[:-1])
    assert recs[-1]["eval/ppl"] == pytest.approx(2.718281828459045 ** recs[-1]["eval/nll"])
    assert re.search(r"step 4: valid ppl [\d.]+ over [\d,]+ tokens", (run4 / "train.log").read_text())


@pytest.mark.slow
def test_run_config_shows_the_values_that_ran(run4):
    # micro_batch and threads were 0 in RUN_DIR/config.toml while 4 and N ran
    import os

    text = (run4 / "config.toml").read_text()
    threads = int(re.search(r"device cpu, (\d+) threads", (run4 / "train.log").read_text()).group(1))
    assert "micro_batch = 0  # 0 = automatic; this run: 4 per rank x 1 accumulation on 1 rank(s)" in text
    assert f"threads = 0  # 0 = all cores; this run: {threads}" in text
    assert threads == (os.cpu_count() or 1)
    assert "grad_norm_every = 50  # this run: every 1" in text  # 4 steps / 8, at least 1
    assert tomllib.loads(text)["train"]["micro_batch"] == 0  # still automatic: resumes on another world size
    cfgmod.load(run4 / "config.toml")


@pytest.mark.slow
def test_short_runs_sample_every_metric(run4):
    # grad norm every 50 and memory every 200 drew nothing in a 40-step run
    recs = _records(run4)
    assert all("grad_norm" in r and "mem_mb" in r for r in recs)


@pytest.mark.slow
def test_eval_prints_which_tokens_it_scored(capsys, run4):
    # the whole split vs the run's eval.max_tokens
    from mspretrain.commands.eval import scope_note

    code, out, _ = cli(capsys, "eval", str(run4), "--quiet")
    assert code == 0
    line = out.strip().splitlines()[-1]
    scored = int(re.search(r"over ([\d,]+) tokens", line).group(1).replace(",", ""))
    assert scored < 4096 and line.endswith(f"over {scored:,} tokens: the whole valid split")  # the run's evals (4,096) saw the same
    code, out, _ = cli(capsys, "eval", str(run4), "--max-tokens", "64", "--quiet")
    assert out.strip().splitlines()[-1].endswith("over 64 tokens: the first 64 of the valid split (--max-tokens); "
                                                  "the run's own evals score up to the first 4,096 (eval.max_tokens)")
    # the demo's case: 84,000 valid tokens, the run's evals limited to the first 32,768
    assert scope_note("valid", 0, 32768, 84000) == (": the whole valid split; the run's own evals score up to the first "
                                                    "32,768 (eval.max_tokens)")
    assert scope_note("valid", 32768, 32768, 32768) == ": the first 32,768 of the valid split (--max-tokens)"
    assert scope_note("valid", 64, 0, 64) == (": the first 64 of the valid split (--max-tokens); the run's own evals "
                                              "score the whole split (eval.max_tokens = 0)")


@pytest.mark.slow
def test_resume_with_a_raised_budget_prints_the_schedule_change_and_the_tail_keeps_the_lr(run4, tiny_data, tmp_path):
    # the same run raised to 8 steps, then continued with the printed overrides
    import shutil

    from mspretrain.train.build import build_trainer as Trainer

    run = tmp_path / "run"
    shutil.copytree(run4, run)
    base = ["train.max_steps=8", "eval.every=0", "checkpoint.every=0", ONE_LAYER]
    lines: list[str] = []
    Trainer(cfgmod.load(ROOT / "configs" / "tiny.toml", base), tiny_data, run, log=lines.append).close()  # no training
    assert lines[0].startswith("schedule changes on resume: was cosine with warm-up 2, 4 steps in all; now cosine")
    assert "jumps from 0.0001 to" in lines[1]
    overrides = lines[2].split("add: ")[1].split()
    lines.clear()
    t = Trainer(cfgmod.load(ROOT / "configs" / "tiny.toml", base + overrides), tiny_data, run, log=lines.append)
    assert "the learning rate stays continuous: 0.0001 at update 5" in lines
    t.train()
    lrs = [r["lr"] for r in _records(run)]
    assert lrs[3:] == [lrs[3]] * 5 and lrs[3] == pytest.approx(1e-4)  # step 4 (the floor) .. 8: no jump


def test_demo_prints_an_absolute_config_path(tmp_path, monkeypatch):
    # next step (c) named configs/demo.toml relative to the cwd
    import argparse

    from mspretrain.commands.demo import config_path

    monkeypatch.chdir(tmp_path)  # outside the repo
    path = config_path(argparse.Namespace(config=None))
    assert path.is_absolute() and path.is_file() and path == ROOT / "configs" / "demo.toml"
    assert config_path(argparse.Namespace(config="mine.toml")) == tmp_path / "mine.toml"


def test_generate_says_why_it_stopped():
    # --no-stop --max-new-tokens 300 silently stopped at the context limit
    from mspretrain.commands.generate import _stop_reason
    from mspretrain.eval.generate import Generation

    def gen(n: int, eos: bool) -> Generation:
        return Generation(prompt="春风", text="", ids=list(range(n)), tokens_per_s=0.0, stopped_at_eos=eos)

    assert _stop_reason(gen(125, False), 300, 128) == ", stopped at the model's context of 128 tokens (prompt included)"
    assert _stop_reason(gen(7, True), 300, 128) == ", stopped at end-of-text"
    assert _stop_reason(gen(300, False), 300, 2048) == ""
