"""The loop's bookkeeping, first with stand-in parts (no MindSpore: overflow accounting, callbacks
and the order of their hooks, signals, the non-finite stop), then through `build_trainer` with the real ones (spike rewind,
periodic eval, pynative == jit, mixing data dirs); checkpoint retention."""
from __future__ import annotations

import json
import os
import signal
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from mspretrain.checkpoint import store
from mspretrain.config import schema as cfgmod
from mspretrain.data.loader import Batch
from mspretrain.errors import UserError
from mspretrain.monitor.callback import Callback
from mspretrain.monitor.console import ConsoleLine
from mspretrain.monitor.heartbeat import Heartbeat
from mspretrain.monitor.meter import StepMeter
from mspretrain.monitor.metrics import MetricsLogger
from mspretrain.parallel.distributed import World
from mspretrain.schedule import Schedule
from mspretrain.step.loss_scale import LossScaler
from mspretrain.step.step import StepResult
from mspretrain.train.build import build_trainer, sampling_for_run
from mspretrain.train.spike_policy import SpikePolicy
from mspretrain.train.trainer import Trainer
from tests.conftest import NO_EVAL, ONE_LAYER, TINY, snapshot


def make(data: Path, run: Path, *over: str) -> Trainer:
    """A trainer of the tiny config with one layer (conftest `ONE_LAYER`: what these tests check is
    the loop's, not the model's) and `over`."""
    return build_trainer(cfgmod.load(TINY, [ONE_LAYER, *over]), data, run, log=lambda s: None)


# --------------------------------------------------------------------------- stand-in parts

class FakeStep:
    """Stands in for the compiled step: returns scripted results, changes nothing."""

    def __init__(self, finite: list[bool], loss: float = 2.0) -> None:
        self.finite, self.loss = list(finite), loss
        self.calls: list[tuple[float, float, int]] = []

    def run(self, micro, lr, scale):
        self.calls.append((lr, scale, len(micro)))
        return StepResult(loss=self.loss, grad_norm=1.0, finite=self.finite.pop(0))


class FakeLoader:
    batch_size = 2

    def __init__(self) -> None:
        self.samples = 0

    def next_batch(self) -> Batch:
        self.samples += self.batch_size
        return Batch(np.zeros((self.batch_size, 9), np.int32))

    def state(self) -> dict:
        return {"samples": self.samples}


class FakeCheckpoints:
    stall_s: list[float] = []

    def __init__(self, every: int) -> None:
        self.every, self.saved, self.closed, self.updates = every, [], False, 0

    def due(self, step: int, total: int) -> bool:
        return step % self.every == 0 and step < total

    def save(self, step: int, train_state: dict) -> Path:
        self.saved.append((step, train_state))
        return Path(f"step_{step:06d}")

    def close(self) -> None:
        self.closed = True

    def after_update(self) -> None:  # the EMA hook (train.ema_decay): counted, none kept here
        self.updates += 1

    def latest_name(self) -> str:
        return "scratch"


class FakeEval(Callback):
    """Stands in for the periodic eval: its values at the last step."""

    def post_step(self, step: int, data_state: dict, values: dict) -> None:
        if step == 3:
            values.update({"eval/ppl": 5.0, "eval/nll": 1.6})


