"""Expert parallel's checkpoint files, on the host and without launching ranks: each rank of one
layout writes its own (step/ep.py `model_slices`, `optimizer_state`: its experts' slices of the
stacks, rank 0 the rest), and each rank of another reads back only what it holds (`expert_ranges`,
`keys_to_read`, `load_weights`, `load_optimizer_state`) — the values of the whole model's weights and
state, cut to its experts. The msrun runs of tests/train/test_moe_ep.py train through the same
calls; this pins the re-cut between ep layouts (ep 2 -> ep 4, ep 2 -> ep 2 x edp 2 with ZeRO-1)
that those runs do not all take."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from mspretrain.checkpoint.model_shards import model_shard_name, read_pieces, read_whole, shard_metadata
from mspretrain.checkpoint.store import optimizer_keys, optimizer_shard_name, read_optimizer_tensors
from mspretrain.checkpoint.tensor_file import save_tensors
from mspretrain.config import schema as cfgmod
from mspretrain.model.parallel import cut
from mspretrain.parallel.shard_key import parse_shard_key

MOE = {"family": "qwen3_moe", "qk_norm": True, "head_dim": 16, "num_experts": 4, "experts_per_token": 2,
       "moe_ffn_dim": 32, "n_layers": 1}


def _step(monkeypatch, tiny_cfg, *, world: int, rank: int, ep: int, zero: int, seed: int):
    """Rank `rank`'s EPTrainStep of the tiny MoE (fp32, CPU) on `world` ranks, built without `init()`."""
    from mindspore.ops.operations import comm_ops

    from mspretrain.model.decoder import Decoder
    from mspretrain.parallel.plan import ParallelPlan
    from mspretrain.step.ep import EPTrainStep, expert_mesh

    plan = ParallelPlan(world=world, rank=rank, ep=ep, zero=zero)
    mesh = expert_mesh(plan, "cpu", create=False)
    sizes = {g.name: g.size for g in (mesh.ep, mesh.edp) if g.name}
    ranks = {g.name: g.rank for g in (mesh.ep, mesh.edp) if g.name}
    monkeypatch.setattr(comm_ops, "get_rank", lambda group=None: ranks.get(group, rank))
    monkeypatch.setattr(comm_ops, "get_group_size", lambda group=None: sizes.get(group, world))
    model = Decoder(cfgmod.resolve_model(replace(tiny_cfg.model, **MOE), 512), seed=seed)
    model.apply_ep(mesh.ep)
    optim = replace(tiny_cfg.optim, shard_optimizer=zero >= 1, bucket_mb=0.01)
    return EPTrainStep(model, optim, mesh=mesh, plan=plan, global_tokens=64, device="cpu")


@pytest.fixture(scope="module")
def whole(tiny_cfg):
    """The whole model's weights (seed 0) and a whole optimizer state of distinct values."""
    from mspretrain.model.decoder import Decoder, state_numpy

    weights = state_numpy(Decoder(cfgmod.resolve_model(replace(tiny_cfg.model, **MOE), 512), seed=0))
    rng = np.random.default_rng(5)
    state = {f"{kind}.{k}": rng.standard_normal(v.shape).astype(np.float32) for k, v in weights.items()
             for kind in ("exp_avg", "exp_avg_sq")}
    state["opt_step"] = np.array([7], np.int64)
    return {k: v.copy() for k, v in weights.items()}, state


def _write(monkeypatch, tiny_cfg, whole, folder, *, world: int, ep: int, zero: int) -> None:
    """Every rank of the layout: the whole state loaded (a one-process checkpoint resumed at ep), then
    its own files written as a save writes them."""
    weights, state = whole
    for rank in range(world):
        step = _step(monkeypatch, tiny_cfg, world=world, rank=rank, ep=ep, zero=zero, seed=0)
        step.load_optimizer_state({k: state[k] for k in step.keys_to_read(set(state))}, available=set(state))
        part, shapes = step.model_slices()
        save_tensors(part, folder / model_shard_name(rank, world), shard_metadata(1, shapes))
        save_tensors(step.optimizer_state(), folder / optimizer_shard_name(rank, world))


def _check_rank(step, whole) -> None:
    """This rank's weights and state are the whole ones cut to its experts (its ZeRO shard of the rest)."""
    from mspretrain.model.decoder import state_numpy

    weights, state = whole
    for name, value in state_numpy(step.model).items():
        assert np.array_equal(value, cut(weights[name], step.piece_where.get(name))), name
    ranges = step.expert_ranges()
    for key, value in step.optimizer_state().items():
        logical, rng = parse_shard_key(key)
        flat = state[logical].reshape(-1)
        want = flat[rng[0]:rng[1]] if rng else state[logical]
        assert np.array_equal(np.asarray(value).reshape(-1), np.asarray(want).reshape(-1)), key
        if logical.split(".", 1)[-1] in ranges:
            assert rng == ranges[logical.split(".", 1)[-1]], key  # the experts' state: this rank's range only


@pytest.mark.parametrize("to", [(4, 4, 0), (4, 2, 1)], ids=["ep4", "ep2xedp2-zero1"])
def test_an_ep2_checkpoint_is_read_back_at_another_ep_layout(monkeypatch, tiny_cfg, whole, tmp_path, to):
    _write(monkeypatch, tiny_cfg, whole, tmp_path, world=2, ep=2, zero=0)
    joined = read_whole(tmp_path)  # any layout's reader: the whole weights
    assert sorted(joined) == sorted(whole[0]) and all(np.array_equal(joined[k], v) for k, v in whole[0].items())
    with_slices = [k for k in optimizer_keys(tmp_path) if "@" in k]
    assert with_slices and all(".mlp.w13." in k or ".mlp.w2." in k for k in with_slices)  # only the experts' state is sliced
    world, ep, zero = to
    available = optimizer_keys(tmp_path)
    for rank in range(world):
        step = _step(monkeypatch, tiny_cfg, world=world, rank=rank, ep=ep, zero=zero, seed=1)  # other values before the load
        wanted = step.expert_ranges()
        pieces = read_pieces(tmp_path, wanted)
        assert all(pieces[k].size == b - a for k, (a, b) in wanted.items())  # read: its experts' rows, not the stacks
        step.load_weights(pieces)
        keys = step.keys_to_read(available)
        step.load_optimizer_state(read_optimizer_tensors(tmp_path, keys=keys), available=available)
        _check_rank(step, whole)
