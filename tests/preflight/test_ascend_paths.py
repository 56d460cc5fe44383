"""Paths that only a 910B runs, checked on CPU with the environment or config that triggers them:
MindSpore's device/communication calls are recorded, not executed. The rank-table launch, fp16 on
the wire, jit_level and determinism, the flash and fused kernels and their selection, the start-up
line, fp16 overflow kept visible, MFU never above 100 %, the MindSpore 2.10 APIs, and the selftest's
order on a node."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest

from mspretrain import device
from mspretrain import world as world_mod
from mspretrain.config import schema as cfgmod
from mspretrain.errors import UserError
from mspretrain.model import attention, decoder, layers
from mspretrain.parallel import distributed
from tests.helpers.kernels import rms_norm_reference

ROOT = Path(__file__).resolve().parents[2]
CONFIGS_910B = sorted((ROOT / "configs").glob("*910b*.toml"))


def _table_env(tmp_path, **over) -> dict[str, str]:
    table = tmp_path / "rank_table.json"
    table.write_text("{}")
    return {"RANK_TABLE_FILE": str(table), "RANK_ID": "3", "RANK_SIZE": "8", "DEVICE_ID": "3", **over}


# ------------------------------------------------------------------ rank-table launch

def test_rank_table_launch_is_selected_with_its_device(tmp_path):
    env = _table_env(tmp_path)
    launch = world_mod.select_launch("ascend", env)
    assert (launch.kind, launch.world, launch.device_id) == ("rank_table", world_mod.World(rank=3, size=8), 3)
    # msrun's variables win (msrun exports RANK_ID/RANK_SIZE too); no variables: one process
    msrun = {"MS_ROLE": "MS_WORKER", "MS_WORKER_NUM": "2", "MS_SCHED_HOST": "127.0.0.1", "MS_SCHED_PORT": "1", "RANK_ID": "1"}
    assert world_mod.select_launch("ascend", {**env, **msrun}).kind == "msrun"
    assert world_mod.select_launch("ascend", {}) == world_mod.Launch("single", world_mod.World())
    # MindSpore's other name for the table
    other = {("MINDSPORE_HCCL_CONFIG_PATH" if k == "RANK_TABLE_FILE" else k): v for k, v in env.items()}
    assert world_mod.select_launch("ascend", other).device_id == 3


@pytest.mark.parametrize("change, message", [
    ({"DEVICE_ID": None}, "missing DEVICE_ID"), ({"RANK_ID": "8"}, "outside 0..7"),
    ({"RANK_SIZE": "x"}, "not integers"), ({"RANK_TABLE_FILE": "/nonexistent/t.json"}, "does not exist")])
def test_rank_table_launch_refuses_a_bad_environment(tmp_path, change, message):
    env = {k: v for k, v in {**_table_env(tmp_path), **change}.items() if v is not None}
    with pytest.raises(UserError, match=message):
        world_mod.select_launch("ascend", env)


def test_rank_table_on_cpu_is_refused_in_one_line(tmp_path):
    with pytest.raises(UserError, match="RANK_TABLE_FILE is set"):
        world_mod.select_launch("cpu", _table_env(tmp_path))


def test_rank_table_binds_device_id_then_initialises_hccl(tmp_path, monkeypatch):
    """The rank table's DEVICE_ID is bound (not MindSpore's default 0), init() asks for hccl, and no
    deprecated auto-parallel context is set (the all-reduce is written by hand)."""
    import mindspore.communication as comm

    calls: list[tuple] = []
    for k, v in _table_env(tmp_path).items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(ms, "set_device", lambda *a: calls.append(("set_device", *a)))
    monkeypatch.setattr(ms, "set_context", lambda **kw: calls.append(("set_context", kw)))
    monkeypatch.setattr(ms, "set_deterministic", lambda flag: calls.append(("set_deterministic", flag)))
    monkeypatch.setattr(ms, "set_auto_parallel_context", lambda **kw: calls.append(("set_auto_parallel_context", kw)))
    monkeypatch.setattr(comm, "init", lambda backend=None: calls.append(("init", backend)))
    monkeypatch.setattr(comm, "get_rank", lambda: 3)
    monkeypatch.setattr(comm, "get_group_size", lambda: 8)
    info = device.plan_device(cfgmod.load(None, ["precision.dtype=fp16"]), target="ascend")
    device.setup_mindspore(info, device_id=world_mod.select_launch("ascend").device_id)  # as build_trainer does
    world = distributed.init("ascend")
    assert ("set_device", "Ascend", 3) in calls
    assert ("init", "hccl") in calls
    assert world == world_mod.World(rank=3, size=8)
    assert not [c for c in calls if c[0] == "set_auto_parallel_context"]
    # graph-kernel fusion is not switched on through the deprecated flag
    assert not [c for c in calls if c[0] == "set_context" and "enable_graph_kernel" in c[1]]
    # determinism through set_deterministic, not set_context(deterministic=...)
    assert ("set_deterministic", True) in calls
    assert not [c for c in calls if c[0] == "set_context" and "deterministic" in c[1]]


# ------------------------------------------------------------------ fp16 on the wire needs loss scaling

def test_fp16_allreduce_is_refused_without_loss_scaling():
    bf16 = ["precision.dtype=bf16", "precision.allreduce_dtype=fp16", "train.max_steps=1"]
    with pytest.raises(UserError, match="allreduce_dtype = fp16 needs loss scaling"):
        cfgmod.load(None, bf16)  # the precision section checks itself when it is loaded
    cfgmod.validate(cfgmod.load(None, [*bf16, "precision.loss_scale=dynamic"]), device="ascend")
    fp16 = cfgmod.load(None, ["precision.dtype=fp16", "precision.allreduce_dtype=fp16", "train.max_steps=1"])
    cfgmod.validate(fp16, device="ascend")  # auto = dynamic for fp16
    with pytest.raises(UserError, match="needs loss scaling"):
        cfgmod.validate(replace(fp16, precision=replace(fp16.precision, loss_scale="none")), device="ascend")


# ------------------------------------------------------------------ jit_level and determinism are config keys

def test_jit_level_and_deterministic_keys(monkeypatch):
    cfg = cfgmod.load(None, ["precision.dtype=fp16"])
    info = device.plan_device(cfg, target="ascend")
    assert (info.jit_level, info.deterministic) == ("O0", True)
    info = device.plan_device(cfgmod.load(None, ["device.jit_level=O1", "device.deterministic=false"]), target="ascend")
    assert (info.jit_level, info.deterministic) == ("O1", False)
    assert "jit_level O1" in info.describe() and "deterministic off" in info.describe()
    with pytest.raises(UserError, match="Ascend option"):
        device.plan_device(cfgmod.load(None, ["device.jit_level=O1"]), target="cpu")
    with pytest.raises(UserError, match="not one of O0, O1"):
        cfgmod.validate(cfgmod.load(None, ["device.jit_level=O2", "train.max_steps=1"]), device="ascend")
    seen: list[bool] = []
    monkeypatch.setattr(ms, "set_deterministic", lambda flag: seen.append(flag))
    device.setup_mindspore(device.plan_device(cfgmod.load(None, ["device.target=cpu", "device.deterministic=false"])))
    device.setup_mindspore(device.plan_device(cfgmod.load(None, ["device.target=cpu"])))
    assert seen == [False, True]


# ------------------------------------------------------------------ FlashAttentionScore's head size

@pytest.mark.parametrize("head_dim, ok", [(16, True), (64, True), (128, True), (512, True), (24, False), (8, False), (528, False)])
def test_flash_head_size_is_checked_in_the_selection(head_dim, ok):
    assert device.select_attention("auto", "ascend", "fp16", head_dim) is ok
    if ok:
        assert device.select_attention("flash", "ascend", "bf16", head_dim)
    else:
        with pytest.raises(UserError, match=f"head size {head_dim} is not a multiple of 16 up to 512"):
            device.select_attention("flash", "ascend", "bf16", head_dim)


# ------------------------------------------------------------------ one causal mask for all layers

def test_one_flash_causal_mask_for_all_layers(tiny_cfg, monkeypatch):
    monkeypatch.setattr(decoder.ops, "rms_norm", rms_norm_reference)  # Ascend's fused norm has no CPU kernel
    m = cfgmod.resolve_model(replace(tiny_cfg.model, n_layers=3), 256)
    model = decoder.Decoder(m, dtype="fp16", device="ascend")  # builds the flash path; nothing runs on CPU here
    assert model.use_flash
    masks = [t for cell in model.cells_and_names() for t in vars(cell[1]).values()
             if isinstance(t, ms.Tensor) and tuple(t.shape) == (layers.FLASH_MASK_SIZE,) * 2]
    assert len(masks) == 1
    seen = []

    def fake_kernel(q, k, v, real_shift, drop_mask, padding_mask, attn_mask, prefix, qlen, kvlen):
        seen.append(attn_mask)
        return None, None, None, q  # attention_out: shape (B, H, T, hd) is all the caller needs

    for layer in model.layers:
        layer.attn.flash_causal = fake_kernel
    model(ms.Tensor(np.zeros((1, 8), np.int32)))
    assert len(seen) == 3 and all(x is model.flash_causal_mask for x in seen)


# ------------------------------------------------------------------ the start-up line says what runs

def test_startup_line_reports_what_runs():
    on = device.plan_device(cfgmod.load(None, ["precision.dtype=bf16"]), target="ascend").describe()
    assert "attention flash" in on and "sink" not in on and "graph kernel" not in on
    fp32 = device.plan_device(cfgmod.load(None, []), target="ascend")
    assert not fp32.flash_attention and "attention math" in fp32.describe() and "no fp32" in fp32.describe()
    odd = device.plan_device(cfgmod.load(None, ["precision.dtype=fp16", "model.dim=96", "model.n_heads=4"]), target="ascend")
    assert not odd.flash_attention and "head size 24" in odd.describe()
    assert "attention math" in device.plan_device(cfgmod.load(None, ["device.target=cpu"])).describe()


@pytest.mark.parametrize("overrides", [["precision.dtype=fp16"], ["precision.dtype=bf16"], [],
                                       ["precision.dtype=fp16", "model.dim=96", "model.n_heads=4"]])
def test_startup_line_agrees_with_the_model_that_runs(overrides):
    """What the line claims is what Decoder builds from the same config (the trainer passes attention auto)."""
    cfg = cfgmod.load(None, overrides)
    info = device.plan_device(cfg, target="ascend")
    model = decoder.Decoder(cfgmod.resolve_model(replace(cfg.model, n_layers=1), 64), dtype=cfg.precision.dtype,
                        attention="auto", device="ascend")
    assert info.flash_attention is model.use_flash


# ------------------------------------------------------------------ MINDIR tolerance follows the dtype

def test_mindir_tolerance_is_dtype_aware():
    from mspretrain.model import mindir

    assert mindir.tolerance_for("fp32") == mindir.TOLERANCE == 1e-4
    assert mindir.tolerance_for("fp32") < mindir.tolerance_for("fp16") < mindir.tolerance_for("bf16")


# ------------------------------------------------------------------ the host pipeline does not spin on CPU

_PROBE = """
import json, os, time
import numpy as np
from mspretrain.device import DeviceInfo, setup_mindspore
setup_mindspore(DeviceInfo(target="cpu", threads=2, flash_attention=False))
import mindspore as ms
from mindspore import Parameter, Tensor, ops

