"""Sharded parameters (ZeRO-3, `optim.shard_parameters`): the gather primitive and its bprop, the
slicing of the model, and 2 msrun ranks against one process, resumed across layouts."""
from __future__ import annotations

import shutil
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, ops

from mspretrain.errors import UserError
from mspretrain.parallel.layout import slice_bounds
from tests.conftest import FP16_MASTERS, NO_EVAL, REFERENCE_ARGS, assert_close_rel, assert_same_checkpoint, copy_run_at
from tests.helpers.runs import FINAL, MSRUN, STEPS
from tests.helpers.runs import assert_two_ranks_equal_one_process as _assert_two_ranks_equal_one_process
from tests.helpers.runs import fp16_run_equals_one_process as _fp16_run_equals_one_process
from tests.helpers.runs import grad_norms as _grad_norms
from tests.helpers.runs import losses as _metrics
from tests.helpers.runs import msrun as _msrun
from tests.helpers.runs import step_dir as _step_dir


def _tiny(**kw):
    from mspretrain.config.schema import ModelConfig, resolve_model
    from mspretrain.model.decoder import Decoder

    return Decoder(resolve_model(ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, **kw), vocab_size=96), seed=0)


def test_the_gather_picks_its_collectives_by_device(world_of):
    """Ascend: HCCL's AllGather forward, ReduceScatter backward; CPU (mccl has neither a
    ReduceScatter nor a second AllGather per graph): AllReduce both ways."""
    from mspretrain.step.zero3 import ShardedGather

    world_of(1, 4)
    npu = ShardedGather((10, 3), 4, 1, "ascend")
    assert isinstance(npu.all_gather, ops.AllGather) and isinstance(npu.reduce_scatter, ops.ReduceScatter)
    assert not hasattr(npu, "all_reduce")
    cpu = ShardedGather((10, 3), 4, 1, "cpu")
    assert isinstance(cpu.all_reduce, ops.AllReduce) and not hasattr(cpu, "all_gather") and not hasattr(cpu, "reduce_scatter")
    # 30 elements over 4 ranks: slices of c = 8, the last one 6 (layout.py slice_bounds)
    assert (cpu.c, cpu.len) == (8, 8) and ShardedGather((10, 3), 4, 3, "cpu").len == 6


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_gather_and_its_bprop_on_the_cpu_form_with_a_loopback_peer(world_of, rank):
    """The CPU form with the AllReduce replaced by the identity (the peers contribute zeros): the
    forward puts this rank's slice at its place in the whole tensor, zeros elsewhere; the backward
    hands this rank exactly its slice of the whole gradient, and the anchor a zero gradient."""
    from mspretrain.step.zero3 import ShardedGather

    world_of(rank, 3)
    shape, n = (5, 4), 20  # c = 7: slices 7, 7, 6
    g = ShardedGather(shape, 3, rank, "cpu")
    g.all_reduce = lambda x: x
    a, b = slice_bounds(n, 3, rank)
    piece = Tensor(np.arange(a, b, dtype=np.float32) + 1)
    anchor = Tensor(np.ones((2, 4), np.float32))
    full = g(piece, anchor).asnumpy()
    want = np.zeros(n, np.float32)
    want[a:b] = np.arange(a, b) + 1
    assert full.shape == shape and np.array_equal(full.reshape(-1), want)

    weights = Tensor(np.arange(n, dtype=np.float32).reshape(shape) * 0.5)
    grads = ms.grad(lambda p, x: (g(p, x) * weights).sum(), grad_position=(0, 1))(piece, anchor)
    assert np.array_equal(grads[0].asnumpy(), weights.asnumpy().reshape(-1)[a:b])  # d/dslice of sum(W * full)
    assert np.array_equal(grads[1].asnumpy(), np.zeros((2, 4), np.float32))


