"""Sharded gradients (ZeRO-2), bucketed collectives and their tables, against one process."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from mspretrain.parallel.layout import assign_owners_grouped, cap_elements, flat_buckets, rank_buckets
from tests.conftest import FP16_MASTERS, NO_EVAL, TINY, assert_same_checkpoint, snapshot
from tests.helpers.runs import (
    FINAL,
    MSRUN,
    assert_two_ranks_equal_one_process,
    fp16_run_equals_one_process,
    grad_norms,
    losses,
    msrun,
    replica_hashes,
    resume_on_one_process,
    step_dir,
)

# a 7B-shaped table: embedding, 32 x (norm, wqkv, wo, norm, w13, w2), norm, lm_head
SIZES_7B = [131072000] + [4096, 50331648, 16777216, 4096, 90177536, 45088768] * 32 + [4096, 131072000]
KEYS_7B = ["fp32"] + ["fp32", "half", "half", "fp32", "half", "half"] * 32 + ["fp32", "fp32"]


def test_flat_buckets_cover_every_parameter_once_in_readiness_order_within_the_cap():
    sizes = [10, 300, 5, 5, 200, 1000, 7]
    keys = ["a", "a", "b", "a", "a", "a", "b"]
    buckets = flat_buckets(sizes, keys, cap=320)
    assert sorted(i for b in buckets for i in b.indices) == list(range(len(sizes)))
    for b in buckets:
        assert len({keys[i] for i in b.indices}) == 1  # one wire dtype per bucket
        assert list(b.indices) == sorted(b.indices, reverse=True)  # packed from the last parameter down
        assert b.numel <= 320 or len(b.indices) == 1  # only a parameter larger than the cap stands alone
    # the backward pass completes a bucket when its lowest parameter's gradient exists: highest first
    assert [min(b.indices) for b in buckets] == sorted((min(b.indices) for b in buckets), reverse=True)
    assert [b.indices for b in flat_buckets(sizes, keys, cap=0)] == [(i,) for i in (6, 5, 4, 3, 2, 1, 0)]


@pytest.mark.parametrize("world", [2, 3, 8])
def test_rank_buckets_hand_each_rank_exactly_its_own_parameters(world):
    rng = np.random.default_rng(world)
    sizes = [int(x) for x in rng.integers(1, 5000, 40)]
    keys = ["half" if i % 3 else "fp32" for i in range(40)]
    owner = assign_owners_grouped(sizes, keys, world)
    for cap in (0, 4000, 20000, 10**9):
        buckets, singles = rank_buckets(owner, sizes, keys, world, cap)
        seen = [i for b in buckets for seg in b.segments for i in seg] + singles
        assert sorted(seen) == list(range(40))  # every parameter exactly once
        for b in buckets:
            assert len(b.segments) == world
            for r, seg in enumerate(b.segments):
                assert all(owner[i] == r for i in seg)
                assert b.used(r) == sum(sizes[i] for i in seg) <= b.length
            assert len({keys[i] for seg in b.segments for i in seg}) == 1
            assert 4 * sum(b.used(r) for r in range(world)) >= 3 * b.numel  # at most a quarter padding
        ready = [min(i for seg in b.segments for i in seg) for b in buckets]
        assert ready == sorted(ready, reverse=True)  # in gradient-readiness order
        assert singles == sorted(singles, reverse=True)


def test_7b_owners_are_balanced_and_its_buckets_pad_little():
    owner = assign_owners_grouped(SIZES_7B, KEYS_7B, 8)
    loads = [sum(n for n, o in zip(SIZES_7B, owner) if o == r) for r in range(8)]
    half = [sum(n for n, o, k in zip(SIZES_7B, owner, KEYS_7B) if o == r and k == "half") for r in range(8)]
    assert max(half) - min(half) <= 16777216  # the half group alone within one wo matrix
    assert max(loads) <= 1.12 * sum(SIZES_7B) / 8  # embedding and lm_head land on two ranks
    buckets, singles = rank_buckets(owner, SIZES_7B, KEYS_7B, 8, cap_elements(256))
    moved = sum(b.numel for b in buckets) + sum(SIZES_7B[i] for i in singles)
    assert moved <= 1.02 * sum(SIZES_7B)
    assert len(buckets) + len(singles) <= 40  # was 195 broadcasts


def test_param_shapes_are_the_models():
    from mspretrain.config.schema import ModelConfig, resolve_model
    from mspretrain.model.decoder import Decoder, half_eligible
    from mspretrain.model.presets import is_half_eligible, param_count, param_shapes

    for tie in (False, True):
        cfg = resolve_model(ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, tie_embeddings=tie), vocab_size=96)
        model = Decoder(cfg, seed=0)
        assert param_shapes(cfg) == [(p.name, tuple(p.shape)) for p in model.trainable_params()]
        assert sum(int(np.prod(s)) for _, s in param_shapes(cfg)) == param_count(cfg)
        assert [n for n, _ in param_shapes(cfg) if is_half_eligible(n)] == half_eligible(model)


@pytest.mark.parametrize("dtype,param_dtype,accumulation,trainable", [
    ("fp32", "fp32", 1, ("all",)), ("fp32", "fp32", 3, ("all",)), ("fp16", "compute", 2, ("all",)),
    ("fp16", "compute", 2, ("embeddings", "lm_head")), ("fp32", "fp32", 3, ("embeddings", "lm_head"))])
def test_plan_bytes_are_the_buffers_the_step_allocates(tiny_cfg, dtype, param_dtype, accumulation, trainable):
    """The planner's per-kind bytes of one device equal what TrainStep allocates (one process),
    also with frozen groups (train.trainable: state and buffers for the trained ones only)."""
    from dataclasses import replace

    from mspretrain.config.schema import resolve_model
    from mspretrain.model.decoder import Decoder, half_eligible
    from mspretrain.preflight.plan import make_plan
    from mspretrain.step.step import TrainStep

    model_cfg = resolve_model(tiny_cfg.model, vocab_size=512)
    gb = tiny_cfg.train.global_batch
    cfg = replace(tiny_cfg, model=model_cfg, precision=replace(tiny_cfg.precision, dtype=dtype, param_dtype=param_dtype),
                  train=replace(tiny_cfg.train, micro_batch=gb // accumulation, trainable=trainable))
    model = Decoder(model_cfg, dtype=dtype, seed=0)
    half = half_eligible(model) if param_dtype == "compute" else []
    step = TrainStep(model, cfg.optim, global_tokens=gb * cfg.data.seq_len, half_params=half, accumulation=accumulation,
                     trainable=trainable)
    plan = make_plan(cfg, devices=1, tokens=10**6, data_dir=None, tokens_per_s_per_device=None)
    have = step.buffer_bytes()
    for kind in ("weights", "master_weights", "adam_moments", "gradients"):
        assert plan["memory_bytes"][kind] == have[kind], kind
    trained = sum(int(np.prod(p.shape)) for p in step.params)
    assert plan["trained_params"] == trained
    assert plan["memory_bytes"]["update_temporaries"] == 8 * max(int(np.prod(p.shape)) for p in step.params)
    if trainable != ("all",):
        assert 0 < trained < plan["params"] and plan["memory_bytes"]["adam_moments"] == 8 * trained


# ZeRO-2 with 2 micro-batches and `optim.split_mb = 0.1` (26,214 elements): the tiny embedding and
# lm_head (512 x 64 = 32,768 each) are cut into a slice per rank, the other 7 parameters (one layer:
# conftest `ONE_LAYER`) stay whole, so one job runs both paths (a split test and a whole-tensor
# test each launched the same job before).
ZERO2_ACCUM = ("optim.shard_gradients=true", "train.micro_batch=1", "optim.split_mb=0.1")


@pytest.fixture(scope="module")
def zero2_accum_run(tmp_path_factory, tiny_data) -> Path:
    """ZeRO-2 on 2 msrun workers, 2 micro-batches each, default buckets, embedding and lm_head
    split (`ZERO2_ACCUM`; the reference run's config otherwise). Module-scoped: two tests compare
    against it, one launch. Read-only."""
    tmp = tmp_path_factory.mktemp("zero2")
    two = tmp / "zero2"
    msrun(tmp, tiny_data, two, *ZERO2_ACCUM)
    return two


@pytest.mark.slow
@pytest.mark.msrun
@pytest.mark.skipif(MSRUN is None, reason="msrun not installed with MindSpore")
def test_sharded_gradients_with_accumulation_match_one_process_and_resume_at_world_1(tmp_path, tiny_data, reference_run,
                                                                                     zero2_accum_run):
    """ZeRO-2 on 2 msrun workers, 2 micro-batches each (a reduce-scatter per micro-batch, bucketed
    AllGather after the update) against one process without accumulation: losses, grad norms,
    the final model and optimizer files, identical replicas; one process resumes it at step 5 and,
    after resumed updates, has the unbroken run's weights and moments.

    Split parameters (`ZERO2_ACCUM`: `optim.split_mb = 0.1`): embedding and lm_head are cut into a
    slice per rank, reduce-scattered into the slices, updated there and gathered whole; each rank's
    shard holds its slices, and the one-process resume re-joins them into whole tensors."""
    from safetensors.numpy import load_file

    two = zero2_accum_run
    assert "optimizer state and gradients sharded over 2 ranks" in (two / "train.log").read_text()
    shards = sorted(step_dir(two, FINAL).glob("optimizer-*.safetensors"))
    keys = [set(load_file(str(s))) for s in shards]
    assert len(shards) == 2
    for name in ("embed.weight", "lm_head.weight"):
        assert f"exp_avg.{name}@0:16384" in keys[0] and f"exp_avg.{name}@16384:32768" in keys[1]
        assert not any(k.startswith(f"exp_avg.{name}") for k in keys[0] & keys[1])
    # the other 7 parameters (the layer's 6 and the final norm) stay whole: each in exactly one
    # rank's shard, under its plain name
    whole = {k for k in keys[0] | keys[1] if k.startswith("exp_avg.") and "@" not in k}
    assert len(whole) == 7 and not whole & keys[0] & keys[1]
    resumed = assert_two_ranks_equal_one_process(two, reference_run, tiny_data, tmp_path)
    for step in range(6, FINAL + 1):
        assert_same_checkpoint(step_dir(resumed, step), step_dir(reference_run, step), 1e-5)


@pytest.mark.slow
@pytest.mark.msrun
@pytest.mark.skipif(MSRUN is None, reason="msrun not installed with MindSpore")
def test_sharded_gradients_fp16_masters_one_collective_per_parameter(tmp_path, tiny_data, one_fp16):
    """fp16 compute with fp16 matrices and sharded fp32 masters, ZeRO-2, and `bucket_mb = 0` (the
    per-parameter collectives) on 2 workers, against the same config on one process; then resumed
    from its step 5 on one process."""
    fp16, one = FP16_MASTERS, one_fp16
    two = tmp_path / "zero2-fp16"
    msrun(tmp_path, tiny_data, two, *fp16, "optim.shard_gradients=true", "optim.bucket_mb=0")
    a, b = fp16_run_equals_one_process(two, one)

    # resumed at another world size: the 2 workers' step-5 checkpoint (fp16 weights, fp32 masters
    # sharded over 2 files) continued by one process keeps the unbroken runs' losses
    resumed = resume_on_one_process(two, tiny_data, tmp_path, 5, "train.log_every=1", *fp16)
    after = losses(resumed)
    for step in range(6, FINAL + 1):
        assert abs(after[step] - a[step]) <= 1e-4 and abs(after[step] - b[step]) <= 1e-4, (step, a[step], b[step], after[step])
    assert_same_checkpoint(step_dir(resumed, FINAL), step_dir(one, FINAL), 5e-3)


@pytest.mark.slow
@pytest.mark.msrun
@pytest.mark.skipif(MSRUN is None, reason="msrun not installed with MindSpore")
def test_sharded_gradients_with_frozen_groups_match_one_process(tmp_path, tiny_data):
    """train.trainable = ["embeddings", "lm_head"] under ZeRO-2 with accumulation on 2 workers: owners,
    buckets, moments and buffers cover only the trained parameters, yet losses and both files match
    one process; the frozen parameters are bit-identical to one process's (which never moved them)."""
    from safetensors.numpy import load_file

    from mspretrain.cli import main

    steps = 3
    args = [f"train.max_steps={steps}", f"checkpoint.every={steps}", "train.log_every=1", "--quiet", NO_EVAL,
            'train.trainable=["embeddings", "lm_head"]']
    one = tmp_path / "one-frozen"
    assert main(["train", "--config", str(TINY), "--data", str(tiny_data), "--run", str(one), *args]) == 0
    two = tmp_path / "zero2-frozen"
    msrun(tmp_path, tiny_data, two, "optim.shard_gradients=true", "train.micro_batch=1", args=args)
    a, b = losses(one), losses(two)
    assert sorted(a) == sorted(b) == list(range(1, steps + 1))
    for step in a:
        assert abs(a[step] - b[step]) <= 1e-5, (step, a[step], b[step])
    hashes = replica_hashes(two)
    assert len(hashes) == 2 and hashes[0] == hashes[1]
    assert_same_checkpoint(step_dir(two, steps), step_dir(one, steps), 1e-5)
    wa, wb = (load_file(str(step_dir(r, steps) / "model.safetensors")) for r in (one, two))
    frozen = [k for k in wa if k not in ("embed.weight", "lm_head.weight")]
    assert frozen and all(np.array_equal(wa[k], wb[k]) for k in frozen)
    shards = sorted(step_dir(two, steps).glob("optimizer-*.safetensors"))
    keys = set().union(*(load_file(str(s)).keys() for s in shards))
    assert len(shards) == 2 and keys == {"opt_step"} | {f"{m}.{n}" for m in ("exp_avg", "exp_avg_sq") for n in ("embed.weight", "lm_head.weight")}


# ---- the bucketed, flattened collectives against one collective per parameter

def _loopback(x):
    """Stands in for a 2-rank AllReduce whose peer contributes zeros (graph code calls it like the primitive)."""
    return x


def _run_three_steps(tiny_cfg, *, world: int, bucket_mb: float, accumulation: int, wire16: bool):
    from mspretrain.model.decoder import state_numpy
    from mspretrain.step.step import TrainStep

    model = _tiny_model(tiny_cfg)
    step = TrainStep(model, tiny_cfg.optim, global_tokens=4 * 32, world=world, rank=0, bucket_mb=bucket_mb,
                     allreduce_fp16=wire16, accumulation=accumulation)
    if world > 1:
        step.allreduce = _loopback
    rng = np.random.default_rng(3)
    results = []
    for _ in range(3):
        batch = rng.integers(0, 512, (4, 33)).astype(np.int32)
        k = 4 // accumulation
        r = step.run([(batch[i:i + k], None, None) for i in range(0, 4, k)], lr=1e-3, scale=1.0)
        results.append((r.loss, r.grad_norm, r.finite))
    return step, results, snapshot(state_numpy(model)), snapshot(step.optimizer_state())


@pytest.mark.slow  # 2-3 compilations of the tiny step per case, ~30 s each case on 2 busy cores
@pytest.mark.parametrize("accumulation,wire16", [(1, False), (2, True)])
def test_bucketed_collectives_equal_per_parameter_bit_for_bit_on_one_process(tiny_cfg, accumulation, wire16):
    """On one process the step issues no collective whatever `optim.bucket_mb` is: the layout has
    no buckets and the gradients stay in parameter order (asserted first), so comparing world-1
    runs with two caps would compare a graph with itself. The packing is tested instead on a step
    built for rank 0 of 2 with a loopback in place of AllReduce (the peer contributes zeros):
    flatten, cast to the wire dtype (fp16 but lm_head's: two groups), split and reshape, and with
    accumulation the in-place reduction of the buffers, run as on 2 ranks. One collective per
    parameter (bucket_mb = 0) and several multi-parameter buckets give bit-identical losses, grad
    norms, weights and Adam moments over 3 steps, and, with an fp32 wire, the bits of world 1; one
    bucket (the default) has the layout it should (run by the 2-worker jobs)."""
    from mspretrain.parallel.layout import bucket_mb_for, plan_layout
    from mspretrain.step.step import TrainStep

    caps = (0.0, 0.15, bucket_mb_for("auto", "cpu"))  # 0.15 MB = 39,321 elements: 5 buckets of 1-5 of the tiny model's 15 parameters
    sizes = [int(np.prod(s)) for s in _tiny_shapes(tiny_cfg)]
    for cap in caps:  # world 1: nothing to pack
        layout = plan_layout(sizes, [False] * len(sizes), [wire16] * len(sizes), 1, shard=False, shard_grads=False,
                             cap=cap_elements(cap))
        assert not (layout.reduce_flat or layout.reduce_rank or layout.reduce_single or layout.gather_rank or layout.gather_single)
        assert layout.traffic(accumulation) == (0, 0)
    assert {tuple(TrainStep(_tiny_model(tiny_cfg), tiny_cfg.optim, global_tokens=128, bucket_mb=cap)._order) for cap in caps} \
        == {tuple(range(len(sizes)))}

    # run: one collective per parameter and several buckets; the default cap's one bucket (two with
    # the fp16 wire) is built for its layout, not run: its packing is the several buckets' with fewer
    # cuts, and the 2-worker jobs run it (fp32 here against per-parameter collectives, the fp16 wire
    # in test_distributed.py against one process)
    runs = {cap: _run_three_steps(tiny_cfg, world=2, bucket_mb=cap, accumulation=accumulation, wire16=wire16) for cap in caps[:2]}
    default = TrainStep(_tiny_model(tiny_cfg), tiny_cfg.optim, global_tokens=4 * 32, world=2, rank=0, bucket_mb=caps[2],
                        allreduce_fp16=wire16, accumulation=accumulation)
    steps = [runs[caps[0]][0], runs[caps[1]][0], default]
    n_buckets = [len(step.layout.reduce_flat) for step in steps]
    assert n_buckets[0] == len(sizes) > n_buckets[1] > n_buckets[2] == (2 if wire16 else 1), n_buckets  # lm_head crosses in fp32
    assert len({tuple(step._order) for step in steps}) == 1
    references = [runs[0.0]] + ([] if wire16 else [_run_three_steps(tiny_cfg, world=1, bucket_mb=0.0, accumulation=accumulation,
                                                                    wire16=False)])
    for cap in caps[1:2]:
        for _, results, weights, state in references:
            _, got_results, got_weights, got_state = runs[cap]
            assert got_results == results, cap
            assert all(r[2] for r in results)
            assert set(got_weights) == set(weights) and all(np.array_equal(got_weights[k], weights[k]) for k in weights), cap
            assert set(got_state) == set(state) and all(np.array_equal(got_state[k], state[k]) for k in state), cap


def _tiny_model(tiny_cfg):
    from mspretrain.config.schema import resolve_model
    from mspretrain.model.decoder import Decoder

    return Decoder(resolve_model(tiny_cfg.model, vocab_size=512), seed=0)


def _tiny_shapes(tiny_cfg):
    from mspretrain.config.schema import resolve_model
    from mspretrain.model.presets import param_shapes

    return [s for _, s in param_shapes(resolve_model(tiny_cfg.model, vocab_size=512))]


def _collectives(run: Path) -> int:
    """Collective calls per step from the start-up line of train.log."""
    return int(re.search(r"(\d+) collectives and", (run / "train.log").read_text()).group(1))


def _assert_runs_equal(a: Path, b: Path, steps: int, tol: float) -> None:
    la, lb = losses(a), losses(b)
    ga, gb = grad_norms(a), grad_norms(b)
    assert sorted(la) == sorted(lb) == sorted(ga) == sorted(gb) == list(range(1, steps + 1))
    for step in la:
        assert abs(la[step] - lb[step]) <= tol, (step, la[step], lb[step])
        assert abs(ga[step] - gb[step]) <= tol * max(1.0, abs(ga[step])), (step, ga[step], gb[step])
    for run in (a, b):
        hashes = replica_hashes(run)
        assert len(hashes) == 2 and hashes[0] == hashes[1]
    assert_same_checkpoint(step_dir(b, steps), step_dir(a, steps), tol)


@pytest.mark.slow
@pytest.mark.msrun
@pytest.mark.skipif(MSRUN is None, reason="msrun not installed with MindSpore")
def test_bucketed_zero2_equals_one_collective_per_parameter_on_2_workers(tmp_path, tiny_data, zero2_accum_run):
    """ZeRO-2 with 2 micro-batches on 2 msrun workers, fp32, embedding and lm_head split
    (`ZERO2_ACCUM`): the default buckets (1 reduce bucket per micro-batch, 1 gather bucket, and a
    reduce-scatter and a gather per split parameter) against `bucket_mb = 0` (a rank bucket per
    k-th owned parameter, AllReduce + Broadcast for the rest): fewer collectives per step (9
    against 42 for 2 layers at vocabulary 512, 3 against 33 with nothing split: `TrainStep.collectives`). Losses and
    grad norms of all 8 steps and the final model and optimizer files within 1e-6; measured bit
    for bit (2026-12-01). The bound is not 0: the owned gradients come in another order, so the
    owners' partial sums of squares (the norm) are added in another order and may round apart."""
    per_param = tmp_path / "zero2-per-parameter"
    msrun(tmp_path, tiny_data, per_param, *ZERO2_ACCUM, "optim.bucket_mb=0")
    assert _collectives(zero2_accum_run) < _collectives(per_param)
    _assert_runs_equal(zero2_accum_run, per_param, FINAL, 1e-6)


@pytest.mark.slow
@pytest.mark.msrun
@pytest.mark.skipif(MSRUN is None, reason="msrun not installed with MindSpore")
def test_bucketed_allreduce_equals_one_collective_per_parameter_on_2_workers(tmp_path, tiny_data, two_ranks_fp32):
    """Replicated (ZeRO off), fp32, no accumulation (the fused step) on 2 msrun workers: one
    AllReduce bucket against one AllReduce per parameter, 8 steps. Losses, grad norms and the
    final model and optimizer files within 1e-6; measured bit for bit (2026-12-01: each element's
    sum over 2 ranks is the same addition either way). The bucketed run is the session's
    `two_ranks_fp32` (conftest; test_distributed.py compares it with one process)."""
    per_param = tmp_path / "replicated-per-parameter"
    msrun(tmp_path, tiny_data, per_param, "precision.allreduce_dtype=fp32", "optim.bucket_mb=0")
    assert _collectives(two_ranks_fp32) == 1 and _collectives(per_param) == 9  # one layer: 3 + its 6 parameters
    _assert_runs_equal(two_ranks_fp32, per_param, FINAL, 1e-6)


# ---- large parameters split across ranks (optim.split_mb): each rank owns 1/N of their state

@pytest.mark.parametrize("world", [2, 3, 8])
def test_parameters_over_the_split_threshold_are_cut_into_balanced_slices_on_every_rank(world):
    from mspretrain.parallel.layout import plan_layout, slice_bounds

    rng = np.random.default_rng(world)
    sizes = [int(x) for x in rng.integers(1, 5000, 30)] + [152_064 * 7, 90_001, 64]  # an lm_head-like tail
    half = [i % 3 == 1 for i in range(len(sizes))]
    split = 50_000
    for shard_grads in (False, True):
        layout = plan_layout(sizes, half, [False] * len(sizes), world, shard=True, shard_grads=shard_grads, cap=20_000, split=split)
        cut = [i for i in range(len(sizes)) if layout.is_split(i)]
        assert cut == [i for i, n in enumerate(sizes) if n >= split]  # both large ones, nothing else
        for i in cut:
            n = sizes[i]
            bounds = [slice_bounds(n, world, r) for r in range(world)]
            assert bounds[0][0] == 0 and bounds[-1][1] == n and all(bounds[r][1] == bounds[r + 1][0] for r in range(world - 1))
            lengths = [b - a for a, b in bounds]
            assert min(lengths) > 0 and max(lengths) - min(lengths) < world  # balanced elements
            assert layout.owner[i] == -1 and all(i in layout.owned(r) for r in range(world))
            # one bucket each way whose segment r is slice r, padded by < N elements at the end
            buckets = [b for b in layout.gather_rank + (layout.reduce_rank if shard_grads else ()) if i in b.segments[0]]
            assert len(buckets) == (2 if shard_grads else 1)
            for b in buckets:
                assert b.split and b.segments == tuple((i,) for _ in range(world))
                assert [b.used(r) for r in range(world)] == lengths and 0 <= b.numel - n < world
        whole = [i for i in range(len(sizes)) if i not in cut]
        for buckets, singles in ((layout.gather_rank, layout.gather_single), (layout.reduce_rank, layout.reduce_single)):
            if buckets is layout.reduce_rank and not shard_grads:
                continue
            seen = [i for b in buckets if not b.split for seg in b.segments for i in seg] + list(singles)
            assert sorted(seen) == whole  # the rest still whole, each exactly once
        # every rank holds about 1/N of all the state: the split ones no longer land on one rank
        loads = [sum(layout.owned_sizes(r)) for r in range(world)]
        assert sum(loads) == sum(sizes)
        assert max(loads) - min(loads) <= 5000 + world * len(cut)  # within the largest whole parameter
    # split = 0 (and one rank) keeps every parameter whole, with the owners of whole-tensor ZeRO
    for w, s in ((world, 0), (1, split)):
        layout = plan_layout(sizes, half, [False] * len(sizes), w, shard=True, shard_grads=True, cap=20_000, split=s)
        assert not any(layout.is_split(i) for i in range(len(sizes)))
    assert plan_layout(sizes, half, [False] * len(sizes), world, shard=True, shard_grads=True, cap=20_000).owner \
        == tuple(assign_owners_grouped(sizes, ["half" if h else "fp32" for h in half], world))


def test_split_mb_setting():
    from mspretrain.config import schema as cfgmod
    from mspretrain.errors import UserError
    from mspretrain.parallel.layout import split_elements_for

    cap = cap_elements(256)
    assert split_elements_for("auto", cap) == cap and split_elements_for(0, cap) == 0 and split_elements_for(1.0, cap) == 262_144
    assert cfgmod.load(TINY, ["optim.split_mb=0.5"]).optim.split_mb == 0.5
    for bad in ("optim.split_mb=-1", "optim.split_mb=big", "optim.split_mb=nan"):
        with pytest.raises(UserError, match="optim.split_mb"):
            cfgmod.load(TINY, [bad])


def test_qwen_lm_head_state_is_spread_over_8_ranks():
    """The issue-31 case: the 152,064 x 3,584 embedding and lm_head (545 M parameters each) with
    the default threshold (the 256 MB Ascend bucket cap): every rank holds 1/8 of both."""
    from mspretrain.model.presets import is_half_eligible, param_shapes, preset
    from mspretrain.parallel.layout import plan_layout, split_elements_for

    shapes = param_shapes(preset("qwen2.5-7b"))
    sizes = [int(np.prod(s)) for _, s in shapes]
    half = [is_half_eligible(n) for n, _ in shapes]  # bf16 matrices, fp32 embedding and lm_head (the recipe)
    cap = cap_elements(256)
    big = [i for i, (n, _) in enumerate(shapes) if n in ("embed.weight", "lm_head.weight")]
    assert len(big) == 2 and all(sizes[i] == 152_064 * 3_584 for i in big)
    for split_mb, spread in (("auto", True), (0, False)):
        layout = plan_layout(sizes, half, [False] * len(sizes), 8, shard=True, shard_grads=True,
                             cap=cap, split=split_elements_for(split_mb, cap))
        assert all(layout.is_split(i) == spread for i in big)
        heaviest = max(range(8), key=lambda r: sum(layout.owned_sizes(r)))
        fp32 = sum(n for i, n in zip(layout.owned(heaviest), layout.owned_sizes(heaviest)) if not half[i])
        if spread:  # 1/8 of each table, and no rank's largest unit is a whole table
            assert fp32 <= 2 * sizes[big[0]] // 8 + 8 * 3_584 and max(layout.owned_sizes(heaviest)) < sizes[big[0]] // 4
        else:  # whole tensors: one rank holds a whole table's moments
            assert fp32 >= sizes[big[0]]


def _state_step(tiny_cfg, world: int, rank: int, split_mb: float | str = 0.1, half: bool = False):
    """A TrainStep of rank `rank` of `world` (nothing compiled or communicated: its tables and state only)."""
    from mspretrain.config.schema import resolve_model
    from mspretrain.model.decoder import Decoder, half_eligible
    from mspretrain.step.step import TrainStep

    model = Decoder(resolve_model(tiny_cfg.model, vocab_size=512), dtype="fp16" if half else "fp32", seed=0)
    return TrainStep(model, tiny_cfg.optim, global_tokens=128, world=world, rank=rank, shard=True, shard_grads=True,
                     split_mb=split_mb, half_params=half_eligible(model) if half else None)


def test_split_optimizer_state_is_saved_per_slice_and_recut_for_any_world(tiny_cfg):
    """Each rank writes its slices under `NAME@start:stop`; the union of 2 ranks' shards loads
    into 1 process (whole tensors), 3 ranks (other slices) and unsplit ranks, element for element;
    a checkpoint with a slice missing is refused in one line."""
    from mspretrain.errors import UserError
    from mspretrain.step.step import parse_key

    full = {}  # logical key -> the full state, made up
    rng = np.random.default_rng(0)
    writers = [_state_step(tiny_cfg, 2, r) for r in range(2)]
    assert writers[0].layout.is_split(writers[0].names.index("lm_head.weight"))
    stored: dict[str, np.ndarray] = {}
    for step in writers:
        for k, i in enumerate(step.own):
            for kind in step._kinds(i):
                name = f"{kind}.{step.names[i]}"
                full.setdefault(name, rng.standard_normal(step.sizes[i]).astype(np.float32))
                a, b = step._own_bounds[k]
                target = {"exp_avg": step.exp_avg, "exp_avg_sq": step.exp_avg_sq}[kind][k]
                target.set_data(ms_tensor(full[name][a:b].reshape(target.shape)))
        state = step.optimizer_state()
        assert set(state) == step.state_keys(owned_only=True)
        stored.update({k: np.array(v, copy=True) for k, v in state.items()})
    assert "exp_avg.lm_head.weight@0:16384" in stored and "exp_avg.lm_head.weight@16384:32768" in stored
    assert "exp_avg.lm_head.weight" not in stored
    assert {parse_key(k)[0] for k in stored} == writers[0].state_keys()
    for world, split_mb in ((1, 0.1), (3, 0.1), (2, 0)):
        for rank in range(world):
            reader = _state_step(tiny_cfg, world, rank, split_mb)
            keys = reader.keys_to_read(set(stored))
            reader.load_optimizer_state({k: stored[k] for k in keys}, available=set(stored))
            got = reader.optimizer_state()
            for key, value in got.items():
                name, rng_ = parse_key(key)
                if name == "opt_step":
                    continue
                a, b = rng_ or (0, reader.sizes[reader.names.index(name.split(".", 1)[1])])
                assert np.array_equal(value.reshape(-1), full[name][a:b]), (world, rank, key)
    # and the other way: an unsplit writer's whole tensors load into split ranks
    whole = _state_step(tiny_cfg, 1, 0)
    whole.load_optimizer_state({k: stored[k] for k in whole.keys_to_read(set(stored))}, available=set(stored))
    written = {k: np.array(v, copy=True) for k, v in whole.optimizer_state().items()}
    assert "exp_avg.lm_head.weight" in written and not any("@" in k for k in written)
    for rank in range(2):
        reader = _state_step(tiny_cfg, 2, rank)
        reader.load_optimizer_state({k: written[k] for k in reader.keys_to_read(set(written))}, available=set(written))
        for key, value in reader.optimizer_state().items():
            name, rng_ = parse_key(key)
            if rng_:
                assert np.array_equal(value, full[name][rng_[0]:rng_[1]]), key
    broken = {k: v for k, v in stored.items() if k != "exp_avg.lm_head.weight@16384:32768"}
    reader = _state_step(tiny_cfg, 1, 0)
    with pytest.raises(UserError, match=r"pieces of exp_avg.lm_head.weight leave its elements \[16,384, 32,768\) unwritten"):
        reader.load_optimizer_state(broken, available=set(broken))


def ms_tensor(x):
    from mindspore import Tensor

    return Tensor(x)


def test_split_fp16_masters_are_slices_and_fp32_ones_come_from_the_weights(tiny_cfg):
    """fp16 matrices keep their fp32 master per slice in the checkpoint; an fp32 split parameter
    (the lm_head) needs a master tensor for its slice, which is not written (the weights are) and
    is refreshed from the weights on load, so a rewind or resume starts from the loaded weights."""
    cfg = tiny_cfg
    step = _state_step(cfg, 2, 1, split_mb=0.04, half=True)  # 10,485 elements: the embedding, lm_head and w13
    names = [step.names[i] for i in step.own if step.layout.is_split(i)]
    assert {"embed.weight", "lm_head.weight", "layers.0.mlp.w13.weight"} <= set(names)
    keys = step.state_keys(owned_only=True)
    a, b = step.layout.unit(step.names.index("layers.0.mlp.w13.weight"), 1)
    assert f"master.layers.0.mlp.w13.weight@{a}:{b}" in keys
    assert not any(k.startswith("master.lm_head") for k in keys)
    sizes = step.layout.owned_sizes(1)
    assert step.buffer_bytes()["master_weights"] == 4 * sum(n for i, n in zip(step.own, sizes) if step.layout.is_split(i) or step.layout.half[i])
    lm = step.names.index("lm_head.weight")
    k = step.own.index(lm)
    new = np.arange(step.sizes[lm], dtype=np.float32).reshape(step.params[lm].shape)
    step.params[lm].set_data(ms_tensor(new))
    state = {key: np.array(v, copy=True) for key, v in step.optimizer_state().items()}
    step.load_optimizer_state(state, available=step.state_keys())  # (the other rank's keys are in the checkpoint)
    lo, hi = step._own_bounds[k]
    assert np.array_equal(step.own_masters[k].asnumpy(), new.reshape(-1)[lo:hi])


# ZeRO-2 with split parameters on 2 msrun workers (reduce-scattered into the slices, updated there,
# gathered whole; the resume at world 1 re-joins them): the `zero2_accum_run` job above, checked by
# test_sharded_gradients_with_accumulation_match_one_process_and_resume_at_world_1 and, against one
# collective per parameter, by test_bucketed_zero2_equals_one_collective_per_parameter_on_2_workers.


@pytest.mark.slow
@pytest.mark.msrun
@pytest.mark.skipif(MSRUN is None, reason="msrun not installed with MindSpore")
def test_split_parameters_under_zero1_with_fp16_masters_match_one_process(tmp_path, tiny_data, one_fp16):
    """The other paths of a split parameter: ZeRO-1 (gradients all-reduced whole, each rank cuts
    its slice for the update) in the fused step (no accumulation), fp16 matrices whose fp32
    masters are slices, and `optim.split_mb = 0.04` (10,485 elements: the fp32 embedding and
    lm_head and the fp16 w13 and w2 of the layer). Against the same config on one process, with
    the fp16-masters test's tolerances."""
    from safetensors.numpy import load_file

    fp16, one = FP16_MASTERS, one_fp16
    two = tmp_path / "zero1-split-fp16"
    msrun(tmp_path, tiny_data, two, *fp16, "optim.shard_optimizer=true", "optim.split_mb=0.04", "train.log_every=1")
    assert "optimizer state sharded over 2 ranks" in (two / "train.log").read_text()
    keys = set().union(*(load_file(str(s)) for s in step_dir(two, FINAL).glob("optimizer-*.safetensors")))
    assert {"master.layers.0.mlp.w13.weight@0:12288", "master.layers.0.mlp.w13.weight@12288:24576",
            "exp_avg.lm_head.weight@16384:32768"} <= keys
    assert not any(k.startswith("master.lm_head") for k in keys)  # fp32: its master is the weights
    fp16_run_equals_one_process(two, one)


@pytest.mark.parametrize("dtype,param_dtype", [("fp32", "fp32"), ("fp16", "compute")])
def test_plan_bytes_are_the_buffers_of_the_heaviest_rank_with_split_parameters(tiny_cfg, dtype, param_dtype):
    """With split parameters (ZeRO-2, 2 ranks, optim.split_mb = 0.04: the embedding, lm_head, w13
    and w2 cut in two) the planner's per-device bytes are the buffers the heaviest rank's TrainStep
    allocates: slices' moments, masters (fp32 ones too) and accumulation buffers."""
    from dataclasses import replace

    from mspretrain.config.schema import resolve_model
    from mspretrain.model.decoder import Decoder, half_eligible
    from mspretrain.preflight.plan import make_plan
    from mspretrain.step.step import TrainStep

    model_cfg = resolve_model(tiny_cfg.model, vocab_size=512)
    gb = tiny_cfg.train.global_batch
    cfg = replace(tiny_cfg, model=model_cfg, precision=replace(tiny_cfg.precision, dtype=dtype, param_dtype=param_dtype),
                  optim=replace(tiny_cfg.optim, shard_optimizer=True, shard_gradients=True, split_mb=0.04),
                  train=replace(tiny_cfg.train, micro_batch=1))
    plan = make_plan(cfg, devices=2, tokens=10**6, data_dir=None, tokens_per_s_per_device=None, target="cpu")
    accum = plan["accumulation"]
    assert accum > 1
    layout_rank = None
    for rank in range(2):
        model = Decoder(model_cfg, dtype=dtype, seed=0)
        half = half_eligible(model) if param_dtype == "compute" else []
        step = TrainStep(model, cfg.optim, global_tokens=gb * cfg.data.seq_len, world=2, rank=rank, shard=True, shard_grads=True,
                         split_mb=0.04, half_params=half, accumulation=accum, device="cpu")
        assert sum(step.layout.is_split(i) for i in range(len(step.params))) == 6  # embed, lm_head, 2 x (w13, w2)
        layout_rank = step.layout.heaviest_rank()
        if rank == layout_rank:
            have = step.buffer_bytes()
            for kind in ("weights", "master_weights", "adam_moments", "gradients"):
                assert plan["memory_bytes"][kind] == have[kind], kind
            assert plan["memory_bytes"]["update_temporaries"] == 8 * max(int(np.prod(p.shape)) for p in step.exp_avg)
    assert layout_rank is not None
