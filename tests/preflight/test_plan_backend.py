"""The planner's stated term for MindSpore's CPU backend (`memory_bytes.cpu_backend`, device.target =
cpu only): present, counted from the step's parameters, part of the peak, labelled in `plan`'s
text, and absent from Ascend plans (docs/benchmarks/memory.md, runs 3 and 4); and the step keeps no
`where` with a 0-d operand over a full tensor (the CPU Select kernel's 24 B per element).

tests/step/test_zero2.py::test_plan_bytes_are_the_buffers_the_step_allocates checks the per-kind buffer
bytes against a real TrainStep; this extends it to the backend term, which is derived from the same
step's tables (owned parameters, accumulation buffers)."""
from __future__ import annotations

import inspect
import re
from dataclasses import replace

import numpy as np
import pytest

from mspretrain.preflight import plan as planmod


def _cfg(tiny_cfg, dtype: str, param_dtype: str, accumulation: int, target: str = "cpu"):
    from mspretrain.config.schema import resolve_model

    gb = tiny_cfg.train.global_batch
    return replace(tiny_cfg, model=resolve_model(tiny_cfg.model, vocab_size=512),
                   precision=replace(tiny_cfg.precision, dtype=dtype, param_dtype=param_dtype),
                   train=replace(tiny_cfg.train, micro_batch=gb // accumulation),
                   device=replace(tiny_cfg.device, target=target))


def test_the_measured_constants_are_in_the_plan():
    # a refit may change them; none of them may silently become 0 (the term would vanish from CPU plans)
    assert planmod.CPU_RUNTIME_BYTES_PER_PARAM > 0
    assert planmod.CPU_HALF_BYTES_PER_PARAM > 0


@pytest.mark.parametrize("dtype,param_dtype,accumulation", [("fp32", "fp32", 1), ("fp32", "fp32", 2), ("fp16", "compute", 1),
                                                             ("fp16", "fp32", 2)])
def test_cpu_backend_term_is_counted_from_the_steps_tables(tiny_cfg, dtype, param_dtype, accumulation, monkeypatch):
    from mspretrain.model.decoder import Decoder, half_eligible
    from mspretrain.model.presets import is_half_eligible
    from mspretrain.step.step import TrainStep

    cfg = _cfg(tiny_cfg, dtype, param_dtype, accumulation)
    model = Decoder(cfg.model, dtype=dtype, seed=0)
    half = half_eligible(model) if param_dtype == "compute" else []
    step = TrainStep(model, cfg.optim, global_tokens=cfg.train.global_batch * cfg.data.seq_len, half_params=half,
                     accumulation=accumulation)
    plan = planmod.make_plan(cfg, devices=1, tokens=10**6, data_dir=None, tokens_per_s_per_device=None)
    mem = plan["memory_bytes"]
    size = lambda p: int(np.prod(p.shape))
    params = [p for p in model.trainable_params()]
    expect = (planmod.CPU_RUNTIME_BYTES_PER_PARAM * sum(size(p) for p in params)
              + (planmod.CPU_HALF_BYTES_PER_PARAM * sum(size(p) for p in params if is_half_eligible(p.name))
                 if dtype != "fp32" else 0))
    assert mem["cpu_backend"] == pytest.approx(expect, rel=1e-12) and mem["cpu_backend"] > 0
    # the buffers it adds to are still the step's (test_zero2 checks every kind; the two that move here)
    have = step.buffer_bytes()
    assert (mem["gradients"], mem["adam_moments"]) == (have["gradients"], have["adam_moments"])
    # part of the peak and of the text
    from mspretrain.preflight import costs  # where the memory model reads its constants

    for name in ("CPU_RUNTIME_BYTES_PER_PARAM", "CPU_HALF_BYTES_PER_PARAM"):
        monkeypatch.setattr(costs, name, 0)
    other = planmod.make_plan(cfg, devices=1, tokens=10**6, data_dir=None, tokens_per_s_per_device=None)["memory_bytes"]
    assert other["cpu_backend"] == 0 and mem["peak"] == pytest.approx(other["peak"] + mem["cpu_backend"], rel=1e-12)
    assert mem["total"] == pytest.approx(other["total"] + mem["cpu_backend"], rel=1e-12)
    monkeypatch.undo()
    assert re.search(r"CPU backend term \(measured\)\s+[\d.,]+ GB", planmod.format_plan(plan))


def test_the_step_has_no_0d_where_over_a_full_tensor():
    """MindSpore 2.10's CPU Select with a 0-d operand keeps 24 B per output element for the graph's
    life (run 3: the overflow mask of `_finish` and the overwrite of `accumulate` cost 24 B/param
    each). The step masks with a scaled multiply (MulNoNan: 0 where the scale is 0) and a full-size condition instead, and the plan has
    no term for it: a `where(finite, grads[...]` or `where(first, g, ...)` coming back must fail here."""
    from mspretrain.step.step import TrainStep

    finish = inspect.getsource(TrainStep._finish)
    accumulate = inspect.getsource(TrainStep._ensure_accum)
    assert not re.search(r"ops\.where\(finite,\s*(grads\[|g\b)", finish)
    assert re.search(r"_MUL_NO_NAN\(g, gscale\)", finish)  # g: the owned gradient (or its slice of a split one)
    assert not re.search(r"ops\.where\(first,\s*g,", accumulate)  # (the 0-d loss sum may keep its scalar where)
    assert re.search(r"ops\.where\(ops\.broadcast_to\(first, acc\.shape\)", accumulate)


def test_ascend_plans_have_no_cpu_term(tiny_cfg):
    for target in ("ascend", "auto"):
        cfg = _cfg(tiny_cfg, "fp16", "compute", 2, target=target)
        plan = planmod.make_plan(cfg, devices=2, tokens=10**6, data_dir=None, tokens_per_s_per_device=None)
        assert plan["memory_bytes"]["cpu_backend"] == 0 and "CPU backend term" not in planmod.format_plan(plan)


def test_buckets_are_32_mb_on_cpu_and_256_on_ascend_unless_given():
    from mspretrain.config.schema import OptimConfig
    from mspretrain.parallel.layout import ASCEND_BUCKET_MB, CPU_BUCKET_MB, bucket_mb_for

    assert OptimConfig().bucket_mb == "auto"
    assert (bucket_mb_for("auto", "cpu"), bucket_mb_for("auto", "ascend"), bucket_mb_for("auto", "auto")) == (32.0, 256.0, 256.0)
    assert (CPU_BUCKET_MB, ASCEND_BUCKET_MB) == (32.0, 256.0)
    assert bucket_mb_for(64, "cpu") == bucket_mb_for(64.0, "ascend") == 64.0 and bucket_mb_for(0, "cpu") == 0.0


@pytest.mark.parametrize("value", ['"big"', "-1", "nan"])
def test_a_bad_bucket_mb_is_one_line_naming_the_key(value):
    from mspretrain.config import schema as cfgmod
    from mspretrain.errors import UserError

    with pytest.raises(UserError, match=r"optim\.bucket_mb") as err:
        cfgmod.load(None, [f"optim.bucket_mb={value}"])
    assert "\n" not in str(err.value)
    assert cfgmod.load(None, ['optim.bucket_mb="auto"']).optim.bucket_mb == "auto"
    assert cfgmod.load(None, ["optim.bucket_mb=64"]).optim.bucket_mb == 64.0


def _sharded(tiny_cfg, target: str, bucket_mb: float | str = "auto"):
    cfg = _cfg(tiny_cfg, "fp32", "fp32", 1, target=target)
    return replace(cfg, optim=replace(cfg.optim, shard_optimizer=True, shard_gradients=True, bucket_mb=bucket_mb),
                   train=replace(cfg.train, micro_batch=0))


def test_cpu_collective_term_is_the_measured_factor_times_the_steps_largest_bucket(tiny_cfg, monkeypatch):
    """On CPU with 2 ranks the plan's collective buckets are CPU_BUCKET_FACTOR x the largest bucket
    of the layout a real TrainStep builds with the CPU default cap; Ascend keeps the flat copy and the
    ReduceScatter / AllGather results (x 1.5 with 2 ranks), and its own 256 MB cap."""
    from mspretrain.model.decoder import Decoder
    from mspretrain.parallel import layout as layoutmod
    from mspretrain.step.step import TrainStep

    # a cap below the tiny model's size, so the CPU default and Ascend's give different buckets
    monkeypatch.setattr(layoutmod, "CPU_BUCKET_MB", 0.15)
    cfg = _sharded(tiny_cfg, "cpu")
    step = TrainStep(Decoder(cfg.model, dtype="fp32", seed=0), cfg.optim, global_tokens=128, world=2, rank=0, shard=True,
                     shard_grads=True, bucket_mb=layoutmod.bucket_mb_for("auto", "cpu"), device="cpu")
    largest = max(step.layout.largest_bucket_bytes())
    red, gat = TrainStep(Decoder(cfg.model, dtype="fp32", seed=1), cfg.optim, global_tokens=128, world=2, rank=0, shard=True,
                         shard_grads=True, bucket_mb=256.0, device="cpu").layout.largest_bucket_bytes()
    assert largest < max(red, gat)  # the cap applies
    mem = planmod.make_plan(cfg, devices=2, tokens=10**6, data_dir=None, tokens_per_s_per_device=None)["memory_bytes"]
    assert mem["collective_buffers"] == pytest.approx(planmod.CPU_BUCKET_FACTOR * largest, rel=1e-12)
    assert planmod.CPU_BUCKET_FACTOR > 2  # more than a flat copy and its result: a refit may change it, not drop it
    # the same config with an explicit cap plans that cap
    given = planmod.make_plan(_sharded(tiny_cfg, "cpu", 256.0), devices=2, tokens=10**6, data_dir=None,
                              tokens_per_s_per_device=None)["memory_bytes"]
    assert given["collective_buffers"] > mem["collective_buffers"]
    # Ascend: its default cap (one bucket for the tiny model) and no CPU factor
    asc = planmod.make_plan(_sharded(tiny_cfg, "ascend"), devices=2, tokens=10**6, data_dir=None,
                            tokens_per_s_per_device=None)["memory_bytes"]
    assert asc["collective_buffers"] == pytest.approx(max(red + red / 2, gat + gat / 2), rel=1e-12)
    # and a single process has no collective at all
    assert planmod.make_plan(cfg, devices=1, tokens=10**6, data_dir=None, tokens_per_s_per_device=None)["memory_bytes"]["collective_buffers"] == 0


def test_run_config_notes_the_bucket_cap_that_ran(tiny_cfg):
    """RUN_DIR/config.toml keeps "auto" (so it resumes on either device) and says what ran."""
    from mspretrain import budget
    from mspretrain.config.schema import MetricsConfig
    from mspretrain.train.build import resolved_notes

    cfg = replace(tiny_cfg, train=replace(tiny_cfg.train, micro_batch=0))
    notes = lambda world, target: resolved_notes(cfg, budget.derive(cfg, world=world, data_tokens=10**6), MetricsConfig(), 2, target)
    assert notes(2, "cpu")["optim.bucket_mb"] == "this run: 32 MB (cpu)"
    assert notes(2, "ascend")["optim.bucket_mb"] == "this run: 256 MB (ascend)"
    assert "optim.bucket_mb" not in notes(1, "cpu")  # one process: no collective, nothing to say
    fixed = replace(cfg, optim=replace(cfg.optim, bucket_mb=64.0))
    assert "optim.bucket_mb" not in resolved_notes(fixed, budget.derive(fixed, world=2, data_tokens=10**6), MetricsConfig(), 2, "cpu")


@pytest.mark.parametrize("config, devices, largest_mb, buffsize", [
    ("llama2-7b-910b.toml", 8, 768, 200),  # one server: 768 / 8 ranks fits HCCL's default
    ("llama2-7b-910b.toml", 16, 1536, 1024),  # two servers: whole, capped at 1 GB
    ("qwen2.5-7b-zh-continue-910b.toml", 8, 2079, 260),  # the split lm_head (152,064 x 3,584 fp32) in one collective
])
def test_plan_sizes_hccl_buffsize_from_the_largest_collective(config, devices, largest_mb, buffsize):
    """What `launch` exports as HCCL_BUFFSIZE: a ZeRO bucket holds at least one parameter
    per rank and a split parameter crosses whole, so the largest collective is far above the
    256 MB bucket cap; buckets sized to HCCL's 200 MB buffer would not change these."""
    from pathlib import Path

    from mspretrain.config import schema as cfgmod
    from mspretrain.parallel.layout import bucket_mb_for

    cfg = cfgmod.load(Path(__file__).resolve().parents[2] / "configs" / config)
    plan = planmod.make_plan(cfg, devices=devices, tokens=10**9, data_dir=None, tokens_per_s_per_device=None)
    hc = plan["hccl"]
    assert (round(hc["largest_collective_bytes"] / 2**20), hc["buffsize_mb"]) == (largest_mb, buffsize)
    assert hc["largest_collective_bytes"] > bucket_mb_for("auto", "ascend") * 2**20
    assert f"HCCL_BUFFSIZE {buffsize} MB" in planmod.format_plan(plan)
    cpu = replace(cfg, device=replace(cfg.device, target="cpu"))
    assert "hccl" not in planmod.make_plan(cpu, devices=devices, tokens=10**9, data_dir=None, tokens_per_s_per_device=None)