w = Parameter(Tensor(np.full((512, 512), 0.01, np.float32)), name="w")

def loss(x):
    for _ in range(40):  # ~0.5 s of fwd + bwd: the launch is small beside it, even on a loaded box
        x = ops.tanh(ops.matmul(x, w))
    return x.sum()

grad = ms.value_and_grad(loss, None, (w,))

@ms.jit
def step(x):  # a train step's shape: value_and_grad and an update (what the host queue runs async)
    value, (g,) = grad(x)
    ops.assign(w, w - 1e-3 * g)
    return value

x = Tensor(np.ones((512, 512), np.float32))
step(x).asnumpy()  # compiles
calls, reads = [], []
for _ in range(3):  # the fastest of 3: one thread stalled on a loaded box must not decide
    t0 = time.perf_counter(); y = step(x); t1 = time.perf_counter(); y.asnumpy(); t2 = time.perf_counter()
    calls.append(t1 - t0); reads.append(t2 - t1)
print(json.dumps({"env": os.environ.get("MS_DEV_HOST_BLOCKING_RUN"), "call": min(calls), "read": min(reads)}))
"""


@pytest.mark.parametrize("user_value", [None, "0"])
def test_cpu_setup_runs_graphs_on_the_calling_thread_unless_the_user_says_otherwise(user_value, tmp_path):
    """On CPU, setup_mindspore sets MS_DEV_HOST_BLOCKING_RUN=1 before any op runs: the compiled call
    returns with its result computed (nothing left for `asnumpy` to spin-wait on, which took a core
    from the kernels). A user's own value is kept: with 0 the call returns at once and the read waits."""
    env = {k: v for k, v in os.environ.items() if k != device.HOST_BLOCKING_ENV}
    if user_value is not None:
        env[device.HOST_BLOCKING_ENV] = user_value
    probe = tmp_path / "probe.py"  # ms.jit needs the source in a file
    probe.write_text(_PROBE)
    out = subprocess.run([sys.executable, str(probe)], env={**env, "GLOG_v": "3"}, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    if user_value is None:
        assert got["env"] == "1"
        assert got["call"] > 10 * got["read"], got  # the work happened inside the call
    else:
        assert got["env"] == "0"
        assert got["read"] > got["call"], got  # queued: the read waited for most of it


def test_ascend_setup_leaves_the_host_pipeline_alone(monkeypatch):
    monkeypatch.delenv(device.HOST_BLOCKING_ENV, raising=False)
    monkeypatch.setattr(ms, "set_device", lambda *a: None)
    monkeypatch.setattr(ms, "set_deterministic", lambda flag: None)
    monkeypatch.setattr(ms, "set_context", lambda **kw: None)
    monkeypatch.setattr(ms.runtime, "set_memory", lambda **kw: None)
    device.setup_mindspore(device.plan_device(cfgmod.load(None, ["precision.dtype=fp16"]), target="ascend"), device_id=0)
    assert device.HOST_BLOCKING_ENV not in os.environ


# ------------------------------------------------------------------ determinism

def test_every_910b_config_runs_without_deterministic_mode():
    assert len(CONFIGS_910B) >= 2
    for path in CONFIGS_910B:
        assert cfgmod.load(path).device.deterministic is False, path.name
    assert cfgmod.load(ROOT / "configs" / "tiny.toml").device.deterministic is True  # CPU and tests keep it


# ------------------------------------------------------------------ fp16 overflow stays visible

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
    from mspretrain.preflight.doctor import check_overflow_mode

    bad = {device.OVERFLOW_MODE_ENV: "SATURATION_MODE"}
    assert check_overflow_mode("ascend", bad)[0].status == "fail"
    assert check_overflow_mode("cpu", bad)[0].status == "warn"
    assert "INFNAN_MODE" in check_overflow_mode("ascend", bad)[0].fix
    assert check_overflow_mode("ascend", {})[0].status == "ok"
    assert check_overflow_mode("ascend", {device.OVERFLOW_MODE_ENV: "INFNAN_MODE"})[0].status == "ok"


# ------------------------------------------------------------------ MFU never above 100 %

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


# ------------------------------------------------------------------ API updates (MindSpore 2.10)

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
    from mspretrain.model.decoder import Decoder

    levels: list[str] = []
    real_jit = ms.jit
    monkeypatch.setattr(ms, "jit", lambda fn, **kw: levels.append(kw.get("jit_level")) or real_jit(fn, **kw))
    model = Decoder(cfgmod.resolve_model(tiny_cfg.model, 512), seed=0)
    perplexity._nll_fn(model, "O1")
    perplexity._nll_fn(model, "O1")  # cached
    perplexity._nll_fn(model)
    assert levels == ["O1", "O0"]


def test_memory_docstring_says_reserved_minus_allocated():
    from mspretrain.monitor import memory

    assert "reserved minus allocated" in memory.__doc__ and "allocated minus reserved" not in memory.__doc__


# ------------------------------------------------------------------ Ascend kernels, selected by device

def test_ascend_kernels_are_selected_by_device(tiny_cfg):
    from mspretrain.model import decoder

    m = cfgmod.resolve_model(tiny_cfg.model, 512)
    asc = decoder.Decoder(m, dtype="fp16", device="ascend", seed=0)
    cpu = decoder.Decoder(m, dtype="fp32", device="cpu", seed=0)
    norms = lambda model: [c for _, c in model.cells_and_names() if isinstance(c, layers.RMSNorm)]
    softmaxes = lambda model: [c.softmax for _, c in model.cells_and_names() if isinstance(c, attention.Attention)]
    assert len(norms(asc)) == 2 * m.n_layers + 1 and all(n.fused for n in norms(asc))
    assert all(isinstance(s, layers.SoftmaxPlain) for s in softmaxes(asc))
    assert not any(n.fused for n in norms(cpu)) and all(isinstance(s, layers.SoftmaxFP32) for s in softmaxes(cpu))
    assert asc.fused_kernels and not cpu.fused_kernels
    # the same parameters either way: one model definition
    assert [p.name for p in asc.get_parameters()] == [p.name for p in cpu.get_parameters()]


def test_the_ascend_step_computes_what_the_cpu_step_computes(tiny_cfg, monkeypatch):
    """The Ascend selection (fused RmsNorm, generated softmax backward, ReduceSum row sums in the loss
    and the norm) run on CPU with ops.rms_norm replaced by its documented semantics (it has no CPU
    kernel): one PyNative optimizer step gives the CPU path's loss, grad norm and weights."""
    import numpy as np
    from mindspore import ops

    from mspretrain.model import decoder
    from mspretrain.step.step import TrainStep

    monkeypatch.setattr(ops, "rms_norm", rms_norm_reference)
    m = cfgmod.resolve_model(tiny_cfg.model, 512)
    tokens = np.random.default_rng(0).integers(0, 512, (2, 17)).astype(np.int32)
    results = {}
    for dev in ("cpu", "ascend"):
        model = decoder.Decoder(m, dtype="fp32", device=dev, seed=0)
        step = TrainStep(model, tiny_cfg.optim, global_tokens=2 * 16, device=dev, jit=False)
        assert step._plain_sums is (dev == "ascend")
        r = step.run([(tokens, None, None)], 1e-3, 1.0)
        results[dev] = (r.loss, r.grad_norm, {k: v.copy() for k, v in decoder.state_numpy(model).items()})
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


# ------------------------------------------------------------------ selftest on a real node

def test_selftest_runs_the_collectives_before_binding_an_npu(monkeypatch, tmp_path):
    """On Ascend the collectives check (msrun children) runs before the parent's setup_mindspore."""
    from mspretrain.preflight import selftest, selftest_result

    order: list[str] = []
    stand_in = selftest_result.Check("collectives", selftest_result.PASSED, "stand-in", data={"bus_gbps": 42.0})
    monkeypatch.setattr(selftest, "check_collectives", lambda ctx: order.append("collectives") or stand_in)
    monkeypatch.setattr(device, "setup_mindspore", lambda info, **kw: order.append("setup_mindspore"))
    cfg = cfgmod.load(ROOT / "configs" / "llama2-7b-910b.toml")
    doc = selftest.run_selftest(cfg, tmp_path / "run", target="ascend", only=("collectives",))
    assert order == ["collectives", "setup_mindspore"]
    assert next(c for c in doc["checks"] if c["name"] == "collectives")["status"] == selftest_result.PASSED


def test_hbm_is_compared_with_max_device_memory():
    from mspretrain.preflight import selftest_node, selftest_result

    assert selftest_node.check_hbm(64 * 2**30, 58.0).status == selftest_result.PASSED  # a 910B with 64 GB: the templates' 58 fit
    small = selftest_node.check_hbm(32 * 2**30, 58.0)  # a 910B4
    assert small.status == selftest_result.FAILED and "device.max_device_memory=26 (GB)" in small.detail
    assert selftest_node.check_hbm(32 * 2**30, 26.0).status == selftest_result.PASSED
    assert selftest_node.check_hbm(0, 58.0).status == selftest_result.SKIPPED


def test_visible_npus_and_the_reduction_bandwidth(tmp_path):
    from mspretrain.preflight import selftest_node

    for i in range(3):
        (tmp_path / f"davinci{i}").touch()
    (tmp_path / "davinci_manager").touch()
    assert selftest_node.visible_npus({}, tmp_path) == 3
    assert selftest_node.visible_npus({"ASCEND_RT_VISIBLE_DEVICES": "0,1"}, tmp_path) == 2
    ops = {"AllReduce": {"bus_gbps": 90.0}, "ReduceScatter": {"bus_gbps": 70.0}, "Broadcast": {"bus_gbps": 10.0}}
    assert selftest_node._reduction_bus_gbps(ops) == 70.0


def test_a_cut_model_sends_only_this_ranks_pieces_to_the_device(monkeypatch, world_of):
    """ZeRO-3 and tensor parallel built every fp32 weight whole in HBM, then cut it
    (Qwen2.5-32B: 122 GiB against the 58 GiB pool), each cut a device->host copy of the whole
    weight. A CPU build with the Ascend path's choices (a process bound to an NPU, `Tensor.to`
    counting the bytes it is asked to move): drawn on the host (`host_weights`, what train/build.py
    chooses for these layouts), nothing goes to the device until the cut, and then each rank's
    pieces alone: per rank, exactly its ZeRO-3 slices (about half of the trained bytes at world 2)
    or its tp pieces and nothing whole; the default build streams every drawn weight whole."""
    from mspretrain.model.parallel import Group, split_model
    from mspretrain.parallel.layout import slice_bounds
    from mspretrain.step.zero3 import shard_model
    from mspretrain.train.build import builds_on_host

    moved: list[int] = []
    real_to = ms.Tensor.to

    def to(self, where, *args, **kw):
        if where != "Ascend":  # a dtype: astype's own call
            return real_to(self, where, *args, **kw)
        moved.append(int(np.prod(self.shape)) * self.itemsize)
        return ms.Tensor(self.asnumpy())

    class _OnNPU:
        device_target = "Ascend"

    monkeypatch.setattr(ms.Tensor, "to", to)
    monkeypatch.setattr(ms, "get_current_device", lambda: _OnNPU())
    m = cfgmod.resolve_model(cfgmod.ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2), 96)
    whole = sum(int(np.prod(p.shape)) * 4 for p in decoder.Decoder(m, seed=0, device="ascend", dtype="fp16").get_parameters()
                if "norm" not in p.name)
    assert sum(moved) == whole  # the default build: every drawn weight to the device, whole
    for rank in (0, 1):
        world_of(rank, 2)
        moved.clear()
        model = decoder.Decoder(m, seed=0, device="ascend", dtype="fp16", host_weights=True)
        assert moved == []  # drawn on the host
        trained = {p.name: int(np.prod(p.shape)) for p in model.trainable_params()}
        shard_model(model, list(trained), 2, rank, "ascend")
        want = sum((lambda a, b: b - a)(*slice_bounds(n, 2, rank)) * 4 for n in trained.values())
        assert sum(moved) == want and max(moved) <= max(trained.values()) * 4 // 2 + 4
        moved.clear()
        model = decoder.Decoder(m, seed=0, device="ascend", dtype="fp16", host_weights=True)
        split_model(model, Group((0, 1), rank, device="ascend"))
        assert sum(moved) == sum(int(np.prod(p.shape)) * 4 for n, p in model.parameters_and_names()
                                 if p.name in model.tp_split.whole_shapes)  # the pieces, once each
        assert sum(moved) < 0.55 * whole
    on = lambda *o: builds_on_host(cfgmod.load(None, list(o)), 8)
    assert on("optim.shard_parameters=true") and on("parallel.tp=2") and not on("optim.shard_gradients=true")
    assert not builds_on_host(cfgmod.load(None, ["optim.shard_parameters=true"]), 1)


