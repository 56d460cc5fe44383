"""End to end on the tiny config: prepare → train → eval → generate, resume, signals.

The reference for resume is an uninterrupted run in the same process: weights must be
bit-identical and the loss series after the resume point identical.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from mspretrain.checkpoint import store
from mspretrain.cli import main
from tests.conftest import NO_EVAL, ONE_LAYER, TINY
from tests.helpers.cli import checksum, refused


def metrics(run: Path) -> list[dict]:
    return [json.loads(l) for l in (run / "metrics.jsonl").read_text(encoding="utf-8").splitlines() if l.strip()]


def losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in metrics(run) if "loss" in r}


@pytest.fixture(scope="module")
def short_run(tmp_path_factory, tiny_data) -> Path:
    """4 steps, then the same command with a higher budget: it must continue from step 4."""
    run = tmp_path_factory.mktemp("runs") / "short"
    args = ["train", "--config", str(TINY), "--data", str(tiny_data), "--run", str(run), "--quiet",
            "checkpoint.every=2", NO_EVAL, ONE_LAYER, "train.max_steps=4"]  # the eval command is test_eval_and_generate's
    assert main(args) == 0
    assert [s for s, _ in store.list_checkpoints(run)] == [2, 4]
    assert main(args[:-1] + ["train.max_steps=6"]) == 0
    return run


def test_resume_continues_instead_of_restarting(short_run):
    steps = [r["step"] for r in metrics(short_run) if "loss" in r]
    assert steps == [1, 2, 3, 4, 5, 6]  # no step was repeated or restarted
    log = (short_run / "train.log").read_text(encoding="utf-8")
    assert "resumed from step_000004: step 4" in log
    ts = json.loads((short_run / "checkpoints" / "step_000006" / "train_state.json").read_text())
    assert ts["step"] == 6 and ts["tokens_seen"] == 6 * 4 * 32
    # keep_last = 2
    assert [s for s, _ in store.list_checkpoints(short_run)] == [4, 6]
    for name in ("config.toml", "run_meta.json", "tokenizer.model", "train.log"):
        assert (short_run / name).is_file(), name


def test_eval_and_generate(short_run, tiny_data, capsys):
    assert main(["eval", str(short_run), "--json", "--batch-size", "3"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(res) >= {"ppl", "nll", "tokens"} and np.isfinite(res["ppl"]) and res["tokens"] > 0
    outs = []
    for _ in range(2):
        assert main(["generate", str(short_run), "--prompt", "春风", "--max-new-tokens", "8", "--seed", "3", "--json"]) == 0
        outs.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    assert outs[0] == {**outs[1], "tokens_per_s": outs[0]["tokens_per_s"]}  # same seed -> same sample
    assert outs[0]["tokens"] > 0


def test_bad_inputs_give_one_line_errors(tmp_path, tiny_data, short_run, capsys):
    cases = [
        ["train", "--config", str(TINY), "--data", str(tmp_path / "missing"), "--run", str(tmp_path / "r")],
        ["train", "--config", str(TINY), "--data", str(tiny_data), "--run", str(tmp_path / "r"), "model.bogus=1"],
        ["train", "--config", str(TINY), "--data", str(tiny_data), "--run", str(tmp_path / "r"), "optim.lr=-1"],
        ["train", "--config", str(TINY), "--data", str(tiny_data), "--run", str(tmp_path / "r"), "data.seq_len=0"],
        ["train", "--config", str(TINY), "--data", str(tiny_data), "--run", str(tmp_path / "r"), "precision.dtype=bf16"],
        ["train", "--config", str(TINY), "--data", str(tiny_data), "--run", str(tmp_path / "r"), "train.global_batch=6", "train.micro_batch=4"],
        ["train", "--config", str(TINY), "--data", str(tiny_data), "--run", str(short_run), "model.dim=128"],
        ["train", "--config", str(tmp_path / "nope.toml"), "--data", str(tiny_data), "--run", str(tmp_path / "r")],
        ["eval", str(tmp_path)],
        ["generate", str(short_run), "--prompt", "  "],
    ]
    for args in cases:
        assert main(args) == 2, args
        err = capsys.readouterr().err.strip().splitlines()
        assert err[0].startswith("error: ") and len(err) <= 2, (args, err)
        # the contract (docs/DESIGN.md): exactly one `error:` line and one `hint:` line
        assert len(err) == 2 and err[1].startswith("hint: "), (args, err)
        assert "Traceback" not in "\n".join(err)
    assert not (tmp_path / "r" / "checkpoints").exists()
    # resume refuses every numerics-changing key, not only model.dim, and names it
    metrics_before = (short_run / "metrics.jsonl").read_text()
    for over, key in (("data.seq_len=16", "data.seq_len: 32 -> 16"), ("train.global_batch=8", "train.global_batch: 4 -> 8"),
                      ("train.seed=7", "train.seed: 1234 -> 7")):
        assert main(["train", "--config", str(TINY), "--data", str(tiny_data), "--run", str(short_run), over]) == 2, over
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 2 and err[0].startswith("error: the config changes numerics") and key in err[0], (over, err)
        assert err[1].startswith("hint: ") and "--allow-config-change" in err[1], err
    assert (short_run / "metrics.jsonl").read_text() == metrics_before  # nothing of the run was touched


def _trainer(cfg_overrides, data, run):
    from mspretrain.config import schema as cfgmod
    from mspretrain.train.build import build_trainer as Trainer

    cfg = cfgmod.load(TINY, cfg_overrides)
    return Trainer(cfg, data, run, log=lambda s: None)


@pytest.mark.slow  # three training runs of its own (16 s of make test-fast)
def test_interrupted_run_resumes_bit_identical(tmp_path, tiny_data):
    over = ["train.max_steps=6", "checkpoint.every=0", "metrics.grad_norm_every=1", ONE_LAYER, NO_EVAL]
    full = tmp_path / "full"
    _trainer(over, tiny_data, full).train()

    part = tmp_path / "part"
    t = _trainer(over, tiny_data, part)
    real_step = t.train_step

    def step_then_signal():  # SIGTERM arrives during step 3: finish it, checkpoint, stop
        out = real_step()
        if t.step == 3:
            t._on_signal(signal.SIGTERM, None)
        return out

    t.train_step = step_then_signal
    s = t.train()
    assert s.stopped_by_signal and s.step == 3
    assert [st for st, _ in store.list_checkpoints(part)] == [3]
    _trainer(over, tiny_data, part).train()

    a = load_file(str(full / "checkpoints" / "step_000006" / "model.safetensors"))
    b = load_file(str(part / "checkpoints" / "step_000006" / "model.safetensors"))
    for k in a:
        assert np.array_equal(a[k], b[k]), k
    la, lb = losses(full), losses(part)
    assert la == lb and sorted(lb) == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])  # a scheduler's stop; Ctrl-C
def test_signal_writes_checkpoint_and_exits_zero(tmp_path, tiny_data, sig):
    run = tmp_path / "sig"
    cmd = [sys.executable, "-m", "mspretrain.cli", "train", "--config", str(TINY), "--data", str(tiny_data),
           "--run", str(run), "train.max_steps=100000", "checkpoint.every=0", "train.log_every=1", ONE_LAYER]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "GLOG_v": "3"})

    def logged() -> int:  # whole lines only: json.loads of a line being appended could fail here
        try:
            return (run / "metrics.jsonl").read_bytes().count(b"\n")
        except OSError:
            return 0

    try:
        deadline = time.time() + 180
        while logged() < 2:  # in the training loop, its signal handlers installed
            assert proc.poll() is None, proc.communicate()[0][-2000:]
            assert time.time() < deadline, "no 2 steps logged in 180 s"
            time.sleep(0.2)
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:  # a 100000-step run left behind would slow every later test
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out
    # MindSpore's runtime turns a SIGINT during a step into SIGTERM: either name, same outcome
    assert re.search(r"stopped by SIG(TERM|INT) after step", out), out[-500:]
    assert "Resume with: mspretrain train" in out
    ckpts = store.list_checkpoints(run)
    assert len(ckpts) == 1 and store.verify(ckpts[0][1]) is None
    assert ckpts[0][0] == max(r["step"] for r in metrics(run))


@pytest.fixture(scope="module")
def demo_workdir(tmp_path_factory, corpus_file) -> dict:
    """`make demo`, then the documented `demo --quick --workdir mspretrain-demo`, as a user runs
    them: the full demo (10 steps, quiet) and the quick one (12 steps) in one workdir, the quick
    one's printout, and the full run's files before and after it. Two tests read it (one demo
    pair instead of a quick demo each); neither writes where the other reads: the orchestration
    test reruns the quick demo (data-quick/, run-quick/), the refusal test continues the full run."""
    import contextlib
    import io

    work = tmp_path_factory.mktemp("demo") / "mspretrain-demo"
    common = ["--workdir", str(work), "--corpus", str(corpus_file), "--config", str(TINY), "prepare.vocab_size=512",
              "checkpoint.every=0", "schedule.warmup_steps=2"]
    assert main(["demo", *common, "--quiet", "train.max_steps=10"]) == 0
    full = checksum(work / "run")
    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert main(["demo", "--quick", *common, "train.max_steps=12"]) == 0
    return {"work": work, "common": common, "quick_out": out.getvalue(), "full_before": full,
            "full_after": checksum(work / "run")}


@pytest.mark.slow  # the full and the quick demo: prepare, evaluations and training twice
def test_demo_runs_end_to_end_on_a_local_corpus(demo_workdir, capsys):
    """The demo's orchestration (prepare → ppl before → train → ppl after → poems → next steps) without npm."""
    out = demo_workdir["quick_out"]
    before, after = [float(x) for x in re.search(r"valid ppl ([\d.]+) before -> ([\d.]+) after", out).groups()]
    assert after < before
    assert out.count("sample    ") == 3 and "mspretrain export" in out and "mspretrain report" in out
    capsys.readouterr()
    assert main(["demo", "--quick", *demo_workdir["common"], "train.max_steps=12"]) == 0  # reuses the data and the finished run
    assert "reusing" in capsys.readouterr().out


@pytest.mark.slow
def test_the_quick_demo_never_touches_the_full_demo_run(demo_workdir, capsys):
    """The quick demo has its own data-quick/ and run-quick/: the full run is as it was; a full-demo
    run continued with `train` (the printed next step (b)) is then refused by the demo, untouched."""
    work, common = demo_workdir["work"], demo_workdir["common"]
    assert demo_workdir["full_after"] == demo_workdir["full_before"] and (work / "run-quick" / "config.toml").is_file()
    assert "max_steps = 12" in (work / "run-quick" / "config.toml").read_text(encoding="utf-8")
    assert main(["train", "--config", str(work / "run" / "config.toml"), "--data", str(work / "data"), "--run", str(work / "run"),
                 "--quiet", "train.max_steps=12"]) == 0
    continued = checksum(work / "run")
    err = refused(capsys, "demo", *common, "--quiet", "train.max_steps=10")
    assert "another config" in err and checksum(work / "run") == continued
