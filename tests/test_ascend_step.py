"""Issue 30, items 3, 4, 8 and 9 on CPU: deterministic mode off in the 910B configs, fp16 overflow
kept visible on Ascend (selection and refusal), MFU never above 100 %, and the API updates."""
from __future__ import annotations

from pathlib import Path

import mindspore as ms
import pytest

from mspretrain import config as cfgmod
from mspretrain import device
from mspretrain.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
CONFIGS_910B = sorted((ROOT / "configs").glob("*910b*.toml"))


# ------------------------------------------------------------------ 3. determinism

def test_every_910b_config_runs_without_deterministic_mode():
    assert len(CONFIGS_910B) >= 2
    for path in CONFIGS_910B:
        assert cfgmod.load(path).device.deterministic is False, path.name
    assert cfgmod.load(ROOT / "configs" / "tiny.toml").device.deterministic is True  # CPU and tests keep it


# ------------------------------------------------------------------ 4. fp16 overflow stays visible

def test_saturation_mode_is_refused_in_one_line_on_ascend(monkeypatch):
    cfg = cfgmod.load(None, ["precision.dtype=fp16"])
    monkeypatch.setenv(device.OVERFLOW_MODE_ENV, "SATURATION_MODE")
    with pytest.raises(UserError, match="SATURATION_MODE.*clamps fp16 overflow") as err:
        device.plan_device(cfg, target="ascend")
    assert "\n" not in str(err.value) and "set it to INFNAN_MODE" in str(err.value)
    device.plan_device(cfg, target="cpu")  # the variable means nothing to the CPU backend
    monkeypatch.setenv(device.OVERFLOW_MODE_ENV, "INFNAN_MODE")
    device.plan_device(cfg, target="ascend")


def test_ascend_setup_selects_infnan_mode_unless_the_user_set_it(monkeypatch):
    for name in ("set_device", "set_context", "set_deterministic"):
        monkeypatch.setattr(ms, name, lambda *a, **k: None)
    monkeypatch.setattr(ms.runtime, "set_memory", lambda **k: None)
    monkeypatch.setenv(device.OVERFLOW_MODE_ENV, "placeholder")
    monkeypatch.delenv(device.OVERFLOW_MODE_ENV)  # restored (unset) after the test
    info = device.plan_device(cfgmod.load(None, ["precision.dtype=fp16"]), target="ascend")
    device.setup_mindspore(info)
    import os

    assert os.environ[device.OVERFLOW_MODE_ENV] == "INFNAN_MODE"
    monkeypatch.delenv(device.OVERFLOW_MODE_ENV)
    device.setup_mindspore(device.plan_device(cfgmod.load(None, ["device.target=cpu"])))
    assert device.OVERFLOW_MODE_ENV not in os.environ  # CPU: left alone


def test_doctor_checks_the_overflow_mode():
    from mspretrain.ops.doctor import check_overflow_mode

    bad = {device.OVERFLOW_MODE_ENV: "SATURATION_MODE"}
    assert check_overflow_mode("ascend", bad)[0].status == "fail"
    assert check_overflow_mode("cpu", bad)[0].status == "warn"
    assert "INFNAN_MODE" in check_overflow_mode("ascend", bad)[0].fix
    assert check_overflow_mode("ascend", {})[0].status == "ok"
    assert check_overflow_mode("ascend", {device.OVERFLOW_MODE_ENV: "INFNAN_MODE"})[0].status == "ok"


# ------------------------------------------------------------------ 8. MFU never above 100 %

def test_a_low_peak_is_raised_to_the_observed_rate_and_mfu_stays_at_most_one(monkeypatch):
    import types

    from mspretrain.monitor import meter as meter_mod
    from mspretrain.monitor import mfu
    from mspretrain.monitor.meter import StepMeter

    # the meter's clock, advanced by hand: slept windows of 0.01 s and 0.05 s could come out in
    # the wrong order on a loaded machine (a 0.01 s sleep woken 0.1 s late)
    now = [1000.0]
    monkeypatch.setattr(meter_mod, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))

    # 1000 tokens/s x 1e9 FLOPs/token on one device = 1 TFLOPS against a "measured" peak of 0.5
    assert mfu.observed_peak(0.5, tokens=1000, seconds=1.0, flops_per_token=1e9, devices=1) == pytest.approx(1.0)
    assert mfu.observed_peak(2.0, tokens=1000, seconds=1.0, flops_per_token=1e9, devices=1) == 2.0
    assert mfu.observed_peak(0.0, tokens=1000, seconds=1.0, flops_per_token=1e9, devices=1) == 0.0  # unknown stays unknown
    assert mfu.throughput_metrics(tokens=1000, samples=10, seconds=1.0, flops_per_token=1e9, peak_tflops=0.5,
                                  devices=1)["mfu"] == 1.0
    meter = StepMeter(tokens_per_step=10**6, seq_len=64, devices=1, flops_per_token=1e9, peak_tflops=1e-9,
                      price_per_device_hour=0.0, throughput_every=1, log_every=1, memory_every=10**9, target="cpu")
    meter.sample(1, first=True)
    now[0] += 0.01
    out = meter.sample(2, first=False)
    assert out["mfu"] == pytest.approx(1.0) and out["mfu"] <= 1.0
    assert out["peak_tflops"] == meter.peak_tflops == pytest.approx(1e6 * 1e9 / 0.01 / 1e12)  # raised, logged with the sample
    now[0] += 0.05  # a slower window: below the raised peak
    assert meter.sample(3, first=False)["mfu"] < 1.0