def test_a_cut_model_holds_one_whole_weight_at_a_time_on_the_host(monkeypatch, world_of, tiny_cfg):
    """The host side: on an NPU a model built for a cut (`host_weights`) draws each weight
    when it is first read (model/decoder.py LazyDraw, MindSpore's lazy initialisation), so ZeRO-3's
    slicing (through TrainStep, as train builds it) and tp's cut read, cut and drop one whole weight
    at a time instead of holding the whole fp32 model; the pieces are those of the eager build.
    Without gc.collect(): each whole weight is freed by its reference count as soon as it is cut
    (model/lazy.py `whole_value`), not when the cycle collector frees the dropped Parameter."""
    import weakref

    from mspretrain.model.parallel import Group, cut, split_model, tp_rows
    from mspretrain.parallel.layout import slice_bounds
    from mspretrain.step.step import TrainStep

    class _OnNPU:
        device_target = "Ascend"

    m = cfgmod.resolve_model(cfgmod.ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2), 96)
    whole = decoder.state_numpy(decoder.Decoder(m, seed=3, device="ascend", dtype="fp16"))  # eager, on the host
    real_to = ms.Tensor.to
    monkeypatch.setattr(ms.Tensor, "to", lambda self, where, *a, **k: self if where == "Ascend" else real_to(self, where, *a, **k))
    monkeypatch.setattr(ms, "get_current_device", lambda: _OnNPU())
    alive: list = []
    most = [0]
    real_init = decoder.LazyDraw._initialize

    def init(self, arr):
        most[0] = max(most[0], sum(r() is not None for r in alive))
        real_init(self, arr)
        alive.append(weakref.ref(arr))

    monkeypatch.setattr(decoder.LazyDraw, "_initialize", init)
    world_of(1, 2)
    model = decoder.Decoder(m, seed=3, device="ascend", dtype="fp16", host_weights=True)
    drawn = [p for p in model.get_parameters() if "norm" not in p.name]
    assert all(p.has_init for p in drawn) and not alive  # nothing drawn yet
    del drawn
    step = TrainStep(model, tiny_cfg.optim, global_tokens=64, world=2, rank=1, shard_params=True, jit=False, device="ascend")
    assert step.zero3 and len(alive) == sum("norm" not in n for n in whole) and most[0] <= 1
    for p in model.trainable_params():
        a, b = slice_bounds(whole[p.name].size, 2, 1)
        assert np.array_equal(p.asnumpy(), whole[p.name].reshape(-1)[a:b]), p.name
    # a frozen weight (not sharded, not read by the cut) is drawn whole when the step is built
    model = decoder.Decoder(m, seed=3, device="ascend", dtype="fp16", host_weights=True)
    TrainStep(model, tiny_cfg.optim, global_tokens=64, world=2, rank=1, shard_params=True, jit=False, device="ascend",
              trainable=["attention", "mlp", "norms", "lm_head"])
    assert not any(p.has_init for p in model.get_parameters())
    assert np.array_equal(dict(model.parameters_and_names())["embed.weight"].asnumpy(), whole["embed.weight"])
    alive.clear()
    most[0] = 0
    model = decoder.Decoder(m, seed=3, device="ascend", dtype="fp16", host_weights=True)
    split_model(model, Group((0, 1), 1, device="ascend"))
    assert most[0] <= 1 and len(alive) == sum("norm" not in n for n in whole)
    for p in model.trainable_params():
        assert np.array_equal(p.asnumpy(), cut(whole[p.name], tp_rows(p.name, whole[p.name].shape, m, 2, 1))), p.name


