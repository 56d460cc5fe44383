"""StepProfiler: step-range parsing, no-op when off, and a real MindSpore profile of a tiny jit step."""
from __future__ import annotations

import os

import numpy as np
import pytest

from mspretrain.errors import UserError
from mspretrain.monitor.profiler import StepProfiler, format_top, parse_steps, top_operators


def test_parse_steps():
    assert parse_steps("10-20") == (10, 20)
    assert parse_steps(" 7 ") == (7, 7)
    assert parse_steps("") is None
    for bad in ("a-b", "20-10", "0-3", "10-", "1,2"):
        with pytest.raises(UserError):
            parse_steps(bad)


def test_off_is_a_noop(tmp_path):
    p = StepProfiler(tmp_path, "")
    for s in range(1, 4):
        p.step_begin(s)
        p.step_end(s)
    p.close()
    assert not (tmp_path / "profile").exists() and p.rows == []


def test_top_operators_from_an_ascend_op_statistic_csv(tmp_path):
    d = tmp_path / "rank0" / "ASCEND_PROFILER_OUTPUT"
    d.mkdir(parents=True)
    (d / "op_statistic.csv").write_text(
        "Device_id,OP Type,Core Type,Count,Total Time(us),Avg Time(us),Min Time(us),Max Time(us),Ratio(%)\n"
        "0,MatMulV2,AI_CORE,640,90000.0,140.6,100,200,60\n"
        "0,FlashAttentionScore,AI_CORE,64,45000.0,703.1,600,800,30\n"
        "0,Cast,AI_VECTOR_CORE,1280,15000.0,11.7,5,20,10\n")
    rows = top_operators(tmp_path, n=2)
    assert [(r["op"], r["total_ms"], r["calls"]) for r in rows] == [("MatMulV2", 90.0, 640), ("FlashAttentionScore", 45.0, 64)]
    assert rows[0]["share"] == pytest.approx(0.6)
    assert "MatMulV2" in format_top(rows)


def test_profiles_a_tiny_mindspore_step_range(tmp_path):
    os.environ.setdefault("GLOG_v", "3")
    import mindspore as ms
    from mindspore import nn, ops

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    net = nn.Dense(32, 32)

    @ms.jit
    def step(x):
        return ops.relu(net(x)).sum()

    x = ms.Tensor(np.ones((8, 32), np.float32))
    msgs: list[str] = []
    prof = StepProfiler(tmp_path, "2-3", log=msgs.append)
    for s in range(1, 5):
        prof.step_begin(s)
        step(x).asnumpy()
        assert prof.active == (s in (2, 3))  # started at the beginning of step 2
        prof.step_end(s)
        assert prof.active == (s == 2)  # stopped (and analysed) at the end of step 3
    prof.close()
    ops_seen = {r["op"] for r in prof.rows}
    assert "MatMul" in ops_seen and all(r["total_ms"] >= 0 for r in prof.rows)
    assert any("top operators" in m and "MatMul" in m for m in msgs)
    assert list((tmp_path / "profile").rglob("trace_view.json"))
