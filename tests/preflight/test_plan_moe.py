"""`plan` for mixtures of experts (issue 52.7): the expert stacks per device under expert parallel
(parallel.ep), checked against the buffers a real expert-parallel TrainStep allocates; the routed
experts' activations and the dispatch by hand; the EP rows of the layout table; Qwen3-30B-A3B on
8 and 16 x 910B at seq 4096, and the shipped recipes' layouts are the ones `plan` recommends.

The EP steps are built in this one process as tests/step/collective_probe.py builds each rank of a
world (MindSpore's `get_rank` / `get_group_size` replaced where the collective primitives read
them at construction, no `init()`): nothing is compiled, the step's buffers and collectives are
counted, and one test runs its gradient reduction eagerly with the world's AllReduce a loopback."""
from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest

from mspretrain.config import schema as cfgmod
from mspretrain.model.presets import param_shapes, preset

GB = 2**30
RECIPE = Path(__file__).resolve().parents[2] / "configs" / "qwen3-30b-a3b-zh-continue-910b.toml"
RECIPE8 = RECIPE.with_name("qwen3-30b-a3b-zh-continue-8x910b.toml")
# the 910B shape of docs/plan.md's big presets (test_plan_layouts.py BIG), global batch set per test
SHAPE = ["data.seq_len=4096", "train.micro_batch=1", "precision.dtype=bf16", "precision.param_dtype=compute",
         "precision.loss_scale=none", "device.target=ascend", "train.max_steps=1000"]
# one MoE layer, 4 experts of width 32, top-2 (the EP cases of tests/step/collective_probe.py)
TINY_MOE = {"family": "qwen3_moe", "qk_norm": True, "head_dim": 16, "num_experts": 4, "experts_per_token": 2,
            "moe_ffn_dim": 32, "n_layers": 1}


def _qwen3_moe_plan(devices: int, *overrides: str) -> dict:
    from mspretrain.preflight.plan import make_plan

    cfg = replace(cfgmod.load(None, [*SHAPE, f"train.global_batch={devices}", *overrides]), model=preset("qwen3-30b-a3b"))
    return make_plan(cfg, devices=devices, tokens=None, data_dir=None, tokens_per_s_per_device=None)