def test_an_expert_parallel_model_is_drawn_a_weight_at_a_time_and_sends_only_its_experts(monkeypatch, world_of):
    """Expert parallel on an NPU (train/build.py `builds_on_host`): the model is built undrawn
    (`host_weights`, LazyDraw) and `apply_ep` draws each expert stack on the host, keeps this rank's
    E/ep experts and sends them alone, then draws and sends every other weight whole, one at a time:
    the host never holds two whole weights, the device receives this rank's pieces once each (not
    the whole fp32 model, what the eager build streamed: 114 GB for Qwen3-30B-A3B), and the
    pieces are bit-identical to the eager build's cut."""
    import weakref

    from mspretrain.model.parallel import Group, cut
    from mspretrain.model.params import ep_piece
    from mspretrain.train.build import builds_on_host

    class _OnNPU:
        device_target = "Ascend"

    m = cfgmod.resolve_model(cfgmod.ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, family="qwen3_moe", qk_norm=True,
                                                head_dim=16, num_experts=4, experts_per_token=2, moe_ffn_dim=32), 96)
    whole = decoder.state_numpy(decoder.Decoder(m, seed=3, device="ascend", dtype="fp16"))  # eager, on the host
    experts = {n for n in whole if ep_piece(n, m, 2, 0) is not None}
    assert len(experts) == 4  # w13 and w2 of both layers
    moved: list[int] = []
    real_to = ms.Tensor.to

    def to(self, where, *args, **kw):
        if where != "Ascend":  # a dtype: astype's own call
            return real_to(self, where, *args, **kw)
        moved.append(int(np.prod(self.shape)) * self.itemsize)
        return self

    monkeypatch.setattr(ms.Tensor, "to", to)
    monkeypatch.setattr(ms, "get_current_device", lambda: _OnNPU())
    alive: list = []
    most = [0]
    real_init = decoder.LazyDraw._initialize

    def init(self, arr):  # no gc.collect(): the whole weights are freed by their reference counts
        most[0] = max(most[0], sum(r() is not None for r in alive))
        real_init(self, arr)
        alive.append(weakref.ref(arr))

    monkeypatch.setattr(decoder.LazyDraw, "_initialize", init)
    drawn = sum("norm" not in n for n in whole)  # the norms start at one, not drawn
    for rank in (0, 1):
        world_of(rank, 2)
        alive.clear()
        moved.clear()
        most[0] = 0
        model = decoder.Decoder(m, seed=3, device="ascend", dtype="fp16", host_weights=True)
        assert moved == [] and not alive  # nothing drawn, nothing sent
        split = model.apply_ep(Group((0, 1), rank, device="ascend"))
        assert len(alive) == drawn and most[0] <= 1  # each weight drawn once, one whole at a time
        assert set(split.whole_shapes) == experts and not any(p.has_init for p in model.get_parameters())
        for p in model.get_parameters():
            assert np.array_equal(p.asnumpy(), cut(whole[p.name], ep_piece(p.name, m, 2, rank))), p.name
        pieces = {p.name: int(np.prod(p.shape)) * 4 for p in model.get_parameters() if "norm" not in p.name}
        assert sorted(moved) == sorted(pieces.values())  # this rank's pieces, each once
        assert sum(pieces[n] for n in experts) * 2 == sum(whole[n].nbytes for n in experts)
    assert builds_on_host(cfgmod.load(None, ["parallel.ep=2"]), 2) and not builds_on_host(cfgmod.load(None, ["parallel.ep=2"]), 1)
