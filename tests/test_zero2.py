"""Sharded gradients (ZeRO-2), bucketed collectives and their tables, against one process."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from mspretrain.train.layout import assign_owners_grouped, cap_elements, flat_buckets, rank_buckets
from tests.conftest import TINY, assert_same_checkpoint
from tests.test_distributed import ARGS, FINAL, MSRUN, STEPS, _grad_norms, _metrics, _msrun, _replica_hashes, _step_dir

# a 7B-shaped table: embedding, 32 x (norm, wqkv, wo, norm, w13, w2), norm, lm_head
SIZES_7B = [131072000] + [4096, 50331648, 16777216, 4096, 90177536, 45088768] * 32 + [4096, 131072000]
KEYS_7B = ["fp32"] + ["fp32", "half", "half", "fp32", "half", "half"] * 32 + ["fp32", "fp32"]


def test_flat_buckets_cover_every_parameter_once_in_order_within_the_cap():
    sizes = [10, 300, 5, 5, 200, 1000, 7]
    keys = ["a", "a", "b", "a", "a", "a", "b"]
    buckets = flat_buckets(sizes, keys, cap=320)
    assert sorted(i for b in buckets for i in b.indices) == list(range(len(sizes)))
    for b in buckets:
        assert len({keys[i] for i in b.indices}) == 1  # one wire dtype per bucket
        assert list(b.indices) == sorted(b.indices)
        assert b.numel <= 320 or len(b.indices) == 1  # only a parameter larger than the cap stands alone
    assert [b.indices for b in flat_buckets(sizes, keys, cap=0)] == [(i,) for i in (0, 1, 3, 4, 5, 2, 6)]


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
    from mspretrain.config import ModelConfig, resolve_model
    from mspretrain.model.llama import Llama, half_eligible
    from mspretrain.model.presets import is_half_eligible, param_count, param_shapes

    for tie in (False, True):
        cfg = resolve_model(ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, tie_embeddings=tie), vocab_size=96)
        model = Llama(cfg, seed=0)
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

    from mspretrain.config import resolve_model
    from mspretrain.model.llama import Llama, half_eligible
    from mspretrain.ops.plan import make_plan
    from mspretrain.train.step import TrainStep

    model_cfg = resolve_model(tiny_cfg.model, vocab_size=512)
    gb = tiny_cfg.train.global_batch
    cfg = replace(tiny_cfg, model=model_cfg, precision=replace(tiny_cfg.precision, dtype=dtype, param_dtype=param_dtype),
                  train=replace(tiny_cfg.train, micro_batch=gb // accumulation, trainable=trainable))
    model = Llama(model_cfg, dtype=dtype, seed=0)
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


def _resume_on_one_process(run, tiny_data, tmp_path, at: int, *extra: str):
    from mspretrain.cli import main

    resumed = tmp_path / f"resumed-{run.name}"
    shutil.copytree(run, resumed)
    for step in range(at + 1, FINAL + 1):
        shutil.rmtree(_step_dir(resumed, step))
    (resumed / "metrics.jsonl").write_text("".join(l + "\n" for l in (resumed / "metrics.jsonl").read_text().splitlines()
                                                   if json.loads(l).get("step", 0) <= at))
    assert main(["train", "--config", str(TINY), "--data", str(tiny_data), "--run", str(resumed), *ARGS, *extra]) == 0
    assert f"resumed from step_{at:06d}" in (resumed / "train.log").read_text()
    return resumed


@pytest.mark.slow
@pytest.mark.skipif(MSRUN is None, reason="msrun not installed with MindSpore")
def test_sharded_gradients_with_accumulation_match_one_process_and_resume_at_world_1(tmp_path, tiny_data, reference_run):
    """ZeRO-2 on 2 msrun workers, 2 micro-batches each (a reduce-scatter per micro-batch, bucketed
    AllGather after the update) against one process without accumulation: losses, grad norms,
    the final model and optimizer files, identical replicas; one process resumes it at step 5 and,
    after resumed updates, has the unbroken run's weights and moments."""
    two = tmp_path / "zero2"
    _msrun(tmp_path, tiny_data, two, "optim.shard_gradients=true", "train.micro_batch=1")
    assert "optimizer state and gradients sharded over 2 ranks" in (two / "train.log").read_text()
    one, got = _metrics(reference_run), _metrics(two)
    assert sorted(got) == STEPS
    for step in one:
        assert abs(one[step] - got[step]) <= 1e-5, (step, one[step], got[step])
    one_gn, got_gn = _grad_norms(reference_run), _grad_norms(two)
    for step in one_gn:
        assert got_gn[step] == pytest.approx(one_gn[step], rel=1e-5), (step, one_gn[step], got_gn[step])
    hashes = _replica_hashes(two)
    assert len(hashes) == 2 and hashes[0] == hashes[1]
    assert_same_checkpoint(_step_dir(two, FINAL), _step_dir(reference_run, FINAL), 1e-5)

    resumed = _resume_on_one_process(two, tiny_data, tmp_path, 5)
    after, after_gn = _metrics(resumed), _grad_norms(resumed)
    for step in range(6, FINAL + 1):
        assert abs(after[step] - one[step]) <= 1e-5, (step, one[step], after[step])
        assert after_gn[step] == pytest.approx(one_gn[step], rel=1e-5)
        assert_same_checkpoint(_step_dir(resumed, step), _step_dir(reference_run, step), 1e-5)


