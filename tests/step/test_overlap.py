"""Communication overlaps the backward pass: buckets in gradient-readiness order,
collectives chained only on CPU, and the compiled graph's execution order showing the first
gradient collective issued before the last backward op."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Compiles the fused step of rank 0 of 2 (replicated, fp32, 0.05 MB buckets: 5 buckets of the tiny
# model with one layer: the order within one layer's backward pass is what this is about, and the
# backend compiles it in less than half the time of two) with MindSpore's IR dump on, without running it (a collective without a communicator
# cannot run in one process), and prints the kernel graph's execution order. MindSpore prints the
# kernel graph after `graph_build` in execution order (backend/common/session/exec_order_builder.cc,
# the "bfs" order that `ms.jit(options={"exec_order": ...})` documents as the default, with "good
# communication masking"). A subprocess: the dump switch is process-wide.
_COMPILE = r"""
import glob, json, re, sys, time
from dataclasses import replace
import numpy as np
import mindspore as ms
from mindspore import Tensor
from mindspore.graph.api import _JitExecutor  # compile without running; ms.jit has no public compile-only call
from mspretrain.config import schema as cfgmod
from mspretrain.model.decoder import Decoder
from mspretrain.step.step import TrainStep

out, device = sys.argv[1], sys.argv[2]
ms.set_context(save_graphs=1, save_graphs_path=out)
cfg = cfgmod.load(sys.argv[3])
model = Decoder(cfgmod.resolve_model(replace(cfg.model, n_layers=1), 512), dtype="fp32", seed=0)
step = TrainStep(model, cfg.optim, global_tokens=64, world=2, rank=0, device=device, bucket_mb=0.05, jit=False)
tokens = Tensor(np.zeros((2, 17), np.int32))
one = Tensor(1.0, ms.float32)
_JitExecutor(step._fused, time.time_ns()).compile(step._fused.__name__, tokens, None, None, one, one, one)
ir = open(sorted(glob.glob(out + "/graph_build_0_*.ir"))[-1]).read()
names = re.findall(r"Fullname with scope: \(([^)]*)\)", ir)
print(json.dumps({"order": names, "buckets": [list(step._ar[k][0]) for _, k in step._schedule], "chain": step._chain}))
"""


def _execution_order(tmp_path: Path, device: str) -> dict:
    env = {**os.environ, "GLOG_v": "3", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", _COMPILE, str(tmp_path / "ir"), device, str(ROOT / "configs" / "tiny.toml")],
                          capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_first_gradient_collective_is_issued_before_the_last_backward_op(tmp_path):
    """The Ascend step (no chain between collectives) compiled by MindSpore's backend: the first
    AllReduce comes before the last op of the backward pass, so HCCL works while the backward pass
    still computes (not after the embedding's gradient, as when the bucket holding it went first,
    and after every other backward op)."""
    got = _execution_order(tmp_path, "ascend")
    order = got["order"]
    collectives = [i for i, n in enumerate(order) if "AllReduce" in n]
    backward = [i for i, n in enumerate(order) if n.startswith("Gradients/")]
    assert not got["chain"]
    assert len(collectives) == len(got["buckets"]) + 1 == 6  # the buckets and the loss sum
    assert collectives[0] < backward[-1], (collectives, backward[-1])
    # the buckets are in readiness order: the first holds lm_head, the last the embedding
    assert got["buckets"][0] == [max(i for b in got["buckets"] for i in b)]
    assert got["buckets"][-1] == [0]


def test_collectives_are_chained_on_cpu_only(tiny_cfg):
    """CPU (mccl) needs every rank to issue its collectives in one order, so they are chained there;
    Ascend runs them in the graph's execution order, unchained (step/step.py, `_chain`)."""
    from mspretrain.config.schema import resolve_model
    from mspretrain.model.decoder import Decoder
    from mspretrain.step.step import TrainStep

    model = Decoder(resolve_model(tiny_cfg.model, vocab_size=512), seed=0)
    cpu = TrainStep(model, tiny_cfg.optim, global_tokens=64, world=2, rank=0, device="cpu", bucket_mb=0.05, jit=False)
    asc = TrainStep(model, tiny_cfg.optim, global_tokens=64, world=2, rank=0, device="ascend", bucket_mb=0.05, jit=False)
    assert cpu._chain and not asc._chain
    # one schedule, the same on both (and on every rank: it is a function of the sizes only)
    assert cpu._schedule == asc._schedule
    ready = [min(cpu._ar[k][0]) for _, k in cpu._schedule]
    assert ready == sorted(ready, reverse=True)
    # the squared norm is summed in parameter order whatever the buckets
    assert [cpu._order[k] for k in cpu._norm_order] == sorted(cpu._order)


def test_plan_reports_the_expected_overlap():
    """`plan` shows each bucket's collective time at the stated bus bandwidth against the backward
    compute that can hide it; with the buckets in readiness order only the last bucket's collective
    (and what queues behind it) is exposed."""
    from mspretrain.parallel.layout import plan_layout
    from mspretrain.preflight.plan import overlap_estimate

    sizes = [100] * 10
    layout = plan_layout(sizes, [False] * 10, [False] * 10, 2, shard=False, shard_grads=False, cap=300)
    # 1 s of backward, 4 bytes x 300 elements x 2 (ring, N=2: 2(N-1)/N = 1) per bucket at 1200 B/s: 1 s each
    est = overlap_estimate(layout, backward_s=1.0, bus_bytes_per_s=1200.0)
    assert [round(b["compute_s"], 6) for b in est["buckets"]] == [0.3, 0.3, 0.3, 0.1]
    assert est["comm_s"] == pytest.approx(1.0 + 1.0 + 1.0 + 1 / 3)
    # bucket k starts when its gradients exist and the link is free: exposed = end of the last - 1 s
    assert est["exposed_s"] == pytest.approx(0.3 + 1.0 + 1.0 + 1.0 + 1 / 3 - 1.0)
    fast = overlap_estimate(layout, backward_s=1.0, bus_bytes_per_s=1.2e9)
    assert fast["exposed_s"] == pytest.approx(400 / 1.2e9)  # only the last bucket's own time (100 fp32 elements)


def test_plan_of_the_910b_config_prints_the_overlap(capsys):
    from mspretrain.cli import main

    assert main(["plan", "--config", str(ROOT / "configs" / "llama2-7b-910b.toml"), "--devices", "8", "--tokens", "1e9"]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("overlap"))
    assert re.search(r"GB/s", line) and "exposed" in line