def _ep_step(monkeypatch, tiny_cfg, *, world: int, ep: int, zero: int, accumulation: int, moe: dict | None = None,
             device: str = "ascend", moments: str = "fp32", **kw):
    """Rank 0's EPTrainStep of a tiny bf16 MoE (bf16 matrices, fp32 masters; fp16 on CPU) on `world` ranks;
    `moe` overrides TINY_MOE, `kw` goes to the step."""
    from mindspore.ops.operations import comm_ops

    from mspretrain.model.decoder import Decoder, half_eligible
    from mspretrain.parallel.plan import ParallelPlan
    from mspretrain.step.ep import EPTrainStep, expert_mesh

    plan = ParallelPlan(world=world, rank=0, ep=ep, zero=zero)
    mesh = expert_mesh(plan, device, create=False)
    sizes = {g.name: g.size for g in (mesh.ep, mesh.edp) if g.name}
    monkeypatch.setattr(comm_ops, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(comm_ops, "get_group_size", lambda group=None: sizes.get(group, world))
    m = cfgmod.resolve_model(replace(tiny_cfg.model, **{**TINY_MOE, **(moe or {})}), 512)
    model = Decoder(m, dtype="bf16" if device == "ascend" else "fp16", attention="math", device=device, seed=0)  # no bf16 on CPU
    half = half_eligible(model)
    model.apply_ep(mesh.ep)
    gb = tiny_cfg.train.global_batch
    optim = replace(tiny_cfg.optim, moment_dtype=moments, shard_optimizer=zero >= 1, shard_gradients=zero >= 2)
    step = EPTrainStep(model, optim, mesh=mesh, plan=plan, global_tokens=gb * tiny_cfg.data.seq_len,
                       half_params=half, accumulation=accumulation, bucket_mb=0.01, device=device, **kw)
    cfg = replace(tiny_cfg, model=m, parallel=replace(tiny_cfg.parallel, ep=ep),
                  precision=replace(tiny_cfg.precision, dtype="bf16", param_dtype="compute"),
                  optim=replace(optim, bucket_mb=0.01),
                  train=replace(tiny_cfg.train, micro_batch=gb // world // accumulation),
                  device=replace(tiny_cfg.device, target="ascend"))
    return step, cfg, m


@pytest.mark.parametrize("world,ep,zero,accumulation,moments", [(2, 2, 0, 2, "fp32"), (4, 2, 1, 1, "fp32"), (4, 4, 1, 2, "bf16"),
                                                                  (4, 2, 2, 2, "bf16")])
def test_ep_plan_bytes_are_the_buffers_the_ep_step_allocates(monkeypatch, tiny_cfg, world, ep, zero, accumulation, moments):
    """Weights, fp32 masters, Adam moments and accumulation buffers of rank 0 (the heaviest: every
    rank holds E/ep experts), as memory_model counts them, equal the EP step's own (ep x edp, ZeRO
    0, 1 or 2: the other parameters' state (and with ZeRO-2 their accumulation buffers) over the
    world, the experts' kept whole by each rank); with optim.moment_dtype = "bf16" the moments are
    the step's bf16 Parameters (2 + 2 bytes an element on an NPU)."""
    import mindspore as ms

    from mspretrain.preflight.costs import memory_model

    step, cfg, m = _ep_step(monkeypatch, tiny_cfg, world=world, ep=ep, zero=zero, accumulation=accumulation, moments=moments)
    mem, layout = memory_model(m, cfg, devices=world, micro=1, accum=accumulation, zero=zero >= 1, shard_grads=zero >= 2,
                               recompute=False, flash=False, target="ascend")
    have = step.buffer_bytes()
    assert {p.dtype for p in step.exp_avg} == {ms.bfloat16 if moments == "bf16" else ms.float32}
    assert step.sharded == layout.sharded == (zero >= 1) and step.shard_grads == layout.shard_grads == (zero >= 2)
    for kind in ("weights", "master_weights", "adam_moments", "gradients"):
        assert mem[kind] == have[kind], kind
    assert (mem["gradients"] > 0) == (accumulation > 1)
    # this rank's expert stacks are E/ep of the whole ones: the layout's sizes are the step's
    assert list(layout.sizes) == list(step.sizes)
    whole = dict(param_shapes(m))
    local = dict(zip(step.names, step.sizes))
    assert step.whole_shapes and all(math.prod(whole[n]) == math.prod(s) == ep * local[n] for n, s in step.whole_shapes.items())


@pytest.mark.parametrize("world,ep", [(2, 2), (4, 2)])
def test_the_expert_bucket_is_planned_as_the_step_makes_it(monkeypatch, tiny_cfg, world, ep):
    """The expert stacks' gradient bucket (a flat copy and the edp group's sum of it) is in plan's
    collective buffers exactly when the step makes it: with edp ranks to sum over (EP2 x EDP2),
    not at ep = world, where the step takes each expert gradient as it is (step/update.py kind 3).
    Experts wide enough that their bucket would be the largest collective buffer."""
    from mindspore import float16

    from mspretrain.preflight.costs import memory_model

    step, cfg, m = _ep_step(monkeypatch, tiny_cfg, world=world, ep=ep, zero=0, accumulation=1, moe={"moe_ffn_dim": 256})
    mem, _ = memory_model(m, cfg, devices=world, micro=1, accum=1, zero=False, shard_grads=False,
                          recompute=False, flash=False, target="ascend")
    expert = sum(n for name, n in zip(step.names, step.sizes) if name in step.whole_shapes)
    assert step.expert_bucket_bytes() == (0 if world == ep else 2 * 4 * expert)
    largest = max(sum(sizes) * (2 if wire == float16 else 4) for _, sizes, wire in step._ar if sizes)
    assert 4 * expert > 2 * largest  # the flat copy alone outweighs the world's largest bucket and its result
    assert mem["collective_buffers"] == max(2 * largest, step.expert_bucket_bytes())


def test_ep_world_leaves_the_expert_gradients_unrounded_on_an_fp16_wire(monkeypatch, tiny_cfg):
    """precision.allreduce_dtype=fp16 rounds what is sent; at ep = world the expert stacks' gradients
    are sent nowhere (one edp rank), so `_reduce` hands them on bit for bit, without a flat copy,
    while the world's buckets cross in fp16. Eager, the world's AllReduce a loopback (no init())."""
    import mindspore as ms
    import numpy as np

    from mspretrain.model.params import fp16_wire
    from mspretrain.step import update

    step, _, _ = _ep_step(monkeypatch, tiny_cfg, world=2, ep=2, zero=0, accumulation=1, allreduce_fp16=True, jit=False)
    assert step.edp_sum is None and step._ex[2] == ms.float16
    flats: list = []
    real_flat = update._flat
    monkeypatch.setattr(update, "_flat", lambda parts: flats.append(len(parts)) or real_flat(parts))
    step.allreduce = lambda x: x
    rng = np.random.default_rng(0)
    grads = [(1 + rng.random(p.shape, np.float32) * 1e-3).astype(np.float32) for p in step.params]
    out, _ = step._reduce([ms.Tensor(g) for g in grads])
    got = {step.names[i]: o.asnumpy() for i, o in zip(step._order, out)}
    for i, name in enumerate(step.names):
        if name in step.whole_shapes:
            assert got[name].dtype == np.float32 and np.array_equal(got[name], grads[i]), name
        elif fp16_wire(name):  # the world's buckets: rounded to fp16 on the wire
            assert np.array_equal(got[name], grads[i].astype(np.float16).astype(np.float32)), name
    assert len(flats) == sum(kind == 0 for kind, _ in step._schedule)  # the world's buckets only


@pytest.mark.parametrize("device", ["ascend", "cpu"])
def test_the_ep_steps_collectives_count_the_form_its_device_runs(monkeypatch, tiny_cfg, device):
    """EPTrainStep.collectives per MoE layer and micro-batch: Ascend runs the AllToAll form
    (AllToAllRows / AllToAllIds: each send buffer n*N rows), CPU the gather form as AllReduce sums
    (each buffer the group's n*N rows): forward rows + ids + outputs, backward outputs + rows, each
    n*N of one rank's N tokens; 5 calls. ep 2 = world (ZeRO 0): plus the norm's ep sum and the
    routing stats' world sum, the expert stacks out of the world's buckets and sent nowhere."""
    from mspretrain.model.expert_parallel import AllToAllIds, AllToAllRows, GatherIds, GatherRows, ScatterRows
    from mspretrain.step.step import TrainStep

    accumulation = 2
    step, _, m = _ep_step(monkeypatch, tiny_cfg, world=2, ep=2, zero=0, accumulation=accumulation, device=device)
    moe = step.model.layers[0].mlp
    kinds = (AllToAllRows, AllToAllIds, AllToAllRows) if device == "ascend" else (GatherRows, GatherIds, ScatterRows)
    assert tuple(type(c) for c in (moe.dispatch, moe.dispatch_ids, moe.combine)) == kinds and moe.all_to_all == (device == "ascend")
    n, N = 2, tiny_cfg.train.global_batch * tiny_cfg.data.seq_len // (2 * accumulation)
    D, K, E = m.dim, m.experts_per_token, m.num_experts
    rows, ids, out = n * N * (D + K) * 2, n * N * K * 4, n * N * D * 2  # bf16 (CPU: fp16) rows and outputs, fp32 ids
    base = TrainStep.collectives(step, accumulation)
    expert = sum(math.prod(s) // n for s in step.whole_shapes.values())
    stats = step._moe_rows.count * E * 4
    assert step.collectives(accumulation) == {
        "calls": base["calls"] + 1 + accumulation * (5 + 1),
        "bytes": base["bytes"] + 4 - 4 * expert + accumulation * (rows + ids + out + out + rows + stats)}


def test_routed_activations_and_the_dispatch_by_hand():
    """An MoE layer keeps, per assignment its rank's experts run (ep x tokens x K under the
    AllGather form: every rank sees the ep group's tokens), the permuted rows and the unpermuted
    output (2D) and the four F-wide SwiGLU tensors; plus the dispatch (packed rows and the combine's
    input) and the expert ids, and the router's fp32 probabilities."""
    from mspretrain.preflight.costs import activation_bytes, moe_mlp_activation_bytes

    m = cfgmod.resolve_model(replace(cfgmod.load(None).model, **TINY_MOE), 512)
    D, F, K, E, N, e = m.dim, 32, 2, 4, 64, 2
    assert moe_mlp_activation_bytes(m, N, e, 1) == e * N * K * (2 * D + 4 * F) + 8 * N * E
    assert moe_mlp_activation_bytes(m, N, e, 4) == (e * 4 * N * K * (2 * D + 4 * F) + e * 4 * N * (2 * D + K)
                                                    + 4 * 4 * N * K + 8 * N * E)
    dense = replace(m, family="qwen3", num_experts=0)
    # the MoE layer's MLP in place of the dense SwiGLU's 4f (same attention, norms, logits)
    diff = activation_bytes(m, N, 1, "bf16", False, ep=4) - activation_bytes(dense, N, 1, "bf16", False)
    assert diff == moe_mlp_activation_bytes(m, N, e, 4) - e * N * 4 * m.ffn_dim


def test_qwen3_30b_a3b_on_16_910b_recommends_ep16_zero2_within_52_gb():
    table = _qwen3_moe_plan(16)["layouts"]
    rows = {r["name"]: r for r in table["rows"]}
    best = rows[table["recommended"]]
    assert table["recommended"] == "EP16 ZeRO-2" and best["recompute"], table["recommended"]
    assert best["peak_bytes"] <= 52 * GB and not best["unmeasured"], best["peak_bytes"] / GB
    # every ep dividing the 128 experts and the 16 ranks, plain and with ZeRO-1 or ZeRO-2
    assert {f"EP{e} x EDP{16 // e}{z}" for e in (2, 4, 8) for z in ("", " ZeRO-1", " ZeRO-2")} <= set(rows)
    assert {"EP16", "EP16 ZeRO-1"} <= set(rows)
    # without accumulation ZeRO-2 holds what ZeRO-1 does; its reduce-scatter moves half an all-reduce's bytes
    assert best["peak_bytes"] == rows["EP16 ZeRO-1"]["peak_bytes"] and best["comm_s"] < rows["EP16 ZeRO-1"]["comm_s"]
    # expert state per device: 8 of 128 experts x 48 layers x 3 x 2048 x 768, fp32 moments and masters
    experts = 48 * 8 * 3 * 2048 * 768
    assert best["memory_bytes"]["adam_moments"] > 8 * experts and best["memory_bytes"]["master_weights"] > 4 * experts
    assert not rows["EP16"]["fits"]  # the other 1.5 B parameters' state replicated: 64 GB


def test_qwen3_30b_a3b_on_8_910b_fits_with_bf16_moments_and_the_chunked_loss():
    """With fp32 moments nothing fits 8 devices: 30.5 B parameters at 16 bytes of weights,
    gradients, fp32 masters and moments are 57 GB a device whatever the layout (EP8 x ZeRO-1 holds
    16 experts' whole state: its expert-data-parallel group has one rank), and plan recommends
    nothing. bf16 moments (2 + 2 bytes) and the chunked loss (one 512-token chunk's fp32 logits
    alive, not 4,096 tokens') bring ZeRO-3 under 52 GB; EP8 stays above (16 experts' state whole)."""
    plan = _qwen3_moe_plan(8)
    table = plan["layouts"]
    assert table["recommended"] is None and table["recommended_unmeasured"] is None
    # and the warning names the two options
    assert any("optim.moment_dtype=bf16" in w and "optim.loss_chunk_tokens=512" in w for w in plan["warnings"]), plan["warnings"]
    fitted = [r for r in table["rows"] if "skipped" not in r]
    assert min(r["peak_bytes"] for r in fitted) / GB > 58
    ep8 = next(r for r in fitted if r["name"] == "EP8 ZeRO-1")
    assert sum(ep8["memory_bytes"][k] for k in ("weights", "master_weights", "adam_moments")) / GB > 52
    assert 16 * plan["params"] / 8 / GB > 52

    small = _qwen3_moe_plan(8, "optim.moment_dtype=bf16", "optim.loss_chunk_tokens=512")["layouts"]
    rows = {r["name"]: r for r in small["rows"]}
    best = rows[small["recommended"]]
    assert small["recommended"] == "ZeRO-3" and best["recompute"] and best["peak_bytes"] <= 52 * GB, best["peak_bytes"] / GB
    z3 = next(r for r in fitted if r["name"] == "ZeRO-3")
    # what each feature took off: the moments' half, the logits of 4,096 - 512 tokens (x 8 bytes)
    moments = z3["memory_bytes"]["adam_moments"] - best["memory_bytes"]["adam_moments"]
    assert moments == best["memory_bytes"]["adam_moments"]
    logits = z3["memory_bytes"]["activations"] - best["memory_bytes"]["activations"]
    assert logits == 8 * (4096 - 512) * 151936 - 4 * 4096 * 2048
    assert min(r["peak_bytes"] for n, r in rows.items() if n.startswith("EP8")) > 52 * GB


def test_the_recipe_runs_plans_recommendation_on_16_910b():
    from mspretrain.preflight.layouts import layout_settings
    from mspretrain.preflight.plan import make_plan

    cfg = cfgmod.load(RECIPE)
    cfgmod.validate(cfg, budget=True)
    assert cfg.model == preset("qwen3-30b-a3b")
    plan = make_plan(cfg, devices=16, tokens=None, data_dir=None, tokens_per_s_per_device=None)
    table = plan["layouts"]
    best = next(r for r in table["rows"] if r["name"] == table["recommended"])
    want = dict(s.split("=") for s in layout_settings(best))
    assert want == {"parallel.ep": str(cfg.parallel.ep), "optim.shard_optimizer": "true", "optim.shard_gradients": "true",
                    "train.recompute": "true"}
    assert cfg.optim.shard_optimizer and cfg.optim.shard_gradients and cfg.train.recompute
    assert plan["memory_bytes"]["peak"] == best["peak_bytes"] <= 52 * GB
    assert plan["seq_len"] == 4096 and (plan["micro_batch"], plan["accumulation"]) == (1, 1)


def test_the_8_device_recipe_runs_plans_recommendation_within_52_gb():
    from mspretrain.preflight.layouts import layout_settings
    from mspretrain.preflight.plan import format_plan, make_plan

    cfg = cfgmod.load(RECIPE8)
    cfgmod.validate(cfg, budget=True)
    assert cfg.model == preset("qwen3-30b-a3b") and cfg.parallel.ep == 1
    assert (cfg.optim.moment_dtype, cfg.optim.loss_chunk_tokens) == ("bf16", 512)
    plan = make_plan(cfg, devices=8, tokens=None, data_dir=None, tokens_per_s_per_device=None)
    table = plan["layouts"]
    best = next(r for r in table["rows"] if r["name"] == table["recommended"])
    assert set(layout_settings(best)) == {"optim.shard_optimizer=true", "optim.shard_gradients=true",
                                          "optim.shard_parameters=true", "train.recompute=true"}
    assert cfg.optim.shard_parameters and cfg.train.recompute
    assert plan["memory_bytes"]["peak"] == best["peak_bytes"] <= 52 * GB
    assert plan["seq_len"] == 4096 and (plan["micro_batch"], plan["accumulation"]) == (1, 1)
    assert "Adam moments (bf16)" in format_plan(plan) and not any("WILL NOT FIT" in w for w in plan["warnings"])


def test_the_recipe_starts_with_its_experts_only(capsys):
    """Expert parallel is cut on the host (train/build.py `builds_on_host`, model/decoder.py
    `Decoder.apply_ep`): at start-up each of the 16 devices holds its 8 experts a layer and the 1.5 B
    other parameters whole, in fp32, 12.5 GB, not the whole model's 113.7 GB, and plan says so
    without a start-up warning."""
    from mspretrain.model.params import expert_parallel
    from mspretrain.preflight.plan import format_plan, make_plan

    cfg = cfgmod.load(RECIPE)
    plan = make_plan(cfg, devices=16, tokens=None, data_dir=None, tokens_per_s_per_device=None)
    shapes = param_shapes(cfg.model)
    local = sum(math.prod(s) // (16 if expert_parallel(n, cfg.model) else 1) for n, s in shapes)
    bb = plan["build_bytes"]
    assert bb["cut"] and bb["device"] == 4 * local and round(bb["device"] / GB, 1) == 12.5
    assert 4 * plan["params"] / GB > 113 and not any(w.startswith("start-up") for w in plan["warnings"])
    assert "start-up   12.49 GB of weights on each device" in format_plan(plan) and "its experts, the rest whole" in format_plan(plan)


def test_an_ep_run_plans_a_buffer_for_each_of_its_communicators():
    """HCCL buffers (parallel/hccl.py `communicators`) of expert-parallel runs on 16 x 910B: EP16
    is the world alone (its ep group is the world, its edp groups one rank), whose largest
    collective covers the dispatch; EP8 x EDP2 has the ep groups (the dispatch's AllGather of the
    packed rows, inside a server) and the edp groups (the experts' gradient bucket, across the two
    servers) too, each capped so that the three share the HBM room; `launch` passes them as
    ep=MB,edp=MB and `group_buffsize` reads them (step/ep.py's `create_group` options)."""
    from mspretrain.parallel.hccl import GROUP_BUFFSIZE_ENV, HCCL_ROOM_MB, group_buffsize, group_buffsize_env
    from mspretrain.preflight.plan import make_plan

    def comms(*overrides: str) -> dict:
        plan = make_plan(cfgmod.load(RECIPE, list(overrides)), devices=16, tokens=None, data_dir=None, tokens_per_s_per_device=None)
        return {c["name"]: c for c in plan["hccl"]["communicators"]}

    rows = 4096 * (2048 + 8) * 2  # a rank's packed rows (N, D + K) in bf16
    ep16 = comms()
    assert list(ep16) == ["world"] and ep16["world"]["largest_bytes"] >= 16 * rows
    ep8 = comms("parallel.ep=8")
    assert list(ep8) == ["world", "ep", "edp"]
    assert ep8["ep"]["largest_bytes"] == 8 * rows and ep8["ep"]["buffsize_mb"] == 200  # 1/8 of it a rank: HCCL's default
    assert ep8["edp"]["largest_bytes"] == 4 * 48 * 16 * 3 * 2048 * 768  # this rank's 16 experts a layer, fp32 on the wire
    assert ep8["world"]["largest_bytes"] == ep16["world"]["largest_bytes"]  # the other parameters' buckets
    assert sum(2 * c["buffsize_mb"] for c in ep8.values()) <= HCCL_ROOM_MB < 2 * 3 * 1024
    env = {GROUP_BUFFSIZE_ENV: group_buffsize_env(list(ep8.values()))}
    assert env[GROUP_BUFFSIZE_ENV] == "ep=200,edp=341" and (group_buffsize("ep", env), group_buffsize("edp", env)) == (200, 341)


def test_each_ep_group_is_created_with_its_own_planned_buffer(monkeypatch):
    """step/ep.py `expert_mesh` creates the ep and the edp group with the HCCL buffer `launch`
    planned for each (MSPRETRAIN_HCCL_GROUP_MB ep=MB,edp=MB), not the dp group's; on CPU none.
    No HCCL: `create_group` is recorded, not called."""
    import mindspore.communication as comm

    from mspretrain.parallel.hccl import GROUP_BUFFSIZE_ENV
    from mspretrain.parallel.plan import ParallelPlan
    from mspretrain.step.ep import expert_mesh

    made: dict = {}
    monkeypatch.setattr(comm, "create_group", lambda name, ranks, options=None: made.update({name: (ranks, options)}))
    monkeypatch.setenv(GROUP_BUFFSIZE_ENV, "ep=200,edp=341,dp=100")
    mesh = expert_mesh(ParallelPlan(world=16, rank=9, ep=8), "ascend")  # EP8 x EDP2: rank 9 is ep rank 1 of the second server
    assert (mesh.ep.name, mesh.edp.name) == ("ep_1", "edp_1")
    assert made["ep_1"][0] == list(range(8, 16)) and made["edp_1"][0] == [1, 9]
    assert made["ep_1"][1].hccl_config == {"hccl_buffer_size": 200}
    assert made["edp_1"][1].hccl_config == {"hccl_buffer_size": 341}
    made.clear()
    expert_mesh(ParallelPlan(world=16, rank=9, ep=8), "cpu")
    assert set(made) == {"ep_1", "edp_1"} and all(options is None for _, options in made.values())


def test_train_takes_the_preset(tmp_path, tiny_data, capsys):
    """`train --model qwen3-30b-a3b` runs the preset's shape: on this CPU its memory check refuses it
    in one line (the whole 30.5 B model), before any file is written."""
    from mspretrain.cli import main
    from mspretrain.commands.train import with_preset

    cfg = with_preset(cfgmod.load(None), "qwen3-30b-a3b")
    assert (cfg.model.num_experts, cfg.model.experts_per_token, cfg.model.moe_ffn_dim, cfg.model.family) == (128, 8, 768, "qwen3_moe")
    rc = main(["train", "--model", "qwen3-30b-a3b", "--data", str(tiny_data), "--run", str(tmp_path / "run"), "train.max_steps=1"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and "dim 2,048 x 48 layers" in err, err
    assert not (tmp_path / "run").exists()


def test_a_bad_moment_dtype_is_one_line(capsys):
    """optim.moment_dtype takes "fp32" or "bf16": anything else is refused in one line, exit 2."""
    from tests.helpers.cli import refused

    err = refused(capsys, "plan", "--config", RECIPE, "--devices", "8", "optim.moment_dtype=fp16")
    assert "optim.moment_dtype" in err and "is not one of fp32, bf16" in err, err