def test_cpu_peak_is_the_best_of_large_sgemms():
    from mspretrain.monitor import mfu

    peak = mfu.measure_cpu_peak_tflops(0.2)
    assert peak > 0 and mfu.measure_cpu_peak_tflops(0.2) == peak  # cached per process


# ------------------------------------------------------------------ 9. API updates (MindSpore 2.10)

def test_profiler_uses_the_non_deprecated_api():
    import inspect

    from mspretrain.monitor import profiler

    src = inspect.getsource(profiler.StepProfiler)
    assert "ms.Profiler(" not in src and "profile(" in src
    from mindspore.profiler import profile, tensorboard_trace_handler  # noqa: F401  (exists in 2.10)


def test_setup_reads_the_device_through_get_current_device(monkeypatch):
    """An already fixed device: setup compares through get_current_device, not get_context."""
    def already(*a):
        raise RuntimeError("device already set")

    monkeypatch.setattr(ms, "set_device", already)
    monkeypatch.setattr(ms, "get_context", lambda *a: pytest.fail("get_context is deprecated for the device"))
    device.setup_mindspore(device.plan_device(cfgmod.load(None, ["device.target=cpu"])))
    assert ms.get_current_device().device_target == "CPU"


def test_eval_compiles_at_the_devices_jit_level(monkeypatch, tiny_cfg):
    from mspretrain.eval import perplexity
    from mspretrain.model.llama import Llama

    levels: list[str] = []
    real_jit = ms.jit
    monkeypatch.setattr(ms, "jit", lambda fn, **kw: levels.append(kw.get("jit_level")) or real_jit(fn, **kw))
    model = Llama(cfgmod.resolve_model(tiny_cfg.model, 512), seed=0)
    perplexity._nll_fn(model, "O1")
    perplexity._nll_fn(model, "O1")  # cached
    perplexity._nll_fn(model)
    assert levels == ["O1", "O0"]


def test_memory_docstring_says_reserved_minus_allocated():
    from mspretrain.monitor import memory

    assert "reserved minus allocated" in memory.__doc__ and "allocated minus reserved" not in memory.__doc__


# ------------------------------------------------------------------ 2. Ascend kernels, selected by device

def _rms_norm_reference(x, gamma, epsilon=1e-6):
    """ops.rms_norm's documented semantics (ops/auto_generate/gen_ops_def.py, `rms_norm`):
    y = x * rsqrt(mean(x^2, -1) + eps) * gamma, and rstd; computed here with CPU ops."""
    from mindspore import ops

    rstd = ops.rsqrt((x * x).mean(-1, keep_dims=True) + epsilon)
    return x * rstd * gamma, rstd


def test_ascend_kernels_are_selected_by_device(tiny_cfg):
    from mspretrain.model import llama

    m = cfgmod.resolve_model(tiny_cfg.model, 512)
    asc = llama.Llama(m, dtype="fp16", device="ascend", seed=0)
    cpu = llama.Llama(m, dtype="fp32", device="cpu", seed=0)
    norms = lambda model: [c for _, c in model.cells_and_names() if isinstance(c, llama.RMSNorm)]
    softmaxes = lambda model: [c.softmax for _, c in model.cells_and_names() if isinstance(c, llama.Attention)]
    assert len(norms(asc)) == 2 * m.n_layers + 1 and all(n.fused for n in norms(asc))
    assert all(isinstance(s, llama.SoftmaxPlain) for s in softmaxes(asc))
    assert not any(n.fused for n in norms(cpu)) and all(isinstance(s, llama.SoftmaxFP32) for s in softmaxes(cpu))
    assert asc.fused_kernels and not cpu.fused_kernels
    # the same parameters either way: one model definition
    assert [p.name for p in asc.get_parameters()] == [p.name for p in cpu.get_parameters()]