@pytest.mark.parametrize("rank", [0, 2])
def test_gather_and_its_bprop_on_the_ascend_form_with_a_loopback_peer(world_of, rank):
    """The Ascend form (AllGather forward, ReduceScatter backward), its collectives replaced by
    loopbacks: the gather returns every rank's padded slice in rank order (the peers' known
    values), the reduce-scatter this rank's c elements of the padded gradient summed with the
    peers' (each a gradient of ones). Forward: the whole tensor; backward: exactly this rank's slice
    of the summed gradient, once (not twice, not another rank's chunk), and the anchor a zero gradient."""
    from mspretrain.step.zero3 import ShardedGather

    world_of(rank, 3)
    shape, n, world = (5, 4), 20, 3  # c = 7: slices 7, 7, 6 (the last padded by one)
    g = ShardedGather(shape, world, rank, "ascend")
    c = g.c
    whole = np.arange(n, dtype=np.float32) + 1
    a, b = slice_bounds(n, world, rank)
    seen = {}

    def gather(flat):  # every rank's c elements in rank order: this rank's own, the peers' from `whole`
        padded = np.concatenate([whole, np.zeros(world * c - n, np.float32)])
        mine = flat.asnumpy()
        seen["gathered_input"] = mine
        padded[rank * c:(rank + 1) * c] = mine
        return Tensor(padded)

    def reduce_scatter(grad):
        summed = grad.asnumpy() + (world - 1) * np.ones(world * c, np.float32)  # the peers' gradients of ones
        return Tensor(summed[rank * c:(rank + 1) * c])

    g.all_gather, g.reduce_scatter = gather, reduce_scatter
    piece = Tensor(whole[a:b].copy())
    anchor = Tensor(np.ones((1,), np.float32))
    full = g(piece, anchor).asnumpy()
    assert full.shape == shape and np.array_equal(full.reshape(-1), whole)
    assert seen["gathered_input"].shape == (c,)  # every rank hands c elements (zero-padded)
    weights = Tensor(np.arange(n, dtype=np.float32).reshape(shape) * 0.5)
    grads = ms.grad(lambda p, x: (g(p, x) * weights).sum(), grad_position=(0, 1))(piece, anchor)
    want = weights.asnumpy().reshape(-1)[a:b] + (world - 1)  # this rank's dW summed with the peers' ones, once
    assert np.array_equal(grads[0].asnumpy(), want)
    assert np.array_equal(grads[1].asnumpy(), np.zeros((1,), np.float32))


def test_shard_model_cuts_each_trained_weight_into_this_ranks_slice_and_reloads_whole_tensors(world_of):
    from mspretrain.model.decoder import state_numpy
    from mspretrain.step.zero3 import gathered, load_full_state, shard_model

    world_of(1, 2)
    whole = {k: v.copy() for k, v in state_numpy(_tiny()).items()}
    model = _tiny()
    names = [p.name for p in model.trainable_params()]
    shard_model(model, names, 2, 1, "cpu")
    assert [p.name for p in model.trainable_params()] == names  # same names, same order
    for p in model.trainable_params():
        a, b = slice_bounds(whole[p.name].size, 2, 1)
        assert p.shape == (b - a,) and np.array_equal(p.asnumpy(), whole[p.name].reshape(-1)[a:b])
    assert [n for n, _, _ in gathered(model)] == names
    # a checkpoint's whole tensors (any layout) come back as this rank's slices
    load_full_state(model, {k: v * 2 for k, v in whole.items()}, 2, 1)
    p = dict((q.name, q) for q in model.trainable_params())["lm_head.weight"]
    assert np.array_equal(p.asnumpy(), 2 * whole["lm_head.weight"].reshape(-1)[3072:])
    with pytest.raises(UserError, match="shape"):
        load_full_state(model, {**whole, "norm.weight": np.ones(65, np.float32)}, 2, 1)


MOE_FAMILY = {"family": "qwen3_moe", "qk_norm": True, "head_dim": 16, "num_experts": 4, "experts_per_token": 2,
              "moe_ffn_dim": 32, "router_bias_update_rate": 1e-3}


@pytest.mark.parametrize("family", [{"family": "qwen2", "qkv_bias": True}, {"family": "qwen3", "qk_norm": True, "head_dim": 16},
                                    MOE_FAMILY])
