"""Device memory from MindSpore's runtime statistics is its own metric next to host
RSS, reaches the report, and is quoted in diagnose's OOM advice."""
from __future__ import annotations

import json

import mindspore as ms

from mspretrain.forensics.diagnose import diagnose
from mspretrain.monitor import memory
from mspretrain.monitor.metrics import INTERVAL_FIELD

GB = 1024**3


def test_device_memory_on_ascend_host_rss_everywhere(monkeypatch):
    monkeypatch.setattr(ms.runtime, "max_memory_allocated", lambda: 40 * GB)
    monkeypatch.setattr(ms.runtime, "max_memory_reserved", lambda: 48 * GB)
    on_npu = memory.memory_metrics("ascend")
    assert on_npu["device_mem_mb"] == 40 * 1024 and on_npu["device_mem_reserved_mb"] == 48 * 1024
    assert 0 < on_npu["mem_mb"] < 40 * 1024  # host RSS of this test process, a separate figure
    assert set(memory.memory_metrics("cpu")) == {"mem_mb"}  # MindSpore reports 0 on CPU: left out, not logged as 0
    assert INTERVAL_FIELD["device_mem_mb"] == INTERVAL_FIELD["device_mem_reserved_mb"] == "memory_every"


def test_oom_advice_quotes_the_device_memory(tmp_path):
    (tmp_path / "train.log").write_text("step 200 ...\nRuntimeError: Allocate memory failed\n")
    recs = [{"step": 200, "mem_mb": 9000.0, "device_mem_mb": 61.5 * 1024, "device_mem_reserved_mb": 63.0 * 1024}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (oom,) = [f for f in diagnose(tmp_path) if f.kind == "oom"]
    assert "peak allocated 61.5 GB, peak reserved 63.0 GB" in oom.advice and "step 200" in oom.advice


def test_report_draws_device_memory_as_its_own_line(tmp_path):
    from mspretrain.forensics import report_plots

    recs = [{"step": s, "mem_mb": 900.0 + s, "device_mem_mb": 30000.0 + s, "device_mem_reserved_mb": 32000.0} for s in (1, 2, 3)]
    fig = report_plots.plot_panel("memory", "Memory", {"records": recs, "events": []})
    labels = [ln.get_label() for ln in fig.axes[0].get_lines()]
    assert labels == ["host RSS (peak)", "device allocated (peak)", "device reserved (peak)"]
