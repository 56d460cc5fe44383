"""`train.ema_decay` (train/ema.py): the run's EMA of the fp32 weights, updated after every applied
step, saved beside each checkpoint (whole on one process, per rank under ZeRO-1/2/3), restored on
resume so that a killed and resumed run's EMA is the unbroken run's, and made a checkpoint of its
own by `mspretrain average --from-ema`."""
from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from safetensors.numpy import load_file

from mspretrain.parallel.plan import ParallelPlan
from tests.conftest import TINY, copy_run_at
from tests.helpers.cli import assert_refusal, cli

DECAY = 0.5  # strong, so that every step's weights show in the average
ARGS = ("train.max_steps=4", "checkpoint.every=1", "checkpoint.keep_last=4", "model.n_layers=1", "eval.at_end=false",
        "schedule.warmup_steps=1", f"train.ema_decay={DECAY}", "--quiet")


def _recursion(weights: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """e_1 = w_1, e_t = e_{t-1} - (1 - d) (e_{t-1} - w_t), in float32 as train/ema.py computes it."""
    e = {k: v.astype(np.float32).copy() for k, v in weights[0].items()}
    for w in weights[1:]:
        for k in e:
            e[k] = e[k] - (e[k] - w[k]) * np.float32(1 - DECAY)
    return e


@pytest.fixture(scope="module")
def ema_run(tmp_path_factory, tiny_data) -> Path:
    """Four steps with a checkpoint after each, the EMA kept. Read-only."""
    from mspretrain.cli import main

    run = tmp_path_factory.mktemp("ema") / "run"
    assert main(["train", "--config", str(TINY), "--data", str(tiny_data), "--run", str(run), *ARGS]) == 0
    return run


def test_the_ema_is_saved_verified_and_equals_the_recursion_over_each_steps_weights(ema_run, capsys):
    from mspretrain.checkpoint import store

    ck = ema_run / "checkpoints"
    weights = [load_file(str(ck / f"step_00000{s}" / "model.safetensors")) for s in (1, 2, 3, 4)]
    for s in (1, 2, 3, 4):
        d = ck / f"step_00000{s}"
        assert "ema.safetensors" in json.loads((d / "manifest.json").read_text())["files"]
        assert store.verify(d) is None
        got, want = load_file(str(d / "ema.safetensors")), _recursion(weights[:s])
        assert sorted(got) == sorted(want)
        for k in want:
            assert got[k].dtype == np.float32 and np.array_equal(got[k], want[k]), (s, k)
    assert not np.array_equal(load_file(str(ck / "step_000004" / "ema.safetensors"))["embed.weight"], weights[3]["embed.weight"])
    code, out, _ = cli(capsys, "checkpoints", ema_run, "--verify")
    assert code == 0 and out.count("verified") == 4, out


def test_a_killed_and_resumed_runs_ema_is_the_unbroken_runs(ema_run, tmp_path, tiny_data, capsys):
    resumed = copy_run_at(ema_run, tmp_path / "resumed", 2)  # what a crash after the save of step 2 leaves
    code, _, err = cli(capsys, "train", "--config", TINY, "--data", tiny_data, "--run", resumed, *ARGS)
    assert code == 0, err
    for name in ("ema.safetensors", "model.safetensors"):
        a = load_file(str(ema_run / "checkpoints" / "step_000004" / name))
        b = load_file(str(resumed / "checkpoints" / "step_000004" / name))
        assert all(a[k].tobytes() == b[k].tobytes() for k in a), name


def test_average_from_ema_makes_the_ema_a_checkpoint(ema_run, tmp_path, capsys):
    out = tmp_path / "ema-ckpt"
    code, _, err = cli(capsys, "average", ema_run, "--last", "1", "--from-ema", "--out", out)
    assert code == 0, err
    want = load_file(str(ema_run / "checkpoints" / "step_000004" / "ema.safetensors"))
    got = load_file(str(out / "model.safetensors"))
    assert all(np.array_equal(got[k], want[k]) for k in want)
    state = json.loads((out / "train_state.json").read_text())
    assert state["averaged"]["from_ema"] and list(state["averaged"]["sources"][0]["sha256"]) == ["ema.safetensors"]
    # a checkpoint without an EMA: refused in one line, nothing written
    from mspretrain.checkpoint import store
    from mspretrain.config import schema as cfgmod

    plain = tmp_path / "plain"
    store.write_checkpoint_dir(plain / "checkpoints" / "step_000001", step=1, model={"w": np.zeros(4, np.float32)}, optimizer=None,
                               train_state={}, data_state=None, config=cfgmod.load(TINY))
    code, _, err = cli(capsys, "average", plain, "--last", "1", "--from-ema")
    assert_refusal(code, err, "holds no EMA")
    assert not (plain / "averaged").exists()


def test_bad_decays_and_unsupported_layouts_are_refused_in_one_line(capsys, tiny_data, tmp_path):
    for value in ("1", "-0.1", "1.5"):
        code, _, err = cli(capsys, "train", "--config", TINY, "--data", tiny_data, "--run", tmp_path / "r", f"train.ema_decay={value}")
        assert_refusal(code, err, "train.ema_decay")
    assert not (tmp_path / "r").exists()
    from mspretrain.config import schema as cfgmod
    from mspretrain.errors import UserError
    from mspretrain.train.ema import for_run

    cfg = cfgmod.load(TINY, ["train.ema_decay=0.9", "precision.dtype=fp16", "precision.param_dtype=compute"])
    with pytest.raises(UserError, match="param_dtype"):
        for_run(cfg, None, None, rank=0, world=1)
    assert for_run(cfgmod.load(TINY), None, None, rank=0, world=1) is None  # off by default


def test_zero3_ranks_keep_and_save_their_slices_which_read_back_at_any_world(tmp_path, monkeypatch, tiny_cfg, capsys):
    """Two ZeRO-3 ranks built in this process (as tests/checkpoint/test_zero3_checkpoint.py does) each keep the
    EMA of their slices and save `ema-R-of-2` through the real Saver (rank 1 staged, rank 0
    publishing); average --from-ema joins them, and a one-process EMA loads them whole."""
    import mindspore as ms
    from mindspore.ops.operations import comm_ops

    from mspretrain.checkpoint.model_shards import shard_metadata
    from mspretrain.checkpoint.saver import Saver
    from mspretrain.config.schema import ModelConfig, resolve_model
    from mspretrain.model.decoder import Decoder, load_numpy, state_numpy
    from mspretrain.parallel.layout import slice_bounds
    from mspretrain.step.zero3 import gathered, shard_model, slice_state
    from mspretrain.train.ema import for_run

    cfg = replace(tiny_cfg, train=replace(tiny_cfg.train, ema_decay=DECAY),
                  model=resolve_model(ModelConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=2), vocab_size=256))
    rng = np.random.default_rng(0)
    base = state_numpy(Decoder(cfg.model, seed=0))
    steps = [{k: (v + rng.normal(0, 0.1, v.shape)).astype(np.float32) for k, v in base.items()} for _ in range(3)]
    saver = Saver(tmp_path / "run", keep_last=3, keep_every=0, async_save=False, log=lambda s: None)
    for rank in (1, 0):  # rank 1 stages its files first; rank 0 waits for them and publishes
        monkeypatch.setattr(comm_ops, "get_rank", lambda group=None, r=rank: r)
        monkeypatch.setattr(comm_ops, "get_group_size", lambda group=None: 2)
        model = Decoder(cfg.model, seed=0)
        load_numpy(model, steps[0])
        shard_model(model, [p.name for p in model.trainable_params()], 2, rank, "cpu")
        ema = for_run(cfg, model, SimpleNamespace(plan=ParallelPlan(world=2, rank=rank, zero=3)), rank=rank, world=2)
        sharded = {name for name, _, _ in gathered(model)}
        for w in steps:  # each "step": this rank's slices take the step's weights
            for p in model.get_parameters():
                flat = w[p.name].reshape(-1)
                if p.name in sharded:  # rank r's slice, cut as step/zero3.py slice_state cuts it
                    a, b = slice_bounds(flat.size, 2, rank)
                    flat = flat[a:b]
                p.set_data(ms.Tensor(flat.reshape(p.shape)))
            ema.update()
        part, shapes = slice_state(model, 2, rank)
        files = ema.files(3)
        assert list(files) == [f"ema-0000{rank}-of-00002.safetensors"]
        assert all("@" in k for k in files[next(iter(files))][0] if k.startswith("layers"))
        if rank == 1:
            saver.save_shard(step=3, rank=1, world=2, optimizer={"opt_step": np.array([3], np.int64)}, model=part,
                             model_metadata=shard_metadata(3, shapes), extra=files)
        else:
            saver.save(step=3, model=part, optimizer={"opt_step": np.array([3], np.int64)}, train_state={"applied_steps": 3},
                       data_state={}, config=cfg, tokenizer_path=None, world=2, model_metadata=shard_metadata(3, shapes),
                       extra=files)
    saver.close()
    ckpt = tmp_path / "run" / "checkpoints" / "step_000003"
    want = _recursion(steps)
    code, _, err = cli(capsys, "average", tmp_path / "run", "--last", "1", "--from-ema", "--out", tmp_path / "avg")
    assert code == 0, err
    got = load_file(str(tmp_path / "avg" / "model.safetensors"))
    for k in want:
        assert np.max(np.abs(got[k] - want[k])) <= 1e-7, k
    # one process resumes the two ranks' EMA whole
    one = for_run(cfg, Decoder(cfg.model, seed=0), SimpleNamespace(plan=ParallelPlan()), rank=0, world=1)
    one.load(ckpt, log=lambda s: None)
    for k, v in zip(one.keys, one.values):
        assert np.array_equal(v, want[k].reshape(-1)), k
    assert math.isfinite(float(sum(v.sum() for v in one.values)))