def test_qwen_bias_and_qk_norm_are_sliced_and_gathered_like_the_weights(world_of, family):
    """Qwen2's q/k/v bias gets a gather of its own (`bias_gather`, after its weight's); Qwen3's q and
    k norm weights one each (k_norm's anchored on q_norm's output); Qwen3-MoE's router and 3-D
    expert stacks one each (model/moe.py `MoE.pull`), its aux-loss-free bias (not trained) stays
    whole: every trained parameter is a slice, in the model's parameter order."""
    from mspretrain.model.decoder import state_numpy
    from mspretrain.step.zero3 import gathered, shard_model, sharded_names

    world_of(1, 2)
    whole = {k: v.copy() for k, v in state_numpy(_tiny(**family)).items()}
    model = _tiny(**family)
    names = [p.name for p in model.trainable_params()]
    shard_model(model, sharded_names(model, names, 2), 2, 1, "cpu")
    assert [n for n, _, _ in gathered(model)] == names == [p.name for p in model.trainable_params()]
    small = [n for n in names if "bias" in n or "q_norm" in n or "k_norm" in n]
    assert len(small) == (2 if "qkv_bias" in family else 4)
    for p in model.trainable_params():
        a, b = slice_bounds(whole[p.name].size, 2, 1)
        assert p.shape == (b - a,) and np.array_equal(p.asnumpy(), whole[p.name].reshape(-1)[a:b]), p.name
    wqkv = model.layers[0].attn.wqkv
    assert (wqkv.bias_gather is not None) == ("qkv_bias" in family)
    if "num_experts" in family:
        assert {"layers.0.mlp.router.weight", "layers.0.mlp.w13.weight", "layers.0.mlp.w2.weight"} <= set(names)
        assert [g.shape for n, g, _ in gathered(model) if n == "layers.0.mlp.w13.weight"] == [(4, 64, 64)]
        bias = model.layers[0].mlp.expert_bias  # model state outside the gradient: whole on every rank
        assert bias.shape == (4,) and bias.name not in names


@pytest.mark.parametrize("device", ["cpu", "ascend"])
def test_the_replica_hash_reads_one_gathered_weight_at_a_time(world_of, tiny_cfg, device):
    """The end-of-run hash gathered every weight whole at once (`full_state`). It now
    reads them one at a time (`one_at_a_time`: one collective, then the next), with the same bytes
    in the same order as `full_state`, so the digest is the one the whole model gives. Rank 0 of 2,
    the collectives replaced by loopbacks (the peer contributes zeros), in both forms."""
    import hashlib

    from mspretrain.step.zero3 import full_state, gathered, one_at_a_time, shard_model

    world_of(0, 2)
    model = _tiny()
    names = [p.name for p in model.trainable_params()]
    shard_model(model, names, 2, 0, device)
    for _, g, _ in gathered(model):  # the whole-model reading's loopbacks, as the digest's below
        if device == "cpu":
            g.all_reduce = lambda x: x
        else:
            g.all_gather = lambda x: ops.concat([x, ops.zeros_like(x)])
    calls = []

    def loopback(buf):
        calls.append(buf.shape)
        return buf if device == "cpu" else ops.concat([buf, ops.zeros_like(buf)])

    whole = full_state(model, jit=False)()
    items = one_at_a_time(model, 2, 0, device, jit=False, collective=loopback)()
    first = next(items)
    assert len(calls) == (1 if first[0] in set(names) else 0)  # lazy: one parameter gathered, not all
    got = dict([first, *items])
    assert list(got) == sorted(whole) and len(calls) == len(names)
    for name in whole:
        assert got[name].dtype == whole[name].dtype and np.array_equal(got[name], whole[name]), name
    digest = lambda pairs: hashlib.sha256(b"".join(n.encode() + a.tobytes() for n, a in pairs)).hexdigest()
    assert digest(got.items()) == digest(sorted(whole.items()))


@pytest.mark.parametrize("family", [
    {**MOE_FAMILY, "mlp_only_layers": (1,), "capacity_factor": 1.0},  # a dense block after the MoE one; the capacity path
    {"family": "qwen2_moe", "qkv_bias": True, "num_experts": 4, "experts_per_token": 2, "moe_ffn_dim": 32,
     "shared_expert_ffn_dim": 32}])  # the shared expert's three weights gathered too
def test_the_sharded_moe_forward_is_the_whole_models(world_of, family):
    """ZeRO-3's MoE path at world 1, the gathers' AllReduce a loopback (the slice is the whole
    weight): MoE.pull's weights (router, stacks, a shared expert's), the sharded block's and the
    decoder's routing stats give the whole model's logits and per-layer stats, bit for bit (pynative)."""
    import mindspore as ms

    from mspretrain.step.zero3 import gathered, shard_model

    world_of(0, 1)
    whole, model = _tiny(**family), _tiny(**family)
    shard_model(model, [p.name for p in model.trainable_params()], 1, 0, "cpu")
    for _, g, _ in gathered(model):
        g.all_reduce = lambda x: x
    assert any(n.endswith("mlp.w13.weight") for n, _, _ in gathered(model))
    tokens = ms.Tensor(np.random.default_rng(0).integers(0, 96, (2, 12)).astype(np.int32))
    (a, per_a), (b, per_b) = whole(tokens, None, None, True, True), model(tokens, None, None, True, True)
    assert np.array_equal(a.asnumpy(), b.asnumpy()) and np.array_equal(per_a.asnumpy(), per_b.asnumpy())
    assert per_b.shape[0] == (1 if "mlp_only_layers" in family else 2)  # one stats row per MoE layer