def test_the_ascend_step_computes_what_the_cpu_step_computes(tiny_cfg, monkeypatch):
    """The Ascend selection (fused RmsNorm, generated softmax backward, ReduceSum row sums in the loss
    and the norm) run on CPU with ops.rms_norm replaced by its documented semantics (it has no CPU
    kernel): one PyNative optimizer step gives the CPU path's loss, grad norm and weights."""
    import numpy as np
    from mindspore import ops

    from mspretrain.model import llama
    from mspretrain.train.step import TrainStep

    monkeypatch.setattr(ops, "rms_norm", _rms_norm_reference)
    m = cfgmod.resolve_model(tiny_cfg.model, 512)
    tokens = np.random.default_rng(0).integers(0, 512, (2, 17)).astype(np.int32)
    results = {}
    for dev in ("cpu", "ascend"):
        model = llama.Llama(m, dtype="fp32", device=dev, seed=0)
        step = TrainStep(model, tiny_cfg.optim, global_tokens=2 * 16, device=dev, jit=False)
        assert step._plain_sums is (dev == "ascend")
        r = step.run([(tokens, None, None)], 1e-3, 1.0)
        results[dev] = (r.loss, r.grad_norm, {k: v.copy() for k, v in llama.state_numpy(model).items()})
    (l_cpu, n_cpu, w_cpu), (l_asc, n_asc, w_asc) = results["cpu"], results["ascend"]
    assert l_asc == pytest.approx(l_cpu, rel=1e-6) and n_asc == pytest.approx(n_cpu, rel=1e-5)
    for k in w_cpu:
        # Adam moves each weight by ~lr = 1e-3 on the first step; a gradient near 0 may round either way
        np.testing.assert_allclose(w_asc[k], w_cpu[k], rtol=0, atol=1e-5, err_msg=k)


def test_plain_row_sums_in_the_loss_match_the_gemm_form():
    import numpy as np
    from mindspore import Tensor

    from mspretrain.model.loss import token_nll

    rng = np.random.default_rng(1)
    logits = Tensor(rng.standard_normal((2, 5, 40)).astype(np.float32) * 5)
    targets = Tensor(rng.integers(0, 40, (2, 5)).astype(np.int32))
    gemm, plain = token_nll(logits, targets), token_nll(logits, targets, plain_sum=True)
    for a, b in zip(gemm, plain):
        np.testing.assert_allclose(a.asnumpy(), b.asnumpy(), rtol=1e-6)


# ------------------------------------------------------------------ 6. selftest on a real node

def test_selftest_runs_the_collectives_before_binding_an_npu(monkeypatch, tmp_path):
    """On Ascend the collectives check (msrun children) runs before the parent's setup_mindspore."""
    from mspretrain.ops import selftest

    order: list[str] = []
    monkeypatch.setattr(selftest, "check_collectives",
                        lambda ctx: order.append("collectives") or selftest.Check("collectives", selftest.PASSED, "stand-in",
                                                                                  data={"bus_gbps": 42.0}))
    monkeypatch.setattr(device, "setup_mindspore", lambda info, **kw: order.append("setup_mindspore"))
    cfg = cfgmod.load(ROOT / "configs" / "llama2-7b-910b.toml")
    doc = selftest.run_selftest(cfg, tmp_path / "run", target="ascend", only=("collectives",))
    assert order == ["collectives", "setup_mindspore"]
    assert next(c for c in doc["checks"] if c["name"] == "collectives")["status"] == selftest.PASSED


def test_hbm_is_compared_with_max_device_memory():
    from mspretrain.ops import selftest

    assert selftest.check_hbm(64 * 2**30, 58.0).status == selftest.PASSED  # a 910B with 64 GB: the templates' 58 fit
    small = selftest.check_hbm(32 * 2**30, 58.0)  # a 910B4
    assert small.status == selftest.FAILED and "device.max_device_memory=26 (GB)" in small.detail
    assert selftest.check_hbm(32 * 2**30, 26.0).status == selftest.PASSED
    assert selftest.check_hbm(0, 58.0).status == selftest.SKIPPED


def test_visible_npus_and_the_reduction_bandwidth(tmp_path):
    from mspretrain.ops import selftest

    for i in range(3):
        (tmp_path / f"davinci{i}").touch()
    (tmp_path / "davinci_manager").touch()
    assert selftest.visible_npus({}, tmp_path) == 3
    assert selftest.visible_npus({"ASCEND_RT_VISIBLE_DEVICES": "0,1"}, tmp_path) == 2
    ops = {"AllReduce": {"bus_gbps": 90.0}, "ReduceScatter": {"bus_gbps": 70.0}, "Broadcast": {"bus_gbps": 10.0}}
    assert selftest._reduction_bus_gbps(ops) == 70.0
