"""Paths that only a 910B runs, checked on CPU with the environment or config that triggers them
(issue 19, items 1-9): MindSpore's device/communication calls are recorded, not executed."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import mindspore as ms
import numpy as np
import pytest

from mspretrain import config as cfgmod
from mspretrain import device
from mspretrain.errors import UserError
from mspretrain.model import llama
from mspretrain.train import distributed


def _table_env(tmp_path, **over) -> dict[str, str]:
    table = tmp_path / "rank_table.json"
    table.write_text("{}")
    return {"RANK_TABLE_FILE": str(table), "RANK_ID": "3", "RANK_SIZE": "8", "DEVICE_ID": "3", **over}


# ------------------------------------------------------------------ 1. rank-table launch

def test_rank_table_launch_is_selected_with_its_device(tmp_path):
    env = _table_env(tmp_path)
    launch = distributed.select_launch("ascend", env)
    assert (launch.kind, launch.world, launch.device_id) == ("rank_table", distributed.World(rank=3, size=8), 3)
    # msrun's variables win (msrun exports RANK_ID/RANK_SIZE too); no variables: one process
    msrun = {"MS_ROLE": "MS_WORKER", "MS_WORKER_NUM": "2", "MS_SCHED_HOST": "127.0.0.1", "MS_SCHED_PORT": "1", "RANK_ID": "1"}
    assert distributed.select_launch("ascend", {**env, **msrun}).kind == "msrun"
    assert distributed.select_launch("ascend", {}) == distributed.Launch("single", distributed.World())
    # MindSpore's other name for the table
    other = {("MINDSPORE_HCCL_CONFIG_PATH" if k == "RANK_TABLE_FILE" else k): v for k, v in env.items()}
    assert distributed.select_launch("ascend", other).device_id == 3


@pytest.mark.parametrize("change, message", [
    ({"DEVICE_ID": None}, "missing DEVICE_ID"), ({"RANK_ID": "8"}, "outside 0..7"),
    ({"RANK_SIZE": "x"}, "not integers"), ({"RANK_TABLE_FILE": "/nonexistent/t.json"}, "does not exist")])
def test_rank_table_launch_refuses_a_bad_environment(tmp_path, change, message):
    env = {k: v for k, v in {**_table_env(tmp_path), **change}.items() if v is not None}
    with pytest.raises(UserError, match=message):
        distributed.select_launch("ascend", env)


def test_rank_table_on_cpu_is_refused_in_one_line(tmp_path):
    with pytest.raises(UserError, match="RANK_TABLE_FILE is set"):
        distributed.select_launch("cpu", _table_env(tmp_path))


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
    device.setup_mindspore(info, device_id=distributed.select_launch("ascend").device_id)  # as build_trainer does
    world = distributed.init("ascend")
    assert ("set_device", "Ascend", 3) in calls
    assert ("init", "hccl") in calls
    assert world == distributed.World(rank=3, size=8)
    assert not [c for c in calls if c[0] == "set_auto_parallel_context"]
    # item 3: graph-kernel fusion is not switched on through the deprecated flag
    assert not [c for c in calls if c[0] == "set_context" and "enable_graph_kernel" in c[1]]
    # item 4: determinism through set_deterministic, not set_context(deterministic=...)
    assert ("set_deterministic", True) in calls
    assert not [c for c in calls if c[0] == "set_context" and "deterministic" in c[1]]


# ------------------------------------------------------------------ 2. fp16 on the wire needs loss scaling

def test_fp16_allreduce_is_refused_without_loss_scaling():
    bf16 = ["precision.dtype=bf16", "precision.allreduce_dtype=fp16", "train.max_steps=1"]
    with pytest.raises(UserError, match="allreduce_dtype = fp16 needs loss scaling"):
        cfgmod.load(None, bf16)  # the precision section checks itself when it is loaded
    cfgmod.validate(cfgmod.load(None, [*bf16, "precision.loss_scale=dynamic"]), device="ascend")
    fp16 = cfgmod.load(None, ["precision.dtype=fp16", "precision.allreduce_dtype=fp16", "train.max_steps=1"])
    cfgmod.validate(fp16, device="ascend")  # auto = dynamic for fp16
    with pytest.raises(UserError, match="needs loss scaling"):
        cfgmod.validate(replace(fp16, precision=replace(fp16.precision, loss_scale="none")), device="ascend")


# ------------------------------------------------------------------ 3, 4. jit_level and determinism are config keys

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


# ------------------------------------------------------------------ 5. FlashAttentionScore's head size

@pytest.mark.parametrize("head_dim, ok", [(16, True), (64, True), (128, True), (512, True), (24, False), (8, False), (528, False)])
def test_flash_head_size_is_checked_in_the_selection(head_dim, ok):
    assert llama.select_attention("auto", "ascend", "fp16", head_dim) is ok
    if ok:
        assert llama.select_attention("flash", "ascend", "bf16", head_dim)
    else:
        with pytest.raises(UserError, match=f"head size {head_dim} is not a multiple of 16 up to 512"):
            llama.select_attention("flash", "ascend", "bf16", head_dim)


# ------------------------------------------------------------------ 6. one causal mask for all layers

def test_one_flash_causal_mask_for_all_layers(tiny_cfg, monkeypatch):
    from tests.test_ascend_step import _rms_norm_reference

    monkeypatch.setattr(llama.ops, "rms_norm", _rms_norm_reference)  # Ascend's fused norm has no CPU kernel
    m = cfgmod.resolve_model(replace(tiny_cfg.model, n_layers=3), 256)
    model = llama.Llama(m, dtype="fp16", device="ascend")  # builds the flash path; nothing runs on CPU here
    assert model.use_flash
    masks = [t for cell in model.cells_and_names() for t in vars(cell[1]).values()
             if isinstance(t, ms.Tensor) and tuple(t.shape) == (llama.FLASH_MASK_SIZE,) * 2]
    assert len(masks) == 1
    seen = []

    def fake_kernel(q, k, v, real_shift, drop_mask, padding_mask, attn_mask, prefix, qlen, kvlen):
        seen.append(attn_mask)
        return None, None, None, q  # attention_out: shape (B, H, T, hd) is all the caller needs

    for layer in model.layers:
        layer.attn.flash_causal = fake_kernel
    model(ms.Tensor(np.zeros((1, 8), np.int32)))
    assert len(seen) == 3 and all(x is model.flash_causal_mask for x in seen)


# ------------------------------------------------------------------ 8. the start-up line says what runs

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
    """What the line claims is what Llama builds from the same config (the trainer passes attention auto)."""
    cfg = cfgmod.load(None, overrides)
    info = device.plan_device(cfg, target="ascend")
    model = llama.Llama(cfgmod.resolve_model(replace(cfg.model, n_layers=1), 64), dtype=cfg.precision.dtype,
                        attention="auto", device="ascend")
    assert info.flash_attention is model.use_flash


# ------------------------------------------------------------------ 9. MINDIR tolerance follows the dtype

def test_mindir_tolerance_is_dtype_aware():
    from mspretrain.model import mindir

    assert mindir.tolerance_for("fp32") == mindir.TOLERANCE == 1e-4
    assert mindir.tolerance_for("fp32") < mindir.tolerance_for("fp16") < mindir.tolerance_for("bf16")


# ------------------------------------------------------------------ 6. the host pipeline does not spin on CPU

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
