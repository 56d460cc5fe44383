"""The planner's stated term for MindSpore's CPU backend (`memory_bytes.cpu_backend`, device.target =
cpu only): present, counted from the step's parameters, part of the peak, labelled in `plan`'s
text, and absent from Ascend plans (docs/benchmarks/memory.md, runs 3 and 4); and the step keeps no
`where` with a 0-d operand over a full tensor (the CPU Select kernel's 24 B per element).

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
    params = [p for p in model.trainable_params()]
    expect = (planmod.CPU_RUNTIME_BYTES_PER_PARAM * sum(size(p) for p in params)
              + (planmod.CPU_HALF_BYTES_PER_PARAM * sum(size(p) for p in params if is_half_eligible(p.name))
                 if dtype != "fp32" else 0))
    assert mem["cpu_backend"] == pytest.approx(expect, rel=1e-12) and mem["cpu_backend"] > 0
    # the buffers it adds to are still the step's (test_zero2 checks every kind; the two that move here)
    have = step.buffer_bytes()
    assert (mem["gradients"], mem["adam_moments"]) == (have["gradients"], have["adam_moments"])
    # part of the peak and of the text
    for name in ("CPU_RUNTIME_BYTES_PER_PARAM", "CPU_HALF_BYTES_PER_PARAM"):
        monkeypatch.setattr(planmod, name, 0)
    other = planmod.make_plan(cfg, devices=1, tokens=10**6, data_dir=None, tokens_per_s_per_device=None)["memory_bytes"]
    assert other["cpu_backend"] == 0 and mem["peak"] == pytest.approx(other["peak"] + mem["cpu_backend"], rel=1e-12)
    assert mem["total"] == pytest.approx(other["total"] + mem["cpu_backend"], rel=1e-12)
    monkeypatch.undo()
    assert re.search(r"CPU backend term \(measured\)\s+[\d.,]+ GB", planmod.format_plan(plan))


def test_the_step_has_no_0d_where_over_a_full_tensor():
    """MindSpore 2.10's CPU Select with a 0-d operand keeps 24 B per output element for the graph's
    life (run 3: the overflow mask of `_finish` and the overwrite of `accumulate` cost 24 B/param
    each). The step masks with a scaled multiply and a full-size condition instead, and the plan has
    no term for it: a `where(finite, grads[...]` or `where(first, g, ...)` coming back must fail here."""
    from mspretrain.train.step import TrainStep

    finish = inspect.getsource(TrainStep._finish)
    accumulate = inspect.getsource(TrainStep._ensure_accum)
    assert not re.search(r"ops\.where\(finite,\s*grads\[", finish)
    assert re.search(r"ops\.nan_to_num\(grads\[", finish)
    assert not re.search(r"ops\.where\(first,\s*g,", accumulate)  # (the 0-d loss sum may keep its scalar where)
    assert re.search(r"ops\.where\(ops\.broadcast_to\(first, acc\.shape\)", accumulate)


def test_ascend_plans_have_no_cpu_term(tiny_cfg):
    for target in ("ascend", "auto"):
        cfg = _cfg(tiny_cfg, "fp16", "compute", 2, target=target)
        plan = planmod.make_plan(cfg, devices=2, tokens=10**6, data_dir=None, tokens_per_s_per_device=None)
        assert plan["memory_bytes"]["cpu_backend"] == 0 and "CPU backend term" not in planmod.format_plan(plan)
