"""Schedules equal their closed forms; the loss scaler follows its configured curve."""
import math

import pytest

from mspretrain.budget import build_schedule, total_steps
from mspretrain.config import schema as cfgmod
from mspretrain.config.schema import PrecisionConfig
from mspretrain.errors import UserError
from mspretrain.schedule import Schedule, auto_warmup_steps, scaled_lr
from mspretrain.step.loss_scale import LossScaler


def test_cosine_closed_form():
    s = Schedule("cosine", lr=1.0, warmup=10, total=110, min_lr=0.1)
    assert s(0) == pytest.approx(0.1)
    assert s(9) == pytest.approx(1.0)
    for step in (10, 35, 60, 109):
        i = step - 10
        expected = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * i / 99))
        assert s(step) == pytest.approx(expected, rel=1e-12)
    assert s(109) == pytest.approx(0.1)


def test_wsd_closed_form():
    s = Schedule("wsd", lr=2.0, warmup=5, total=100, min_lr=0.2, decay_fraction=0.2)
    assert s(4) == pytest.approx(2.0)
    assert s(50) == pytest.approx(2.0) and s(79) == pytest.approx(2.0)
    assert s(80) == pytest.approx(2.0 + (0.2 - 2.0) * 1 / 20)
    assert s(99) == pytest.approx(0.2)


def test_two_phase_rises_to_peak_then_decays():
    s = Schedule("two_phase", lr=1.0, warmup=10, total=100, min_lr=0.1, peak_ratio=1.2)
    assert s(9) == pytest.approx(1.0)
    assert s(19) == pytest.approx(1.2)
    assert s(14) == pytest.approx(1.0 + 0.2 * 0.5 * (1 - math.cos(math.pi * 5 / 10)))
    assert s(99) == pytest.approx(0.1)
    assert max(s(i) for i in range(100)) == pytest.approx(1.2)


def test_auto_warmup_is_the_field_report_formula():
    assert auto_warmup_steps(10_000_000, 8 * 256) == math.ceil(0.02 * 10_000_000 / (8 * 256))
    cfg = cfgmod.load(None, ["train.max_steps=1000", "train.global_batch=8", "data.seq_len=64"])
    sched = build_schedule(cfg, data_tokens=1_000_000)
    assert sched.warmup == math.ceil(0.02 * 1_000_000 / (8 * 64))


def test_sqrt_lr_scaling_and_budget():
    assert scaled_lr(3e-4, 128, "sqrt") == pytest.approx(3e-4 * 2)
    assert scaled_lr(3e-4, 128, "none") == 3e-4
    cfg = cfgmod.load(None, ["train.max_tokens=10000", "train.global_batch=4", "data.seq_len=50"])
    assert total_steps(cfg) == 50


def test_warmup_longer_than_run_is_refused():
    cfg = cfgmod.load(None, ["train.max_steps=10", "schedule.warmup_steps=10"])
    with pytest.raises(UserError, match="warmup_steps"):
        build_schedule(cfg, data_tokens=1000)


def test_loss_scale_warmup_growth_and_backoff():
    p = PrecisionConfig(dtype="fp16", init_scale=64, scale_warmup_to=1024, scale_warmup_steps=4, growth_interval=3)
    s = LossScaler.from_config(p)
    assert s.mode == "dynamic" and s.scale == 64
    seen = []
    for _ in range(4):
        s.update(True)
        seen.append(s.scale)
    assert seen == [64 + 960 * 0.25, 64 + 960 * 0.5, 64 + 960 * 0.75, 1024]
    for _ in range(3):
        s.update(True)
    assert s.scale == 2048  # growth x2 after growth_interval finite steps
    s.update(False)
    assert s.scale == 1024 and s.overflows == 1  # backoff x0.5
    state = s.state()
    t = LossScaler.from_config(p)
    t.load_state(state)
    assert t == s


def test_loss_scale_none_for_fp32_and_static():
    assert LossScaler.from_config(PrecisionConfig(dtype="fp32")).mode == "none"
    st = LossScaler.from_config(PrecisionConfig(dtype="fp16", loss_scale="static", init_scale=128))
    st.update(False)
    assert st.scale == 128