class Calls(Callback):
    """A per-step callback from a function `(step, data_state, values)`."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def post_step(self, step: int, data_state: dict, values: dict) -> None:
        self.fn(step, data_state, values)


class Hooks(Callback):
    """Records every hook the loop calls, in order, as (hook, step, ...)."""

    def __init__(self, say: list) -> None:
        self.seen: list[tuple] = []
        self.say = say  # the run's log: where the hooks fall among the loop's own lines

    def pre_train(self, start):
        self.seen.append(("pre_train", start))

    def pre_load_batch(self, step):
        self.seen.append(("pre_load_batch", step))

    def pre_step(self, step):
        self.seen.append(("pre_step", step))

    def post_train_batch(self, step, values):
        self.seen.append(("post_train_batch", step, sorted(values)))

    def post_step(self, step, data_state, values):
        self.seen.append(("post_step", step, len(self.say)))

    def log_metrics(self, step, values):
        self.seen.append(("log_metrics", step, "eval/ppl" in values))

    def pre_checkpoint(self, step):
        self.seen.append(("pre_checkpoint", step))

    def post_checkpoint_saved(self, step, path):
        self.seen.append(("post_checkpoint_saved", step, path))

    def post_train(self, step):
        self.seen.append(("post_train", step))

    def on_error(self, step, exc):
        self.seen.append(("on_error", step, type(exc).__name__))

    def close(self):
        self.seen.append(("close",))


def fake_trainer(run: Path, step_fn: FakeStep, *over: str, total: int = 3, callbacks=()) -> tuple[Trainer, list[str]]:
    cfg = cfgmod.load(TINY, ["metrics.tensorboard=false", "train.log_every=1", *over])
    lines: list[str] = []
    scaler = LossScaler.from_config(cfg.precision)
    meter = StepMeter(tokens_per_step=4 * 8, seq_len=8, devices=1, flops_per_token=1e6, peak_tflops=1.0,
                      price_per_device_hour=0.0, throughput_every=1, log_every=1, memory_every=100, target="cpu")
    observers = (meter, ConsoleLine(lines.append, total=total, log_every=1, show_scale=scaler.mode != "none"),
                 FakeEval(), *callbacks, MetricsLogger(run, sampling_for_run(cfg.metrics, total), log=lines.append))
    t = Trainer(cfg=cfg, run_dir=run, data_dir=run, world=World(), model=None, step_fn=step_fn, loader=FakeLoader(),
                scaler=scaler, schedule=Schedule("cosine", lr=1e-3, warmup=2, total=total, min_lr=1e-4),
                checkpoints=FakeCheckpoints(2), spikes=SpikePolicy(cfg.spike, warmup_steps=2, log=lines.append),
                total_steps=total, accum_steps=2, tokens_per_step=4 * 8, log=lines.append, banner=("hello",),
                callbacks=observers)
    return t, lines


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_overflow_is_counted_and_does_not_advance_the_schedule(tmp_path):
    step = FakeStep([True, False, True])
    t, lines = fake_trainer(tmp_path, step, "precision.dtype=fp16", "precision.init_scale=1024")
    s = t.train()
    assert (s.step, t.applied, s.skipped) == (3, 2, 1)
    assert t.checkpoints.updates == 2  # the EMA takes applied steps only (an overflowed one changed no weight)
    assert [c[1] for c in step.calls] == [1024, 1024, 512]  # halved after the overflow
    assert step.calls[1][0] == step.calls[2][0] == t.schedule(1)  # the skipped step did not advance the lr schedule
    assert all(c[2] == 2 for c in step.calls)  # accum_steps micro-batches per step
    assert "step 2: gradient overflow at loss scale 1024 — update skipped, scale now 512" in lines
    assert lines[0] == "hello" and lines[1].startswith("step 1/3 | loss 2.0000 | lr ")
    recs = records(tmp_path)
    assert [r["step"] for r in recs] == [1, 2, 3] and [r["skipped"] for r in recs] == [0, 1, 1]
    assert "eval/ppl" in recs[-1] and "tokens_per_s" in recs[1] and "mfu" in recs[1] and "host_share" in recs[1]
    saved = t.checkpoints.saved
    assert [st for st, _ in saved] == [2, 3] and saved[-1][1]["applied_steps"] == 2  # periodic, then the final one


def test_callbacks_see_each_step_its_data_position_and_values(tmp_path):
    seen: list[tuple[int, dict, dict]] = []
    t, _ = fake_trainer(tmp_path, FakeStep([True] * 3), callbacks=[Calls(lambda st, data, v: seen.append((st, data, dict(v))))])
    t.train()
    # the loader's state before the step: 2 micro-batches of 2 sequences per step
    assert [(st, d["samples"]) for st, d, _ in seen] == [(1, 0), (2, 4), (3, 8)]
    assert all(v["loss"] == 2.0 and "lr" in v for _, _, v in seen) and "eval/ppl" in seen[-1][2]


def test_each_hook_is_called_once_per_step_in_the_loops_order(tmp_path):
    """The hooks in order: the batch's around the data and the step, the throughput sample before
    the observers, the metrics record after them, the checkpoints' around each save (every 2 steps
    and the final one), and at the end `post_train` then `close`; on an error `on_error` then `close`."""
    hooks = Hooks([])
    t, lines = fake_trainer(tmp_path / "a", FakeStep([True] * 3), callbacks=[hooks])
    hooks.say = lines
    t.train()
    seen = hooks.seen
    assert seen[0] == ("pre_train", 0) and seen[-2:] == [("post_train", 3), ("close",)]
    per_step = [[h for h in seen if len(h) > 1 and h[1] == s and h[0] not in ("pre_train", "post_train")] for s in (1, 2, 3)]
    assert [h[0] for h in per_step[0]] == ["pre_load_batch", "pre_step", "post_train_batch", "post_step", "log_metrics"]
    assert [h[0] for h in per_step[1]] == ["pre_load_batch", "pre_step", "post_train_batch", "post_step", "log_metrics",
                                           "pre_checkpoint", "post_checkpoint_saved"]
    assert per_step[1][-1] == ("post_checkpoint_saved", 2, Path("step_000002"))
    assert per_step[2][-2:] == [("pre_checkpoint", 3), ("post_checkpoint_saved", 3, Path("step_000003"))]  # the final save
    # the meter's sample is in the values when post_train_batch has run for it (it is given before `hooks`)
    assert "tokens_per_s" in per_step[1][2][2]
    # the console line of a step is logged (by the callback before `hooks`) when `hooks` sees post_step
    assert lines[per_step[0][3][2] - 1].startswith("step 1/3 | loss 2.0000")
    assert per_step[2][4] == ("log_metrics", 3, True)  # the record holds what the eval added in post_step
    hooks = Hooks([])
    t, _ = fake_trainer(tmp_path / "b", FakeStep([False] * 3, loss=float("nan")), "spike.max_nonfinite=2", callbacks=[hooks])
    with pytest.raises(UserError):
        t.train()
    assert hooks.seen[-2:] == [("on_error", 2, "UserError"), ("close",)]


def test_a_signal_finishes_the_step_and_a_second_stops_at_once(tmp_path):
    def ctrl_c(times):
        def cb(step, data, values):
            if step == 2:
                for _ in range(times):
                    os.kill(os.getpid(), signal.SIGINT)
        return cb

    t, lines = fake_trainer(tmp_path / "a", FakeStep([True] * 3), callbacks=[Calls(ctrl_c(1))])
    s = t.train()
    assert s.stopped_by_signal and s.step == 2 and [st for st, _ in t.checkpoints.saved] == [2, 2]
    assert "received SIGINT: finishing step 3, then writing a checkpoint" in lines
    assert lines[-1].startswith("stopped by SIGINT after step 2; checkpoint written. Resume with: mspretrain train")
    t, _ = fake_trainer(tmp_path / "b", FakeStep([True] * 3), callbacks=[Calls(ctrl_c(2))])
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        t.train()
    assert signal.getsignal(signal.SIGINT) is before  # the handlers are given back


def test_persistent_nonfinite_loss_stops_the_run(tmp_path):
    t, _ = fake_trainer(tmp_path, FakeStep([False] * 3, loss=float("nan")), "spike.max_nonfinite=2")
    with pytest.raises(UserError, match="non-finite for 2 steps in a row \\(step 2\\)"):
        t.train()
    assert t.checkpoints.closed


# --------------------------------------------------------------------------- the real parts

@pytest.fixture(scope="module")
def rewind_run(tmp_path_factory, tiny_data):
    """6 steps with a checkpoint every 2 and a loss spike forced at step 5: rewind to step 4."""
    from mspretrain.model.decoder import state_numpy

    run = tmp_path_factory.mktemp("rw") / "run"
    t = make(tiny_data, run, "train.max_steps=6", "checkpoint.every=2", "spike.action=rewind",
             "checkpoint.async_save=false", "metrics.tensorboard=false", NO_EVAL)
    at_rewind: dict = {}
    t.callbacks.append(Calls(lambda st, data, v: at_rewind.update(step=st, data=data, weights=snapshot(state_numpy(t.model)),
                                                                 samples=t.loader.state()["samples"]) if "rewind" in v else None))
    real_check = t.spikes.detector.check
    t.spikes.detector.check = lambda step, loss, gn=None: (
        [{"kind": "loss_spike", "message": f"step {step}: loss spike"}] if step == 5 and not at_rewind else real_check(step, loss, gn))
    saves: list[int] = []  # the steps saved, in order (a rewind must not save its target again)
    real_save = t.checkpoints.save
    t.checkpoints.save = lambda step, ts: (saves.append(step), real_save(step, ts))[1]
    summary = t.train()
    at_rewind["saves"] = saves
    return t, run, at_rewind, summary


def test_spike_rewind_restores_weights_and_skips_batches(rewind_run):
    t, run, at_rewind, summary = rewind_run
    assert summary.step == 6 and summary.loss_spikes == 1
    assert at_rewind["step"] == 4  # the record of the rewind is logged at the step rewound to
    ck = load_file(str(run / "checkpoints" / "step_000004" / "model.safetensors"))
    assert all(np.array_equal(ck[k], at_rewind["weights"][k]) for k in ck)
    per_step = t.accum_steps * t.loader.batch_size  # sequences one optimizer step reads on this (only) rank
    assert at_rewind["samples"] == 5 * per_step  # the batches of step 5 are skipped, not replayed
    recs = [r for r in records(run) if "rewind" in r]
    assert len(recs) == 1 and recs[0]["rewind"] == 4.0 and recs[0]["spike"] == 1
    # step 4 is a save step, and the rewind lands on it: saving it again would replace the
    # directory other ranks are loading at that moment (a two-node run lost a rank to it)
    assert at_rewind["saves"] == [2, 4, 6]


def test_rewind_skip_skips_that_many_steps_of_data(rewind_run):
    """spike.rewind_skip > 0: the data position is the checkpoint's plus rewind_skip steps' worth
    of batches (0, tested above, keeps the position the spike was reached at)."""
    t, run, _, _ = rewind_run
    t.cfg = replace(t.cfg, spike=replace(t.cfg.spike, rewind_skip=3))
    saved = json.loads((run / "checkpoints" / "step_000006" / "data_state.json").read_text())
    lines: list[str] = []
    t.log = t.checkpoints.log = lines.append
    t.rewind()
    assert t.step == 6
    per_step = t.accum_steps * t.loader.batch_size
    assert saved["samples"] > 0 and t.loader.state()["samples"] == saved["samples"] + 3 * per_step
    assert any("rewound to step_000006, skipping 3 steps of data" in line for line in lines), lines


def test_auto_warmup_uses_the_manifest_tokens_and_the_cap(tmp_path, tiny_data):
    import math

    manifest = json.loads((tiny_data / "manifest.json").read_text())
    expected = math.ceil(0.02 * manifest["tokens"]["train"] / (4 * 32))
    t = make(tiny_data, tmp_path / "r", 'schedule.warmup_steps="auto"', "train.max_steps=100000")
    assert t.schedule.warmup == expected and t.spikes.detector.warmup_steps == expected
    # the observers as build_trainer wires them: their order is the order of their effects in each hook
    assert [type(c).__name__ for c in t.callbacks] == ["Heartbeat", "StepMeter", "StepProfiler", "ConsoleLine", "PeriodicEval",
                                                       "BatchLog", "SourceLedger", "SpikeRecord", "MetricsLogger"]
    heartbeat = next(c for c in t.callbacks if isinstance(c, Heartbeat))
    assert heartbeat._thread.is_alive()  # from build_trainer on, for launch's watchdog
    t.close()  # a trainer that will not train ends its heartbeat's thread (it wrote into pytest's tmp dirs)
    assert not heartbeat._thread.is_alive()


def test_periodic_eval_writes_eval_ppl(tmp_path, tiny_data):
    run = tmp_path / "r"
    make(tiny_data, run, "train.max_steps=4", "eval.every=2", "checkpoint.every=0", "train.mode=pynative").train()
    evals = [r for r in records(run) if "eval/ppl" in r]
    assert [r["step"] for r in evals] == [2, 4] and all(np.isfinite(r["eval/ppl"]) for r in evals)


def test_eval_at_end_false_drops_only_the_last_steps_eval(tmp_path):
    from mspretrain.config.schema import EvalConfig
    from mspretrain.train.eval_schedule import PeriodicEval

    def steps(**kw) -> list[int]:
        ev = PeriodicEval(EvalConfig(**kw), data_dir=tmp_path, seq_len=8, log=print)
        return [s for s in range(1, 8) if ev.due(s, 7)]

    assert steps() == [7] and steps(at_end=False) == []
    assert steps(every=3) == [3, 6, 7] and steps(every=3, at_end=False) == [3, 6]


def test_pynative_matches_jit(tmp_path, tiny_data):
    from mspretrain.cli import main

    for mode in ("jit", "pynative"):
        assert main(["train", "--config", str(TINY), "--data", str(tiny_data), "--run", str(tmp_path / mode), "--quiet",
                     "train.max_steps=3", "checkpoint.every=0", f"train.mode={mode}", NO_EVAL, ONE_LAYER]) == 0
    a = load_file(str(tmp_path / "jit" / "checkpoints" / "step_000003" / "model.safetensors"))
    b = load_file(str(tmp_path / "pynative" / "checkpoints" / "step_000003" / "model.safetensors"))
    for k in a:  # Adam's g/sqrt(v) amplifies last-bit differences of near-zero gradients: 1e-5, not 1e-6
        np.testing.assert_allclose(a[k], b[k], atol=1e-5, err_msg=k)
    la = [r["loss"] for r in records(tmp_path / "jit")]
    lb = [r["loss"] for r in records(tmp_path / "pynative")]
    np.testing.assert_allclose(la, lb, rtol=1e-6)


def test_retention_keeps_last_and_every(tmp_path):
    from mspretrain.config.schema import Config

    run = tmp_path / "r"
    for step in range(1, 8):
        store.write_checkpoint_dir(run / "checkpoints" / store.step_dir_name(step), step=step,
                                   model={"w": np.zeros(2, np.float32)}, optimizer=None, train_state={},
                                   data_state=None, config=Config())
    store.prune(run, keep_last=2, keep_every=3, log=lambda s: None)
    assert [s for s, _ in store.list_checkpoints(run)] == [3, 6, 7]


def test_mixing_two_data_dirs_and_refusing_a_foreign_tokenizer(tmp_path, tiny_data, tiny_cfg):
    from mspretrain.prepare.prepare import prepare
    from tests.conftest import make_poems

    text = tmp_path / "more.txt"
    text.write_text("\n\n".join(make_poems(300, seed=5)) + "\n", encoding="utf-8")
    same = tmp_path / "same"
    prepare([str(text)], same, tiny_cfg.prepare, tokenizer=str(tiny_data / "tokenizer.model"), workers=1, log=lambda s: None)
    sources = f'data.sources=[{{path="{tiny_data}", weight=0.7}}, {{path="{same}", weight=0.3}}]'
    run = tmp_path / "mix"
    s = make(tiny_data, run, sources, "train.max_steps=3", "checkpoint.every=0", NO_EVAL).train()
    assert s.step == 3
    state = json.loads((run / "checkpoints" / "step_000003" / "data_state.json").read_text())
    consumed = [src["consumed"] for src in state["sources"]]
    assert sum(consumed) == 3 * 4 and consumed[0] > consumed[1] > 0

    foreign = tmp_path / "foreign"
    prepare([str(text)], foreign, replace(tiny_cfg.prepare, vocab_size=400), workers=1, log=lambda s: None)
    bad = f'data.sources=[{{path="{tiny_data}", weight=0.5}}, {{path="{foreign}", weight=0.5}}]'
    with pytest.raises(UserError, match="different tokenizer"):
        make(tiny_data, tmp_path / "bad", bad, "train.max_steps=3")
