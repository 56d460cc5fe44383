"""The loop's bookkeeping: overflow accounting, auto warm-up from the manifest, spike rewind,
non-finite stop, periodic eval, pynative == jit, checkpoint retention."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from mspretrain import config as cfgmod
from mspretrain.checkpoint import store
from mspretrain.errors import UserError
from mspretrain.train.step import StepResult
from mspretrain.train.trainer import Trainer
from tests.conftest import TINY


def make(data: Path, run: Path, *over: str) -> Trainer:
    return Trainer(cfgmod.load(TINY, list(over)), data, run, log=lambda s: None)


class FakeStep:
    """Stands in for the compiled step: returns scripted results, changes nothing."""

    def __init__(self, finite: list[bool]) -> None:
        self.finite = list(finite)
        self.calls = []

    def run(self, micro, lr, scale):
        self.calls.append((lr, scale))
        return StepResult(loss=2.0, grad_norm=1.0, finite=self.finite.pop(0))


def test_overflow_is_counted_and_does_not_advance_the_schedule(tmp_path, tiny_data):
    t = make(tiny_data, tmp_path / "r", "precision.dtype=fp16", "precision.init_scale=1024", "schedule.warmup_steps=4")
    t._build()
    t.step_fn = FakeStep([True, False, True])
    lrs = []
    for _ in range(3):
        res, lr, scale = t.train_step()
        lrs.append(lr)
    assert t.step == 3 and t.applied == 2 and t.skipped == 1
    assert [c[1] for c in t.step_fn.calls] == [1024, 1024, 512]  # halved after the overflow
    assert lrs[1] == lrs[2] == t.schedule(1)  # the skipped step did not advance the lr schedule
    t.metrics.close()


def test_auto_warmup_uses_the_manifest_tokens(tmp_path, tiny_data):
    manifest = json.loads((tiny_data / "manifest.json").read_text())
    t = make(tiny_data, tmp_path / "r", 'schedule.warmup_steps="auto"', "train.max_steps=100000")
    expected = math.ceil(0.02 * manifest["tokens"]["train"] / (4 * 32))
    assert t.schedule.warmup == expected


@pytest.fixture(scope="module")
def rewind_run(tmp_path_factory, tiny_data):
    run = tmp_path_factory.mktemp("rw") / "run"
    t = make(tiny_data, run, "train.max_steps=6", "checkpoint.every=2", "spike.action=rewind", "checkpoint.async_save=false")
    t._build()
    for _ in range(4):
        t.train_step()
        if t.step % 2 == 0:
            t.save()
    t.train_step()  # step 5
    return t, run


def test_spike_rewind_restores_weights_and_skips_batches(rewind_run):
    t, run = rewind_run
    from mspretrain.model.llama import state_numpy

    samples_before = t.loader.state()["samples"]
    t.spikes.check = lambda step, loss, gn=None: [{"kind": "loss_spike", "message": f"step {step}: loss spike"}]
    values: dict = {}
    t._spikes(StepResult(loss=9.0, grad_norm=1.0, finite=True), values)
    assert values["spike"] == 1.0 and values["rewind"] == 4.0
    assert t.step == 4
    ck = load_file(str(run / "checkpoints" / "step_000004" / "model.safetensors"))
    now = state_numpy(t.model)
    assert all(np.array_equal(ck[k], now[k]) for k in ck)
    assert t.loader.state()["samples"] == samples_before  # the batches of step 5 are skipped, not replayed
    t.metrics.close()


def test_rewind_skip_skips_that_many_steps_of_data(rewind_run):
    """spike.rewind_skip > 0: the data position is the checkpoint's plus rewind_skip steps' worth
    of batches (0, tested above, keeps the position the spike was reached at)."""
    import dataclasses

    t, run = rewind_run
    t.cfg = dataclasses.replace(t.cfg, spike=dataclasses.replace(t.cfg.spike, rewind_skip=3))
    saved = json.loads((run / "checkpoints" / "step_000004" / "data_state.json").read_text())
    lines: list[str] = []
    t._print = lines.append
    t.spikes.check = lambda step, loss, gn=None: [{"kind": "loss_spike", "message": f"step {step}: loss spike"}]
    t._spikes(StepResult(loss=9.0, grad_norm=1.0, finite=True), {})
    assert t.step == 4
    per_step = t.accum_steps * t.micro  # sequences one optimizer step reads on this (only) rank
    assert saved["samples"] > 0 and t.loader.state()["samples"] == saved["samples"] + 3 * per_step
    assert any("rewound to step_000004, skipping 3 steps of data" in line for line in lines), lines
    t.metrics.close()


def test_second_ctrl_c_stops_at_once(tmp_path, tiny_data):
    """The first Ctrl-C asks for a checkpoint after the current step; a second one means now."""
    import signal

    t = make(tiny_data, tmp_path / "r")
    lines: list[str] = []
    t._print, t.step = lines.append, 3  # mid-run (the handlers are installed once training started)
    assert t._stop_signal is None
    t._on_signal(signal.SIGINT, None)
    assert t._stop_signal == signal.SIGINT  # the loop finishes the step and checkpoints
    assert lines == ["received SIGINT: finishing step 4, then writing a checkpoint"]
    with pytest.raises(KeyboardInterrupt):
        t._on_signal(signal.SIGINT, None)
    with pytest.raises(KeyboardInterrupt):  # the runtime may deliver the second one as SIGTERM
        t._on_signal(signal.SIGTERM, None)


def test_persistent_nonfinite_loss_stops_the_run(tmp_path, tiny_data):
    t = make(tiny_data, tmp_path / "r", "spike.max_nonfinite=2")
    t._build()
    with pytest.raises(UserError, match="non-finite for 2 steps"):
        for step in range(1, 3):
            t.step = step
            t._spikes(StepResult(loss=float("nan"), grad_norm=float("nan"), finite=False), {})
    t.metrics.close()


def test_periodic_eval_writes_eval_ppl(tmp_path, tiny_data):
    run = tmp_path / "r"
    make(tiny_data, run, "train.max_steps=4", "eval.every=2", "checkpoint.every=0", "train.mode=pynative").train()
    recs = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in recs if "eval/ppl" in r]
    assert [r["step"] for r in evals] == [2, 4] and all(np.isfinite(r["eval/ppl"]) for r in evals)


def test_pynative_matches_jit(tmp_path, tiny_data):
    from mspretrain.cli import main

    for mode in ("jit", "pynative"):
        assert main(["train", "--config", str(TINY), "--data", str(tiny_data), "--run", str(tmp_path / mode), "--quiet",
                     "train.max_steps=3", "checkpoint.every=0", f"train.mode={mode}"]) == 0
    a = load_file(str(tmp_path / "jit" / "checkpoints" / "step_000003" / "model.safetensors"))
    b = load_file(str(tmp_path / "pynative" / "checkpoints" / "step_000003" / "model.safetensors"))
    for k in a:  # Adam's g/sqrt(v) amplifies last-bit differences of near-zero gradients: 1e-5, not 1e-6
        np.testing.assert_allclose(a[k], b[k], atol=1e-5, err_msg=k)
    la = [json.loads(l)["loss"] for l in (tmp_path / "jit" / "metrics.jsonl").read_text().splitlines()]
    lb = [json.loads(l)["loss"] for l in (tmp_path / "pynative" / "metrics.jsonl").read_text().splitlines()]
    np.testing.assert_allclose(la, lb, rtol=1e-6)


def test_retention_keeps_last_and_every(tmp_path):
    from mspretrain.config import Config

    run = tmp_path / "r"
    for step in range(1, 8):
        store.write_checkpoint_dir(run / "checkpoints" / store.step_dir_name(step), step=step,
                                   model={"w": np.zeros(2, np.float32)}, optimizer=None, train_state={},
                                   data_state=None, config=Config())
    store.prune(run, keep_last=2, keep_every=3, log=lambda s: None)
    assert [s for s, _ in store.list_checkpoints(run)] == [3, 6, 7]


def test_mixing_two_data_dirs_and_refusing_a_foreign_tokenizer(tmp_path, tiny_data, tiny_cfg):
    from dataclasses import replace

    from mspretrain.data.prepare import prepare
    from tests.conftest import make_poems

    text = tmp_path / "more.txt"
    text.write_text("\n\n".join(make_poems(300, seed=5)) + "\n", encoding="utf-8")
    same = tmp_path / "same"
    prepare([str(text)], same, tiny_cfg.prepare, tokenizer=str(tiny_data / "tokenizer.model"), workers=1, log=lambda s: None)
    sources = f'data.sources=[{{path="{tiny_data}", weight=0.7}}, {{path="{same}", weight=0.3}}]'
    run = tmp_path / "mix"
    s = make(tiny_data, run, sources, "train.max_steps=3", "checkpoint.every=0").train()
    assert s.step == 3
    state = json.loads((run / "checkpoints" / "step_000003" / "data_state.json").read_text())
    consumed = [src["consumed"] for src in state["sources"]]
    assert sum(consumed) == 3 * 4 and consumed[0] > consumed[1] > 0

    foreign = tmp_path / "foreign"
    prepare([str(text)], foreign, replace(tiny_cfg.prepare, vocab_size=400), workers=1, log=lambda s: None)
    bad = f'data.sources=[{{path="{tiny_data}", weight=0.5}}, {{path="{foreign}", weight=0.5}}]'
    with pytest.raises(UserError, match="different tokenizer"):
        make(tiny_data, tmp_path / "bad", bad, "train.max_steps=3")