def test_shard_parameters_refuses_what_it_cannot_cut(world_of):
    from mspretrain.step.zero3 import sharded_names

    model = _tiny()
    with pytest.raises(UserError, match="fewer than world"):  # a 64-element norm over 9 ranks: an empty slice
        sharded_names(model, [p.name for p in model.trainable_params()], 9)


def test_shard_parameters_is_a_no_op_on_one_process(tiny_cfg):
    from mspretrain.step.step import TrainStep

    model = _tiny()
    shapes = [p.shape for p in model.trainable_params()]
    step = TrainStep(model, tiny_cfg.optim, global_tokens=64, shard_params=True, jit=False)
    assert not step.zero3 and [p.shape for p in model.trainable_params()] == shapes


@pytest.mark.parametrize("dtype,param_dtype,accumulation,recompute", [
    ("fp32", "fp32", 1, False), ("fp32", "fp32", 2, True), ("fp16", "compute", 2, False)])
def test_plan_counts_the_buffers_a_zero3_rank_allocates(tiny_cfg, world_of, dtype, param_dtype, accumulation, recompute):
    """`plan` with optim.shard_parameters at 2 devices: rank 0's weights, masters, moments and
    buffers are what its TrainStep allocates; the gathered weights are every trained weight whole,
    or with recompute two units' (the prefetch gathers the next layer, or the head, while a layer
    computes): the largest layer's plus the larger of it and the lm_head."""
    from dataclasses import replace

    from mspretrain.config.schema import resolve_model
    from mspretrain.model.decoder import Decoder, half_eligible
    from mspretrain.preflight.plan import format_plan, make_plan
    from mspretrain.step.step import TrainStep

    world_of(0, 2)
    model_cfg = resolve_model(tiny_cfg.model, vocab_size=512)
    gb = tiny_cfg.train.global_batch
    cfg = replace(tiny_cfg, model=model_cfg, precision=replace(tiny_cfg.precision, dtype=dtype, param_dtype=param_dtype),
                  optim=replace(tiny_cfg.optim, shard_parameters=True),
                  train=replace(tiny_cfg.train, micro_batch=gb // 2 // accumulation, recompute=recompute))
    model = Decoder(model_cfg, dtype=dtype, seed=0)
    whole = {p.name: int(np.prod(p.shape)) * (2 if p.name in half_eligible(model) and param_dtype == "compute" else 4)
             for p in model.trainable_params()}
    half = half_eligible(model) if param_dtype == "compute" else []
    step = TrainStep(model, cfg.optim, global_tokens=gb * cfg.data.seq_len, world=2, rank=0, half_params=half,
                     accumulation=accumulation, shard_params=True, jit=False)
    assert step.zero3
    plan = make_plan(cfg, devices=2, tokens=10**6, data_dir=None, tokens_per_s_per_device=None)
    have = step.buffer_bytes()
    for kind in ("weights", "master_weights", "adam_moments", "gradients"):
        assert plan["memory_bytes"][kind] == have[kind], kind
    assert have["weights"] < 0.51 * sum(whole.values())  # about half of the whole model on each of 2 ranks
    layer0 = sum(b for n, b in whole.items() if n.startswith("layers.0."))
    want = layer0 + max(layer0, whole["lm_head.weight"]) if recompute else sum(whole.values())
    assert plan["memory_bytes"]["gathered_weights"] == want
    # the peak holds the gathered weights beside the micro-batch's activations and gradients (issue
    # 54.32: a peak computed without them passed every assertion above)
    mem = plan["memory_bytes"]
    persistent = sum(mem[k] for k in ("weights", "half_weights", "master_weights", "gradients", "adam_moments"))
    assert mem["peak"] >= persistent + mem["activations"] + mem["micro_gradients"] + want + mem["cpu_backend"]
    # on Ascend the largest collective is the largest whole weight (the lm_head), not 0
    npu = make_plan(replace(cfg, device=replace(cfg.device, target="ascend")), devices=2, tokens=10**6, data_dir=None,
                    tokens_per_s_per_device=None)
    assert npu["hccl"]["largest_collective_bytes"] == max(whole.values()) == whole["lm_head.weight"]
    assert plan["shard_parameters"] and "ZeRO-3" in format_plan(plan)
    # a gather and a reduce-scatter per weight and micro-batch, each the whole weight in its storage dtype
    assert plan["collectives_per_step"] == step.collectives(accumulation) == {
        "calls": 2 * 15 * accumulation, "bytes": 2 * accumulation * sum(whole.values())}


# ---- the prefetch, read from the compiled graph (tests/step/zero3_graph_probe.py: rank 0 of 2 on the Ascend path)

PROBE = Path(__file__).with_name("zero3_graph_probe.py")
PER_BLOCK = 6  # gathers of a decoder block: attn_norm, wqkv, wo, mlp_norm, w13, w2 (model/block.py Block.pull)


@pytest.fixture(scope="module")
def prefetch_graphs(tmp_path_factory) -> dict:
    """The probe's three compilations (prefetch, no-prefetch, recompute) of the 2-layer model, in
    one subprocess (it replaces the world in comm_ops and sets the IR dump switches)."""
    import json
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("prefetch-ir")
    proc = subprocess.run([sys.executable, str(PROBE), str(out)], cwd=out, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def _units(graph: dict) -> dict[str, list[dict]]:
    """The forward's gathers by unit, in the chain's order: embedding, block 0, block 1, head (norm, lm_head)."""
    g = graph["gathers"]
    return {"embed": g[:1], "block0": g[1:1 + PER_BLOCK], "block1": g[1 + PER_BLOCK:1 + 2 * PER_BLOCK],
            "head": g[1 + 2 * PER_BLOCK:3 + 2 * PER_BLOCK]}


@pytest.mark.slow  # three compilations in a subprocess: about a minute on 2 busy cores
def test_prefetch_overlaps_the_next_blocks_gathers_with_compute_and_bounds_them(prefetch_graphs):
    """From the compiled graph's dependencies: block 1's gathers wait for none of block 0's matmuls
    (they run while block 0 computes), the head's gathers (the unit two after block 0) wait for
    every matmul of block 0 and for none of block 1 (at most two units' gathered weights at once);
    every gather waits for the one before it and the reduce-scatters run in one chain, so all the
    collectives are in one order; no matmul waits for a reduce-scatter. Without the prefetch (the chain from the block's input) block 1's
    gathers would wait for block 0's matmuls: what the first assertion tells apart."""
    graph = prefetch_graphs["prefetch"]
    units = _units(graph)
    assert len(graph["gathers"]) == 3 + 2 * PER_BLOCK and graph["scatters"] == len(graph["gathers"])
    assert all(g["after_gathers"] == list(range(i)) for i, g in enumerate(graph["gathers"]))  # one chain
    assert graph["scatters_chained"] and graph["total_order"]
    for unit in ("embed", "block0", "block1"):
        assert all(not g["after_matmuls"] for g in units[unit]), unit
    # block 0's matmuls: those whose latest gather is one of block 0's
    block0 = {int(m) for m, after in graph["matmuls"].items() if after and 1 <= max(after) <= PER_BLOCK}
    assert len(block0) == 8  # wqkv's two parts, q.k, p.v, wo, w13's two parts, w2
    for g in units["head"]:
        assert set(g["after_matmuls"]) == block0
    assert graph["matmuls_after_scatters"] == 0  # no compute waits for a reduce-scatter (plan's time model)

    off = _units(prefetch_graphs["no-prefetch"])
    assert all(len(g["after_matmuls"]) == 8 for g in off["block1"])  # the chain from the block's input waits
    assert prefetch_graphs["no-prefetch"]["matmuls_after_scatters"] > 0  # and the backward waits for reduce-scatters

    rec = prefetch_graphs["recompute"]
    assert len(rec["gathers"]) == 3 + 4 * PER_BLOCK  # layer recompute gathers each block's weights again
    assert all(not g["after_matmuls"] for g in _units(rec)["block1"])  # and the forward still prefetches
    assert rec["scatters_chained"]


@pytest.mark.slow  # shares the probe's compilations above
def test_reduce_scatters_can_run_during_the_backward(prefetch_graphs):
    """In a readiness order of the compiled graph's dependencies (what ms_backend's
    default exec_order "bfs" follows; the backend's own order needs an NPU), 12 of the 15
    reduce-scatters of the 2-layer model come before the last backward matmul, in every variant:
    only the three whose gradients the last backward matmuls produce (the embedding's, block 0's
    attn_norm and wqkv) wait for it; the chain that orders them (each after the next one's) costs
    nothing here. Reductions issued after the whole backward would put all 15 after it. (The IR's
    own listing, a depth-first order from the outputs, puts 0 of 15 before it: it is not the
    kernel order; whether HCCL then overlaps them with the compute only a 910B shows.)"""
    for variant, graph in prefetch_graphs.items():
        assert graph["scatters_before_last_matmul"] == graph["scatters"] - 3 == 12, variant


@pytest.mark.slow  # shares the probe's compilations above
def test_no_ordering_token_is_a_constant_of_a_whole_weight(prefetch_graphs):
    """The bprop of a gather returns, as its anchor's gradient, zeros that wait for its
    reduce-scatter; anchored on the previous whole gathered weight (or a block's input), the
    frontend folded each into a constant of that full shape (three a layer, ~18 GiB for Qwen3-14B
    in bf16, not in `plan`). Anchored on one element (model/layers.py `one`), the compiled forward
    and backward hold no constant larger than one element but the attention's causal mask (T, T)
    and the positions (T,) (T = 16 here); in every variant (the no-prefetch one anchors on x)."""
    for variant, graph in prefetch_graphs.items():
        others = [c for c in graph["constants"] if c[0] not in ([16, 16], [16])]
        assert not others, f"{variant}: constants {others}"


@pytest.mark.parametrize("device, recompute, prefetch", [("ascend", False, True), ("ascend", True, True),
                                                          ("cpu", False, True), ("cpu", True, False)])
def test_prefetch_everywhere_but_the_cpu_with_recompute(world_of, device, recompute, prefetch):
    """On the CPU the runtime launches collectives as they become ready, and with layer recompute a
    block's re-gathers would be unordered against the next block's reduce-scatters (measured in the
    graph: 63 unordered pairs in the 2-layer model), so the chain starts from the block's input
    there, as before the prefetch (2 unordered pairs, step/zero3.py)."""
    from mspretrain.step.zero3 import shard_model

    world_of(0, 2)
    model = _tiny()
    if recompute:
        for layer in model.layers:
            layer.recompute()
    shard_model(model, [p.name for p in model.trainable_params()], 2, 0, device)
    assert model.sharded and [layer.prefetch for layer in model.layers] == [prefetch] * 2


# ---- 2 msrun ranks against one process

ZERO3 = ("optim.shard_parameters=true",)


KILLED_AT = 6  # the save held open (MSPRETRAIN_FAULT_SAVE_DELAY) while the job is killed


@pytest.fixture(scope="module")
def zero3_killed(tmp_path_factory, tiny_data) -> dict[str, Path]:
    """ZeRO-3 on 2 msrun workers, 2 micro-batches each (a gather per weight in every forward, a
    reduce-scatter per weight in every backward), the reference run's config otherwise: started,
    SIGKILLed (the whole job: msrun and both workers) while rank 0 is writing the step-6 checkpoint
    (its per-rank weight file in `step_000006.tmp/`, rank 1's files staged), then relaunched at the
    same layout, which resumes from step 5 and runs to the end. `killed`: a copy of the run dir as
    the kill left it; `run`: the relaunched run. Read-only."""
    import time

    from tests.helpers.killed import start_launch as _start_launch
    from tests.helpers.runs import kill_tree as _kill_tree

    tmp = tmp_path_factory.mktemp("zero3")
    run = tmp / "zero3"
    args = (*REFERENCE_ARGS, NO_EVAL, *ZERO3, "train.micro_batch=1")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MSPRETRAIN_FAULT_SAVE_DELAY", f"600@{KILLED_AT}")
        proc = _start_launch(tmp, tiny_data, run, *args)
    try:
        held = run / "checkpoints" / f"step_{KILLED_AT:06d}.tmp"
        deadline = time.time() + 600
        while not (held / "model-00000-of-00002.safetensors").is_file():
            assert proc.poll() is None and time.time() < deadline, proc.communicate()
            time.sleep(0.2)
        time.sleep(1)  # the other rank's staged files too, most likely: either way the save is unfinished
    finally:
        _kill_tree(proc)  # SIGKILL, msrun and every worker
    killed = tmp / "killed"
    shutil.copytree(run, killed)
    _msrun(tmp, tiny_data, run, *ZERO3, "train.micro_batch=1")
    assert f"resumed from step_{KILLED_AT - 1:06d}" in (run / "train.log").read_text()
    return {"killed": killed, "run": run}


@pytest.fixture(scope="module")
def zero3_run(zero3_killed) -> Path:
    """The ZeRO-3 run of `zero3_killed`, killed and resumed at the same layout: it must equal the
    unbroken one-process run at every step. Read-only."""
    return zero3_killed["run"]


@pytest.mark.slow
@pytest.mark.msrun
@pytest.mark.skipif(MSRUN is None, reason="msrun not installed with MindSpore")
def test_sharded_parameters_match_one_process_and_resume_at_world_1(tmp_path, tiny_data, reference_run, zero3_run):
    """Killed during a save and resumed at the same layout, the run has the unbroken one-process
    run's losses, grad norms, final model and optimizer files and identical (gathered) replicas;
    every parameter's weights and state are split into the two ranks' slices, each rank's in files
    of its own; one process resumes the ZeRO-3 step-5 checkpoint and keeps the unbroken run's numbers."""
    from safetensors.numpy import load_file

    two = zero3_run
    assert "weights, optimizer state and gradients sharded over 2 ranks" in (two / "train.log").read_text()
    final = _step_dir(two, FINAL)
    shards = sorted(final.glob("optimizer-*.safetensors"))
    keys = [set(load_file(str(s))) for s in shards]
    weights = [set(load_file(str(final / f"model-0000{r}-of-00002.safetensors"))) for r in (0, 1)]
    assert len(shards) == 2 and not (final / "model.safetensors").exists()
    for name in ("embed.weight", "layers.0.attn_norm.weight", "lm_head.weight"):
        n = {"embed.weight": 32768, "layers.0.attn_norm.weight": 64, "lm_head.weight": 32768}[name]
        assert f"exp_avg.{name}@0:{n // 2}" in keys[0] and f"exp_avg.{name}@{n // 2}:{n}" in keys[1]
        assert f"{name}@0:{n // 2}" in weights[0] and f"{name}@{n // 2}:{n}" in weights[1]
    assert not {k for k in keys[0] & keys[1] if k != "opt_step"} and not weights[0] & weights[1]
    resumed = _assert_two_ranks_equal_one_process(two, reference_run, tiny_data, tmp_path)
    for step in range(6, FINAL + 1):
        assert_same_checkpoint(_step_dir(resumed, step), _step_dir(reference_run, step), 1e-5)


@pytest.mark.slow
@pytest.mark.msrun
@pytest.mark.skipif(MSRUN is None, reason="msrun not installed with MindSpore")
@pytest.mark.parametrize("source, layout", [("zero3", ("optim.shard_gradients=true",)),
                                            ("one", (*ZERO3, "train.recompute=true"))])
def test_resume_across_layouts(tmp_path, tiny_data, reference_run, zero3_killed, source, layout):
    """The ZeRO-3 job as SIGKILL left it (2 ranks, step 5 the newest finished save, step 6's
    unfinished) resumed by ZeRO-2 on 2 ranks, and one process's step 5 resumed by ZeRO-3 on 2 ranks
    without accumulation (the fused step) and with layer recompute (the backward gathers each
    layer's weights again): the unbroken one-process run's losses, grad norms and checkpoints to
    the end."""
    if source == "zero3":
        run = tmp_path / "from-zero3"
        shutil.copytree(zero3_killed["killed"], run)
    else:
        run = copy_run_at(reference_run, tmp_path / "from-one", 5)
    _msrun(tmp_path, tiny_data, run, *layout)
    assert "resumed from step_000005" in (run / "train.log").read_text()
    assert not list((run / "checkpoints").glob("*.tmp"))  # the killed save's staging dirs were cleaned
    one, got = _metrics(reference_run), _metrics(run)
    one_gn, got_gn = _grad_norms(reference_run), _grad_norms(run)
    assert sorted(got) == STEPS
    for step in range(6, FINAL + 1):
        assert abs(got[step] - one[step]) <= 1e-5, (step, one[step], got[step])
        assert got_gn[step] == pytest.approx(one_gn[step], rel=1e-5)
        assert_same_checkpoint(_step_dir(run, step), _step_dir(reference_run, step), 1e-5)




@pytest.mark.slow
@pytest.mark.msrun
@pytest.mark.skipif(MSRUN is None, reason="msrun not installed with MindSpore")
def test_sharded_parameters_with_fp16_matrices_and_fp32_master_slices(tmp_path, tiny_data, one_fp16):
    """fp16 compute, fp16 matrices (gathered and reduce-scattered in fp16) with fp32 master slices,
    ZeRO-3 on 2 workers against the same config on one process (test_zero2's fp16 tolerances:
    the ranks sum in another order and fp16 weights may round the other way)."""
    from safetensors.numpy import load_file

    two = tmp_path / "zero3-fp16"
    _msrun(tmp_path, tiny_data, two, *FP16_MASTERS, *ZERO3)
    _fp16_run_equals_one_process(two, one_fp16)
    keys = set().union(*(load_file(str(s)).keys() for s in _step_dir(two, FINAL).glob("optimizer-*.safetensors")))
    assert "master.layers.0.mlp.w13.weight@0:12288" in keys and "master.layers.0.mlp.w13.weight@12288:24576" in keys
    assert not any(k.startswith("master.lm_head") for k in keys)  # an fp32 slice is its own master


# ---- Qwen2's q/k/v bias and Qwen3's QK-norm: 2 msrun ranks against one process (tests/step/zero3_worker.py)

WORKER = Path(__file__).with_name("zero3_worker.py")


@pytest.fixture(scope="module")
def families_two(tmp_path_factory) -> Path:
    """The families' ZeRO-3 (MoE: ZeRO-2) steps in one msrun job of 2 workers (one start-up for all)."""
    from mspretrain.preflight.collectives_worker import run_workers

    out = tmp_path_factory.mktemp("zero3-families")
    run_workers(2, out, [str(out)], script=str(WORKER), timeout_s=600, what="the ZeRO-2/3 family steps")
    return out


@pytest.mark.slow
@pytest.mark.msrun
@pytest.mark.skipif(MSRUN is None, reason="msrun not installed with MindSpore")
@pytest.mark.parametrize("family", ["qwen2", "qwen3", "qwen3_moe", "qwen3_moe_ep"])
def test_qwen_bias_and_qk_norm_under_zero3_match_one_process(families_two, family):
    """fp32, 3 steps at lr 1e-2: both ranks' losses and grad norms, and the gathered weights (the
    bias and the QK-norm weights included, which moved from their zero / one initial values), equal
    one process's within 1e-5 (the one process runs the ranks' halves of each batch as two
    micro-batches: tests/step/zero3_worker.py says why). The one-layer Qwen3-MoE runs ZeRO-2 with
    its expert stacks split over the ranks, the balance loss on and the aux-loss-free routing bias
    moved by the world's expert counts (the bias, never trained, moved off zero all the same); and
    at ep 2 (each rank 2 of the 4 experts) with ZeRO-2, without the bias (refused with ep)."""
    import json

    from tests.step.zero3_worker import run_steps

    one = run_steps(family, 1, 0)
    ranks = [json.loads((families_two / f"rank_{r}.json").read_text())[family] for r in (0, 1)]
    for got in ranks:
        for a, b in zip(got["losses"], one["losses"]):
            assert abs(a - b) <= 1e-5, (got["losses"], one["losses"])
        assert got["grad_norms"] == pytest.approx(one["grad_norms"], rel=1e-5)
        if family == "qwen3_moe":  # the 3-D expert stacks and the router as slices of ZeRO-2's split parameters
            assert {"layers.0.mlp.w13.weight", "layers.0.mlp.w2.weight"} <= set(got["split"]), got["split"]
        if family == "qwen3_moe_ep":  # each rank's experts whole (LOCAL), the rest split as without ep
            assert "layers.0.mlp.w13.weight" not in got["split"] and "embed.weight" in got["split"], got["split"]
    with np.load(families_two / f"{family}.npz") as z:
        two = {k: z[k] for k in z.files}
    assert sorted(two) == sorted(one["weights"])
    small = [k for k in two if "bias" in k or "q_norm" in k or "k_norm" in k]
    assert small
    for k in small:  # trained away from their initial values (zeros, ones)
        assert np.abs(one["weights"][k] - (0.0 if "bias" in k else 1.0)).max() > 1e-3, k
    for k in sorted(two):
        if k.endswith("wqkv.bias"):  # the q and v rows within 1e-5; the k rows, ill-conditioned, within 1e-3
            q, kv = 4 * 16, 2 * 16  # n_heads x head_dim, n_kv_heads x head_dim (tests/step/zero3_worker.py)
            # Measured in one process against itself, one micro-batch against two of the same rows:
            # 1.1e-4 relative on layer 0's k bias, 1.2e-6 on its q and v bias, 1.7e-6 on the weight.
            # The k bias's gradient nearly cancels (a shift common to a query's scores is lost in
            # the softmax; RoPE leaves a small position-dependent remainder), so Adam's normalised
            # step turns summation-order rounding into visible differences.
            for rows, tol in (((0, q), 1e-5), ((q, q + kv), 1e-3), ((q + kv, q + 2 * kv), 1e-5)):
                assert_close_rel(two[k][slice(*rows)], one["weights"][k][slice(*rows)], tol, f"{family} {k}{rows}")
        else:
            assert_close_rel(two[k], one["weights"][k], 1e-5, f"{family} {k}")