def test_a_checkpoint_without_an_ema_starts_one_afresh_and_says_so(tmp_path):
    """train.ema_decay turned on for a run whose checkpoints have none (or all steps skipped so
    far): the resume logs it, and the next applied step starts the average at its weights."""
    from mspretrain.checkpoint import store
    from mspretrain.config import schema as cfgmod
    from mspretrain.train.ema import WeightEMA

    class P:
        def __init__(self, x):
            self.x, self.shape, self.name = x, x.shape, "w"

        def asnumpy(self):
            return self.x

    p = P(np.arange(6, dtype=np.float32).reshape(2, 3))
    ema = WeightEMA(DECAY, [p], keys=["w"], file_name="ema.safetensors", shapes=None, wanted={})
    assert ema.files(1) == {}  # nothing to save before the first update
    ema.update()
    ckpt = store.write_checkpoint_dir(tmp_path / "step_000001", step=1, model={"w": p.x}, optimizer=None, train_state={},
                                      data_state=None, config=cfgmod.load(TINY))
    said = []
    ema.load(ckpt, said.append)
    assert ema.values is None and "holds no EMA" in said[0]
    p.x = p.x + 1
    ema.update()
    assert np.array_equal(ema.files(2)["ema.safetensors"][0]["w"], p.x)


def _zero2(cfg, world: int, rank: int):
    """Rank `rank` of a ZeRO-2 run at `world` emulated in this process: the model (weights whole on
    every rank under ZeRO-1/2) and a step stand-in carrying the real ownership (step/zero_setup.py
    `plan_zero`, what TrainStep plans) and masters (step/state_codec.py), with split_mb small enough that the embedding and lm_head
    are cut into a slice per rank and the other parameters go whole to one owner each; the final
    norm is left untrained (as train.trainable leaves parameters out), so rank 0 keeps its EMA whole."""
    from mspretrain.model.decoder import Decoder
    from mspretrain.step.state_codec import OptimizerState
    from mspretrain.step.zero_setup import plan_zero

    model = Decoder(cfg.model, seed=0)
    params = tuple(p for p in model.trainable_params() if p.name != "norm.weight")
    z = plan_zero(params, [math.prod(p.shape) for p in params], set(), None, world=world, rank=rank, device="cpu",
                  zero3=False, shard=True, shard_grads=True, allreduce_fp16=False, bucket_mb=0.05, split_mb=0.05)
    masters = OptimizerState(params, (), z.ownership).masters
    return model, SimpleNamespace(plan=ParallelPlan(world=world, rank=rank, zero=2), zero_setup=z, own_masters=masters)