@pytest.mark.slow
@pytest.mark.skipif(MSRUN is None, reason="msrun not installed with MindSpore")
def test_sharded_gradients_fp16_masters_one_collective_per_parameter(tmp_path, tiny_data):
    """fp16 compute with fp16 matrices and sharded fp32 masters, ZeRO-2, and `bucket_mb = 0` (the
    per-parameter collectives) on 2 workers, against the same config on one process."""
    from mspretrain.cli import main

    fp16 = ["precision.dtype=fp16", "precision.param_dtype=compute", "precision.loss_scale=static"]
    one = tmp_path / "one-fp16"
    assert main(["train", "--config", str(TINY), "--data", str(tiny_data), "--run", str(one), *ARGS, "train.log_every=1", *fp16]) == 0
    two = tmp_path / "zero2-fp16"
    _msrun(tmp_path, tiny_data, two, *fp16, "optim.shard_gradients=true", "optim.bucket_mb=0")
    a, b = _metrics(one), _metrics(two)
    assert sorted(a) == sorted(b) == STEPS
    # The two ranks sum the gradients in another order, and fp16 weights can round the other way
    # from there: 1e-5 over the 5 steps, measured 1.7e-5 at step 7 of 8.
    for step in a:
        assert abs(a[step] - b[step]) <= (1e-5 if step <= 5 else 1e-4), (step, a[step], b[step])
    hashes = _replica_hashes(two)
    assert len(hashes) == 2 and hashes[0] == hashes[1]
    # fp16 weights: one ulp is ~1e-3 relative, and summation order flips some roundings (measured
    # 1.6e-4 and 7.7e-4 in two runs), as in the fp16-wire test of test_distributed.py
    assert_same_checkpoint(_step_dir(two, FINAL), _step_dir(one, FINAL), 5e-3)


@pytest.mark.slow
@pytest.mark.skipif(MSRUN is None, reason="msrun not installed with MindSpore")
def test_sharded_gradients_with_frozen_groups_match_one_process(tmp_path, tiny_data):
    """train.trainable = ["embeddings", "lm_head"] under ZeRO-2 with accumulation on 2 workers: owners,
    buckets, moments and buffers cover only the trained parameters, yet losses and both files match
    one process; the frozen parameters are bit-identical to one process's (which never moved them)."""
    from safetensors.numpy import load_file

    from mspretrain.cli import main

    steps = 3
    args = [f"train.max_steps={steps}", f"checkpoint.every={steps}", "train.log_every=1", "--quiet",
            'train.trainable=["embeddings", "lm_head"]']
    one = tmp_path / "one-frozen"
    assert main(["train", "--config", str(TINY), "--data", str(tiny_data), "--run", str(one), *args]) == 0
    two = tmp_path / "zero2-frozen"
    _msrun(tmp_path, tiny_data, two, "optim.shard_gradients=true", "train.micro_batch=1", args=args)
    a, b = _metrics(one), _metrics(two)
    assert sorted(a) == sorted(b) == list(range(1, steps + 1))
    for step in a:
        assert abs(a[step] - b[step]) <= 1e-5, (step, a[step], b[step])
    hashes = _replica_hashes(two)
    assert len(hashes) == 2 and hashes[0] == hashes[1]
    assert_same_checkpoint(_step_dir(two, steps), _step_dir(one, steps), 1e-5)
    wa, wb = (load_file(str(_step_dir(r, steps) / "model.safetensors")) for r in (one, two))
    frozen = [k for k in wa if k not in ("embed.weight", "lm_head.weight")]
    assert frozen and all(np.array_equal(wa[k], wb[k]) for k in frozen)
    shards = sorted(_step_dir(two, steps).glob("optimizer-*.safetensors"))
    keys = set().union(*(load_file(str(s)).keys() for s in shards))
    assert len(shards) == 2 and keys == {"opt_step"} | {f"{m}.{n}" for m in ("exp_avg", "exp_avg_sq") for n in ("embed.weight", "lm_head.weight")}
