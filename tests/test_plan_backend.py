"""The planner's stated term for MindSpore's CPU backend (`memory_bytes.cpu_backend`, device.target =
cpu only): present, counted from the tensors the step's graphs really run `where` over, part of the
peak, labelled in `plan`'s text, and absent from Ascend plans (docs/benchmarks/memory.md, run 3).

tests/test_zero2.py::test_plan_bytes_are_the_buffers_the_step_allocates checks the per-kind buffer
bytes against a real TrainStep; this extends it to the backend term, which is derived from the same
step's tables (owned parameters, accumulation buffers)."""
from __future__ import annotations

import inspect
import re
from dataclasses import replace

import numpy as np
import pytest

from mspretrain.ops import plan as planmod


def _cfg(tiny_cfg, dtype: str, param_dtype: str, accumulation: int, target: str = "cpu"):
    from mspretrain.config import resolve_model

    gb = tiny_cfg.train.global_batch
    return replace(tiny_cfg, model=resolve_model(tiny_cfg.model, vocab_size=512),
                   precision=replace(tiny_cfg.precision, dtype=dtype, param_dtype=param_dtype),
                   train=replace(tiny_cfg.train, micro_batch=gb // accumulation),
                   device=replace(tiny_cfg.device, target=target))


def test_the_measured_constants_are_in_the_plan():
    # a refit may change them; none of them may silently become 0 (the term would vanish from CPU plans)
    assert planmod.CPU_SELECT_INDEX_BYTES == 24  # 3 index lists x 8 bytes (select_cpu_kernel.cc)
    assert planmod.CPU_RUNTIME_BYTES_PER_PARAM > 0
    assert planmod.CPU_HALF_BYTES_PER_PARAM > 0


@pytest.mark.parametrize("dtype,param_dtype,accumulation", [("fp32", "fp32", 1), ("fp32", "fp32", 2), ("fp16", "compute", 1),
                                                             ("fp16", "fp32", 2)])
def test_cpu_backend_term_is_counted_from_the_steps_tables(tiny_cfg, dtype, param_dtype, accumulation, monkeypatch):
    from mspretrain.model.llama import Llama, half_eligible
    from mspretrain.model.presets import is_half_eligible
    from mspretrain.train.step import TrainStep

    cfg = _cfg(tiny_cfg, dtype, param_dtype, accumulation)
    model = Llama(cfg.model, dtype=dtype, seed=0)
    half = half_eligible(model) if param_dtype == "compute" else []
    step = TrainStep(model, cfg.optim, global_tokens=cfg.train.global_batch * cfg.data.seq_len, half_params=half,
                     accumulation=accumulation)
    plan = planmod.make_plan(cfg, devices=1, tokens=10**6, data_dir=None, tokens_per_s_per_device=None)
    mem = plan["memory_bytes"]
    size = lambda p: int(np.prod(p.shape))
    # `_finish` masks every owned gradient; `accumulate` every accumulation buffer
    select = sum(size(step.params[i]) for i in step.own) + (sum(size(a) for a in step.accum) if accumulation > 1 else 0)
    params = [p for p in model.trainable_params()]
    expect = (planmod.CPU_SELECT_INDEX_BYTES * select + planmod.CPU_RUNTIME_BYTES_PER_PARAM * sum(size(p) for p in params)
              + (planmod.CPU_HALF_BYTES_PER_PARAM * sum(size(p) for p in params if is_half_eligible(p.name))
                 if dtype != "fp32" else 0))
    assert mem["cpu_backend"] == pytest.approx(expect, rel=1e-12) and mem["cpu_backend"] > 0
    # the buffers it adds to are still the step's (test_zero2 checks every kind; the two that move here)
    have = step.buffer_bytes()
    assert (mem["gradients"], mem["adam_moments"]) == (have["gradients"], have["adam_moments"])
    # part of the peak and of the text
    for name in ("CPU_SELECT_INDEX_BYTES", "CPU_RUNTIME_BYTES_PER_PARAM", "CPU_HALF_BYTES_PER_PARAM"):
        monkeypatch.setattr(planmod, name, 0)
    other = planmod.make_plan(cfg, devices=1, tokens=10**6, data_dir=None, tokens_per_s_per_device=None)["memory_bytes"]
    assert other["cpu_backend"] == 0 and mem["peak"] == pytest.approx(other["peak"] + mem["cpu_backend"], rel=1e-12)
    assert mem["total"] == pytest.approx(other["total"] + mem["cpu_backend"], rel=1e-12)
    monkeypatch.undo()
    assert re.search(r"CPU backend term \(measured\)\s+[\d.,]+ GB", planmod.format_plan(plan))


def test_the_step_still_masks_with_a_0d_where_where_the_plan_counts_it():
    """The Select term is tied to two lines of train/step.py. When either stops being a `where` with a
    0-d condition over a full-size tensor (e.g. `nan_to_num(g * where(finite, gscale, 0))`, measured
    23.5 bytes/param smaller), the plan's count must change with it and the bench be re-run."""
    from mspretrain.train.step import TrainStep

    finish = inspect.getsource(TrainStep._finish)
    accumulate = inspect.getsource(TrainStep._ensure_accum)
    assert re.search(r"ops\.where\(finite,\s*grads\[", finish), \
        "step._finish no longer masks each gradient with where(finite, ...): update memory_model's select elements"
    assert re.search(r"ops\.where\(first,\s*g,\s*acc \+ g\)", accumulate), \
        "step.accumulate no longer uses where(first, g, acc + g): update memory_model's select elements"


def test_ascend_plans_have_no_cpu_term(tiny_cfg):
    for target in ("ascend", "auto"):
        cfg = _cfg(tiny_cfg, "fp16", "compute", 2, target=target)
        plan = planmod.make_plan(cfg, devices=2, tokens=10**6, data_dir=None, tokens_per_s_per_device=None)
        assert plan["memory_bytes"]["cpu_backend"] == 0 and "CPU backend term" not in planmod.format_plan(plan)