def _apply(model, step_fn, w: dict[str, np.ndarray]) -> None:
    """A ZeRO-1/2 step's end state: `w` in every rank's weights and in this rank's master slices."""
    import mindspore as ms

    for p in model.get_parameters():
        p.set_data(ms.Tensor(w[p.name]))
    o = step_fn.zero_setup.ownership
    for k, i in enumerate(o.own):
        if o.split[k]:
            a, b = o.bounds[k]
            step_fn.own_masters[k].set_data(ms.Tensor(w[o.names[i]].reshape(-1)[a:b].copy()))


def test_zero2_ranks_keep_save_and_resume_the_ema_of_what_they_own(tmp_path, tiny_cfg, capsys):
    """ZeRO-2 at world 2: each rank keeps the EMA of exactly the parameters / slices whose masters
    it owns and writes `ema-R-of-2` (ZeRO-3's per-rank format) through the real Saver; the union of
    the files is the one-process EMA, bit for bit; a resume reads each rank's part back, at world 2,
    at world 3 (other owners, other slices) and whole on one process; average --from-ema reads it."""
    from mspretrain.checkpoint.model_shards import parse_key
    from mspretrain.checkpoint.saver import Saver
    from mspretrain.config.schema import ModelConfig, resolve_model
    from mspretrain.model.decoder import Decoder, state_numpy
    from mspretrain.train.ema import for_run

    cfg = replace(tiny_cfg, train=replace(tiny_cfg.train, ema_decay=DECAY),
                  model=resolve_model(ModelConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=2), vocab_size=256))
    rng = np.random.default_rng(1)
    base = state_numpy(Decoder(cfg.model, seed=0))
    steps = [{k: (v + rng.normal(0, 0.1, v.shape)).astype(np.float32) for k, v in base.items()} for _ in range(3)]
    want = _recursion(steps)
    saver = Saver(tmp_path / "run", keep_last=3, keep_every=0, async_save=False, log=lambda s: None)
    emas = {}
    for rank in (1, 0):  # rank 1 stages its files first; rank 0 waits for them and publishes
        model, step_fn = _zero2(cfg, 2, rank)
        o = step_fn.zero_setup.ownership
        assert any(o.split) and not all(o.split)  # both kinds of unit on every rank
        ema = emas[rank] = for_run(cfg, model, step_fn, rank=rank, world=2)
        for w in steps:
            _apply(model, step_fn, w)
            ema.update()
        files = ema.files(3)
        assert list(files) == [f"ema-0000{rank}-of-00002.safetensors"]
        # a split parameter's EMA follows its 1-D master slice, not the whole weight
        assert all(len(p.shape) == 1 for k, p in zip(ema.keys, ema.params) if "@" in k)
        opt = {"opt_step": np.array([3], np.int64)}
        if rank == 1:
            saver.save_shard(step=3, rank=1, world=2, optimizer=opt, extra=files)
        else:
            saver.save(step=3, model=steps[-1], optimizer=opt, train_state={"applied_steps": 3}, data_state={}, config=cfg,
                       tokenizer_path=None, world=2, extra=files)
    saver.close()
    ckpt = tmp_path / "run" / "checkpoints" / "step_000003"
    # no rank's file holds what it does not own; together they cover every parameter exactly once
    layout, names = step_fn.zero_setup.layout, step_fn.zero_setup.ownership.names
    for rank in (0, 1):
        stored = load_file(str(ckpt / f"ema-0000{rank}-of-00002.safetensors"))
        for key, value in stored.items():
            name, rng = parse_key(key)
            if name not in names:  # untrained: rank 0's, whole
                assert rank == 0 and rng is None and name == "norm.weight", key
                assert np.array_equal(value, want[name]), key
                continue
            i = names.index(name)
            assert i in layout.owned(rank), key
            assert (rng or (0, value.size)) == layout.unit(i, rank), key
            a, b = layout.unit(i, rank)
            assert np.array_equal(value.reshape(-1), want[name].reshape(-1)[a:b]), key
    code, _, err = cli(capsys, "checkpoints", tmp_path / "run", "--verify")
    assert code == 0, err
    code, _, err = cli(capsys, "average", tmp_path / "run", "--last", "1", "--from-ema", "--out", tmp_path / "avg")
    assert code == 0, err
    got = load_file(str(tmp_path / "avg" / "model.safetensors"))
    assert sorted(got) == sorted(want) and all(np.array_equal(got[k], want[k]) for k in want)
    # resume: each rank of world 2 reads back its own part; world 3 re-cuts it; one process reads it whole
    for world in (2, 3):
        for rank in range(world):
            model, step_fn = _zero2(cfg, world, rank)
            again = for_run(cfg, model, step_fn, rank=rank, world=world)
            again.load(ckpt, log=lambda s: None)
            if world == 2:
                assert again.keys == emas[rank].keys
                assert all(np.array_equal(a, b) for a, b in zip(again.values, emas[rank].values))
            for key, value in zip(again.keys, again.values):
                name, rng = parse_key(key)
                a, b = rng or (0, value.size)
                assert np.array_equal(value, want[name].reshape(-1)[a:b]), (world, rank, key)
    one = for_run(cfg, Decoder(cfg.model, seed=0), SimpleNamespace(plan=ParallelPlan()), rank=0, world=1)
    one.load(ckpt, log=lambda s: None)
    assert all(np.array_equal(v, want[k].reshape(-1)) for k, v in zip(one.keys, one.values))
