"""Tensor parallel (`parallel.tp`, model/parallel.py and step/tp.py): the vocabulary-parallel loss
against the plain one with a loopback peer, the cut of every weight against its HF tensors, the
mesh, the refusals; then msrun ranks against one process, and resumes across layouts."""
from __future__ import annotations

import os
import shutil
from dataclasses import replace
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor

from mspretrain.errors import UserError
from tests.conftest import EVAL_AT_END, TINY, assert_same_checkpoint, copy_run_at
from tests.helpers.killed import LONG, ended_within, start_launch, wait_for_rank
from tests.helpers.runs import FINAL, MSRUN, STEPS, final_nll, grad_norms, kill_tree, losses, msrun, replica_hashes, step_dir


def _cfg(**kw):
    from mspretrain.config.schema import ModelConfig, resolve_model

    return resolve_model(ModelConfig(**{"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, **kw}), vocab_size=96)


# ---- the vocabulary-parallel loss

def _plain(logits: np.ndarray, targets: np.ndarray, w_nll: np.ndarray, w_lse: np.ndarray):
    from mspretrain.model.loss import token_nll

    def f(x):
        nll, lse = token_nll(x, Tensor(targets))
        return (nll * Tensor(w_nll)).sum() + (lse * Tensor(w_lse)).sum(), nll, lse

    (_, nll, lse), grad = ms.value_and_grad(f, has_aux=True)(Tensor(logits))
    return nll.asnumpy(), lse.asnumpy(), grad.asnumpy()


@pytest.mark.parametrize("rank", [0, 1])
def test_vocab_parallel_loss_equals_the_plain_one_with_a_loopback_peer(world_of, rank):
    """Rank `rank` of tp 2 with its three tp sums replaced by loopbacks that add what the peer
    holds (its slot's max, its sum of exp, its target logit: numpy from the peer's columns): the
    NLL and log-sum-exp of every token are the plain loss's, and the gradient of the local logits
    is the plain gradient's columns (loss and z-loss terms weighted)."""
    from mspretrain.model.parallel import Group, VocabParallelNLL

    world_of(rank, 2)
    rng = np.random.default_rng(0)
    B, T, V = 2, 5, 12
    half = V // 2
    logits = (rng.standard_normal((B, T, V)) * 3).astype(np.float32)
    logits[0, 0, 7] = 40.0  # a large logit on rank 1's side: the max must be the global one
    targets = rng.integers(0, V, (B, T)).astype(np.int32)
    targets[0, :2] = (3, 9)
    w_nll, w_lse = rng.random((B, T)).astype(np.float32), rng.random((B, T)).astype(np.float32)
    want_nll, want_lse, want_grad = _plain(logits, targets, w_nll, w_lse)

    peer = 1 - rank
    mine, theirs = logits[..., rank * half:(rank + 1) * half], logits[..., peer * half:(peer + 1) * half]
    gmax = logits.max(-1)
    peer_max = np.zeros((2, B, T), np.float32)
    peer_max[peer] = theirs.max(-1)
    peer_sum = np.exp(theirs.astype(np.float64) - gmax[..., None]).sum(-1).astype(np.float32).reshape(-1)
    local_t = targets - peer * half
    inside = (local_t >= 0) & (local_t < half)
    peer_picked = np.where(inside, np.take_along_axis(theirs, np.clip(local_t, 0, half - 1)[..., None], -1)[..., 0], 0)

    cell = VocabParallelNLL(rank * half, half, Group((0, 1), rank))
    cell.core.max.op = lambda x: x + Tensor(peer_max)
    cell.core.sum_exp = lambda x: x + Tensor(peer_sum)
    cell.core.sum_target = lambda x: x + Tensor(peer_picked.astype(np.float32))

    def f(x):
        nll, lse = cell(x, Tensor(targets))
        return (nll * Tensor(w_nll)).sum() + (lse * Tensor(w_lse)).sum(), nll, lse

    (_, nll, lse), grad = ms.value_and_grad(f, has_aux=True)(Tensor(np.ascontiguousarray(mine)))
    np.testing.assert_allclose(nll.asnumpy(), want_nll, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(lse.asnumpy(), want_lse, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(grad.asnumpy(), want_grad[..., rank * half:(rank + 1) * half], rtol=1e-5, atol=1e-7)


def test_group_max_and_broadcast_on_cpu_are_sums(world_of):
    """mccl has AllReduce(SUM) only and broadcasts in the world group only: a group's max sums one
    slot per member and takes the max over the slots; a broadcast in a sub-group is a sum to which
    the members other than the root give zeros. Ascend uses AllReduce(MAX) and Broadcast."""
    from mindspore import ops

    from mspretrain.model.parallel import Group, GroupBroadcast

    world_of(3, 4)
    g = Group((1, 3), 1, name="dp_1")  # the dp group of tp rank 1 in tp 2 x dp 2: rank 3 is its member 1
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    m = g.max()
    seen = []
    peer = np.zeros((2, 2, 3), np.float32)  # member 0's 2.5 in slot 0
    peer[0] = 2.5
    m.op = lambda buf: (seen.append(buf.asnumpy()), buf + Tensor(peer))[1]
    assert np.array_equal(m(Tensor(x)).asnumpy(), np.maximum(x, 2.5))
    assert not seen[0][0].any() and np.array_equal(seen[0][1], x)  # this member wrote its own slot only
    b = g.broadcast(0)
    assert isinstance(b, GroupBroadcast)
    b.sum = lambda v: v
    assert not b((Tensor(x),))[0].asnumpy().any()  # member 1 is not the root: zeros go in
    assert isinstance(g.broadcast(1).sum, ops.AllReduce)
    npu = Group((1, 3), 1, name="dp_1", device="ascend")
    assert isinstance(npu.broadcast(0), ops.Broadcast) and isinstance(npu.max().op, ops.AllReduce) and npu.max().native
    # HCCL reads Broadcast's root as the rank inside the group: member 1, not world rank 3
    assert npu.broadcast(1).attrs["root_rank"] == 1 and npu.broadcast(1).attrs["group"] == "dp_1"


# ---- the cut of the weights

def test_each_ranks_pieces_are_the_hf_tensors_rows_and_columns_and_join_back(world_of):
    """Qwen2-style (q/k/v bias), untied: rank r's piece of every parameter is the HF tensors' rows
    (q, k, v, gate, up, embedding, lm_head) or columns (o, down) of its heads / ffn units / vocabulary
    block; placing every rank's pieces and summing gives the whole tensor back; norms replicated."""
    from mspretrain.model.decoder import Decoder, state_numpy
    from mspretrain.model.hf import hf_to_ours, ours_to_hf
    from mspretrain.model.parallel import cut, place, tp_rows

    cfg = _cfg(family="qwen2", qkv_bias=True)
    whole = {k: v.copy() for k, v in state_numpy(Decoder(cfg, seed=0)).items()}
    whole = {k: v + np.float32(0.5) if k.endswith("bias") else v for k, v in whole.items()}  # biases not all zeros
    hf = ours_to_hf(whole, cfg)
    H, KV, hd, F, V = cfg.n_heads, cfg.n_kv_heads, cfg.head_size, cfg.ffn_dim, cfg.vocab_size
    joined = {k: np.zeros_like(v) for k, v in whole.items()}
    for r in range(2):
        for name, value in whole.items():
            where = tp_rows(name, value.shape, cfg, 2, r)
            piece = cut(value, where)
            if where is None:
                assert "norm" in name
                joined[name] = value
                continue
            joined[name] += place(piece, where, value.shape)
        q = lambda n, k: hf[f"model.layers.0.self_attn.{n}_proj.{k}"]
        pieces = {name: cut(whole[name], tp_rows(name, whole[name].shape, cfg, 2, r)) for name in whole}
        hq, hk = slice(r * H // 2 * hd, (r + 1) * H // 2 * hd), slice(r * KV // 2 * hd, (r + 1) * KV // 2 * hd)
        for k in ("weight", "bias"):
            assert np.array_equal(pieces[f"layers.0.attn.wqkv.{k}"], np.concatenate([q("q", k)[hq], q("k", k)[hk], q("v", k)[hk]]))
        assert np.array_equal(pieces["layers.0.attn.wo.weight"], hf["model.layers.0.self_attn.o_proj.weight"][:, hq])
        fs = slice(r * F // 2, (r + 1) * F // 2)
        mlp = lambda n: hf[f"model.layers.0.mlp.{n}_proj.weight"]
        assert np.array_equal(pieces["layers.0.mlp.w13.weight"], np.concatenate([mlp("gate")[fs], mlp("up")[fs]]))
        assert np.array_equal(pieces["layers.0.mlp.w2.weight"], mlp("down")[:, fs])
        vs = slice(r * V // 2, (r + 1) * V // 2)
        assert np.array_equal(pieces["embed.weight"], hf["model.embed_tokens.weight"][vs])
        assert np.array_equal(pieces["lm_head.weight"], hf["lm_head.weight"][vs])
    for name in whole:
        assert np.array_equal(joined[name], whole[name]), name
    back = hf_to_ours(ours_to_hf(joined, cfg), cfg)
    assert all(np.array_equal(back[k], whole[k]) for k in whole)


def test_split_model_holds_the_pieces_under_the_whole_names(world_of):
    from mspretrain.model.decoder import Decoder, state_numpy
    from mspretrain.model.parallel import Group, cut, split_model, tp_rows

    world_of(1, 2)
    cfg = _cfg(tie_embeddings=True)
    whole = {k: v.copy() for k, v in state_numpy(Decoder(cfg, seed=0)).items()}
    model = Decoder(cfg, seed=0)
    names = [p.name for p in model.trainable_params()]
    split_model(model, Group((0, 1), 1))
    assert [p.name for p in model.trainable_params()] == names
    for p in model.trainable_params():
        assert np.array_equal(p.asnumpy(), cut(whole[p.name], tp_rows(p.name, whole[p.name].shape, cfg, 2, 1))), p.name
    assert model.local_heads == (2, 1) and model.layers[0].mlp.ffn == cfg.ffn_dim // 2
    assert set(model.tp_split.whole_shapes) == {n for n in names if "norm" not in n}
    assert "lm_head.weight" not in names  # tied: the head uses the embedding's rows


def test_every_weight_cell_declares_the_split_its_name_says():
    """The cells declare their tp role where they are built (model/layers.py `WeightCell`); the
    by-name view (`tp_rows`, for code holding names only) must agree for every parameter of a model
    with Qwen2's q/k/v bias and Qwen3's QK-norms, and every cell's role is one of the five."""
    from mspretrain.model.decoder import Decoder
    from mspretrain.model.layers import WeightCell
    from mspretrain.model.parallel import tp_rows
    from mspretrain.parallel.plan import ROLES, tp_where

    roles = {}
    for cfg in (_cfg(family="qwen2", qkv_bias=True), _cfg(family="qwen3", qk_norm=True, head_dim=16)):
        for _, cell in Decoder(cfg, seed=0).cells_and_names():
            if isinstance(cell, WeightCell):
                assert cell.role in ROLES
                for p in (cell.weight, cell.bias) if cell.has_bias else (cell.weight,):
                    roles[p.name] = cell.role
                    for r in (0, 1):
                        assert tp_where(cell.role, tuple(p.shape), cell.blocks, 2, r) == tp_rows(p.name, tuple(p.shape), cfg, 2, r), p.name
    assert roles["layers.0.attn.wqkv.bias"] == "column" and roles["layers.1.attn.k_norm.weight"] == "partial"
    assert {roles[n] for n in ("embed.weight", "lm_head.weight", "layers.0.mlp.w2.weight", "norm.weight")} == {"vocab", "row", "replicated"}


def test_the_vocabulary_parallel_lookup_and_every_row_parallel_sum_on_one_process(world_of):
    """Without msrun: (a) each tp rank's embedding looks up the rows of its vocabulary
    block [r·V/tp, (r+1)·V/tp) and zeros for the others, so the two ranks' partial lookups (their
    sum a loopback) add up to the whole lookup (a wrong offset gives other rows); (b) a forward
    passes every row-parallel layer's output (wo, w2 of each layer) and the embedding through its
    tp sum (ReduceFromTP), no other: a layer left without its all-reduce is missing here."""
    from mspretrain.model.decoder import Decoder, state_numpy
    from mspretrain.model.parallel import Group, ReduceFromTP, split_model

    cfg = _cfg()
    whole = state_numpy(Decoder(cfg, seed=0))["embed.weight"]
    tokens = Tensor(np.array([[0, 5, cfg.vocab_size // 2 - 1, cfg.vocab_size // 2, cfg.vocab_size - 1, 7]], np.int32))
    partial = []
    for rank in (0, 1):
        world_of(rank, 2)
        model = Decoder(cfg, seed=0)
        split_model(model, Group((0, 1), rank))
        assert (model.embed.tp.start, model.embed.tp.rows) == (rank * cfg.vocab_size // 2, cfg.vocab_size // 2)
        called = []
        for name, cell in model.cells_and_names():
            if isinstance(cell, ReduceFromTP):
                cell.sum = (lambda n, seen: lambda x: (seen.append(n), x)[1])(name, called)  # the peer contributes zeros
        partial.append(model.embed(tokens, model.embed.weight).asnumpy())
        called.clear()
        model(tokens)
        row_parallel = {f"layers.{i}.{m}.tp_out" for i in range(cfg.n_layers) for m in ("attn.wo", "mlp.w2")}
        assert sorted(called) == sorted(row_parallel | {"embed.tp.reduce"}), called
    assert np.array_equal(partial[0] + partial[1], whole[tokens.asnumpy()])
    assert not partial[0][0, 3:5].any() and not partial[1][0, [0, 1, 2, 5]].any()  # the other block's tokens: zeros


def test_qwen3_qk_norms_stay_whole_and_their_partial_gradients_are_summed_over_tp(world_of):
    """Each rank applies the shared QK-norm weights to its own heads only: the weights stay whole
    (replicated) and are marked partial; the step's PartialSum adds their gradients over tp in one
    collective and leaves every other gradient alone."""
    from mspretrain.model.decoder import Decoder
    from mspretrain.model.parallel import Group, PartialSum, split_model

    world_of(0, 2)
    model = Decoder(_cfg(family="qwen3", qk_norm=True, head_dim=16), seed=0)
    split_model(model, Group((0, 1), 0))
    assert model.tp_split.partial == {f"layers.{i}.attn.{n}.weight" for i in range(2) for n in ("q_norm", "k_norm")}
    assert all(p.shape == (16,) for p in model.get_parameters() if p.name in model.tp_split.partial)
    s = PartialSum([1, 3], [(2,), (3,)], Group((0, 1), 0))
    seen = []
    s.sum = lambda x: (seen.append(x.shape), x * 2)[1]
    grads = tuple(Tensor(np.full(shape, k + 1, np.float32)) for k, shape in enumerate([(4,), (2,), (1, 2), (3,)]))
    out = [g.asnumpy() for g in s(grads)]
    assert seen == [(5,)]
    assert [o.tolist() for o in out] == [[1] * 4, [4] * 2, [[3, 3]], [8] * 3]


def test_refusals_name_the_fix():
    from mspretrain.config import schema as cfgmod
    from mspretrain.model.parallel import check_tp
    from mspretrain.step.tp import make_mesh

    with pytest.raises(UserError, match="does not divide model.n_kv_heads = 2.*not replicate") as e:
        check_tp(_cfg(), 4)
    assert "parallel.tp=2" in str(e.value)
    with pytest.raises(UserError, match="vocab_size"):
        check_tp(replace(_cfg(), vocab_size=97), 2)
    with pytest.raises(UserError, match="does not divide the 3 ranks"):
        make_mesh(0, 3, 2, "cpu")
    base = cfgmod.load(TINY, ["parallel.tp=2"])
    cfgmod.validate(base)
    for override, key in (("optim.shard_parameters=true", "optim.shard_parameters"), ("optim.split_mb=64", "optim.split_mb")):
        with pytest.raises(UserError, match=key):
            cfgmod.validate(cfgmod.load(TINY, ["parallel.tp=2", override]))
    with pytest.raises(UserError, match="parallel.tp"):
        cfgmod.load(TINY, ["parallel.tp=0"])


def test_mesh_puts_tp_ranks_side_by_side():
    from mspretrain.step.tp import make_mesh

    m = make_mesh(3, 4, 2, "cpu", create=False)  # tp group 1 = ranks (2, 3); dp group of tp rank 1 = ranks (1, 3)
    assert (m.tp.ranks, m.tp.rank, m.tp.name) == ((2, 3), 1, "tp_1")
    assert (m.dp.ranks, m.dp.rank, m.dp.name) == ((1, 3), 1, "dp_1")
    m = make_mesh(1, 2, 2, "cpu")  # tp = world: plain world collectives, a single-rank dp group
    assert (m.tp.ranks, m.tp.rank, m.tp.name, m.dp.size) == ((0, 1), 1, None, 1)


def test_a_tp_step_cuts_its_state_from_whole_tensors_or_zero_slices(world_of, tiny_cfg):
    """Rank 1 of tp 2 (one process: no collective runs) loads whole weights and an optimizer state
    stored as a ZeRO run's slices (`exp_avg.NAME@START:STOP`, any cut) or whole: each tensor's
    piece is its tensor-parallel cut; `keys_to_read` asks for every stored slice of what it owns."""
    from mspretrain.config.schema import resolve_model
    from mspretrain.model.decoder import Decoder, state_numpy
    from mspretrain.model.parallel import Group, cut, split_model, tp_rows
    from mspretrain.step.step import TrainStep
    from mspretrain.step.tp import Mesh, TPTrainStep

    world_of(1, 2)
    cfg = resolve_model(tiny_cfg.model, vocab_size=512)
    model = Decoder(cfg, seed=0)
    whole = {k: v * 3 for k, v in state_numpy(model).items()}
    mesh = Mesh(Group((0, 1), 1), Group((1,), 0))
    split_model(model, mesh.tp)
    step = TPTrainStep(model, tiny_cfg.optim, mesh=mesh, global_tokens=64, jit=False)
    step.load_weights(whole)
    rng = np.random.default_rng(1)
    state = {"opt_step": np.array([5])}
    for name, value in whole.items():
        for kind in ("exp_avg", "exp_avg_sq"):
            v = rng.standard_normal(value.shape).astype(np.float32)
            state[f"{kind}.{name}"] = v
    stored = {"opt_step": state["opt_step"]}
    for key, v in state.items():
        if key.endswith("embed.weight"):  # slices of a ZeRO-1 run at world 3 (uneven)
            flat, n = v.reshape(-1), v.size
            for a, b in ((0, 11000), (11000, 22000), (22000, n)):
                stored[f"{key}@{a}:{b}"] = flat[a:b]
        else:
            stored[key] = v
    assert step.keys_to_read(set(stored)) == set(stored)
    step.load_optimizer_state(stored, available=set(stored))
    where = lambda n: tp_rows(n, whole[n].shape, cfg, 2, 1)
    for p in model.trainable_params():
        assert np.array_equal(p.asnumpy(), cut(whole[p.name], where(p.name))), p.name
    got = TrainStep.optimizer_state(step)  # the pieces, before the tp gather (a collective: step/tp.py WholeTensors)
    for key, v in got.items():
        if key != "opt_step":
            name = key.split(".", 1)[1]
            assert np.array_equal(v, cut(state[key], where(name))), key
    assert int(got["opt_step"]) == 5


def test_the_tp_replica_hash_sums_one_parameter_at_a_time(world_of, tiny_cfg):
    """The end-of-run hash summed every piece into the whole model at once on every
    rank's host (`full_weights`); `weights_digest` sums one parameter at a time over the tp group,
    with the bytes `full_weights` gives (rank 1 of tp 2, the tp sum a loopback)."""
    import hashlib

    from mspretrain.config.schema import resolve_model
    from mspretrain.model.decoder import Decoder
    from mspretrain.model.parallel import Group, split_model
    from mspretrain.step.tp import Mesh, TPTrainStep

    world_of(1, 2)
    model = Decoder(resolve_model(tiny_cfg.model, vocab_size=512), seed=0)
    mesh = Mesh(Group((0, 1), 1), Group((1,), 0))
    split_model(model, mesh.tp)
    step = TPTrainStep(model, tiny_cfg.optim, mesh=mesh, global_tokens=64, jit=False)
    step._sum_chunk = lambda x: x  # the peer contributes zeros
    whole = step.full_weights()
    sizes = []
    real = step._whole
    step._whole = lambda pieces: (sizes.append(len(pieces)), real(pieces))[1]
    want = hashlib.sha256(b"".join(n.encode() + a.tobytes() for n, a in sorted(whole.items()))).hexdigest()
    assert step.weights_digest() == want
    assert set(sizes) == {1} and len(sizes) == len(whole)  # one parameter summed at a time


def test_a_tp_steps_collectives_count_tensor_parallels_own(world_of, tiny_cfg):
    """The start-up line of a tp run with one data-parallel rank counts tp's collectives (not "0
    collectives and 0.0 MB on the wire"). Per micro-batch: the embedding's and each layer's wo and w2 all-reduce
    forward (2L + 1), each norm feeding a column-parallel layer and the final norm backward (2L + 1),
    the loss's three; per step the gradient norm's tp sum. Activations of one micro-batch (tokens x
    dim, fp32 here), the loss's fp32 per token (the CPU max: a slot per member)."""
    from mspretrain.config.schema import resolve_model
    from mspretrain.model.decoder import Decoder
    from mspretrain.model.parallel import Group, split_model
    from mspretrain.step.tp import Mesh, TPTrainStep
    from mspretrain.train.build import memory_options

    world_of(1, 2)
    cfg = resolve_model(tiny_cfg.model, vocab_size=512)
    model = Decoder(cfg, seed=0)
    mesh = Mesh(Group((0, 1), 1), Group((1,), 0))
    split_model(model, mesh.tp)
    step = TPTrainStep(model, tiny_cfg.optim, mesh=mesh, global_tokens=64, jit=False)
    L, D = cfg.n_layers, cfg.dim
    for accum in (1, 2):
        tokens = 64 // accum
        want_calls = accum * ((2 * L + 1) * 2 + 3) + 1
        want_bytes = accum * ((2 * L + 1) * 2 * tokens * D * 4 + tokens * 4 * (2 + 2)) + 4
        assert step.collectives(accum) == {"calls": want_calls, "bytes": want_bytes}
    line = memory_options(replace(tiny_cfg, parallel=replace(tiny_cfg.parallel, tp=2)), step, type("W", (), {"size": 2})(), 1)
    assert f"{(2 * L + 1) * 2 + 3 + 1} collectives and" in line and " 0 collectives" not in line


# ---- msrun ranks against one process

TP2 = ("parallel.tp=2",)
TP2_ZERO1 = ("parallel.tp=2", "optim.shard_optimizer=true")


@pytest.fixture(scope="module")
def tp2_run(tmp_path_factory, tiny_data) -> Path:
    """TP 2 on 2 msrun workers (dp 1), the reference run's config otherwise. Read-only."""
    tmp = tmp_path_factory.mktemp("tp2")
    msrun(tmp, tiny_data, tmp / "tp2", *TP2, EVAL_AT_END, timeout=900)  # the eval's vocabulary-parallel loss too
    return tmp / "tp2"


@pytest.fixture(scope="module")
def tp2_dp2_zero1_run(tmp_path_factory, tiny_data) -> Path:
    """TP 2 x DP 2 with ZeRO-1 on 4 msrun workers. Read-only."""
    tmp = tmp_path_factory.mktemp("tp2dp2")
    msrun(tmp, tiny_data, tmp / "tp2dp2", *TP2_ZERO1, nproc=4, timeout=900)
    return tmp / "tp2dp2"


def _assert_equals_one_process(run: Path, reference_run: Path, ranks: int = 0, steps: list[int] = STEPS) -> None:
    """Losses, grad norms and the checkpoints of `steps` against one process; with `ranks`, every
    rank's hash of the whole weights at the end the same."""
    one, got = losses(reference_run), losses(run)
    one_gn, got_gn = grad_norms(reference_run), grad_norms(run)
    assert set(steps) <= set(got)
    for step in steps:
        assert abs(one[step] - got[step]) <= 1e-5, (step, one[step], got[step])
        assert got_gn[step] == pytest.approx(one_gn[step], rel=1e-5), (step, one_gn[step], got_gn[step])
        assert_same_checkpoint(step_dir(run, step), step_dir(reference_run, step), 1e-5)
    hashes = replica_hashes(run)
    assert not ranks or len(hashes) == ranks and len(set(hashes)) == 1  # the whole weights gathered on every rank agree


@pytest.mark.slow
@pytest.mark.msrun
@pytest.mark.skipif(MSRUN is None, reason="msrun not installed with MindSpore")
def test_tp2_matches_one_process(tp2_run, reference_run):
    """Losses, grad norms, every checkpoint (whole tensors under the whole model's names) of TP 2
    against one process (measured: loss equal to the logged digits, grad norms 8.8e-8 relative,
    weights 4.9e-6 absolute at most). A TP 2 run resumed by one process: the kill -9 test below."""
    assert "tensor parallel over 2 ranks x 1 data-parallel" in (tp2_run / "train.log").read_text()
    _assert_equals_one_process(tp2_run, reference_run, 2)
    # the final evaluation: the loss over the vocabulary's two halves (`tp_loss`) equals one process's (measured 6e-10)
    assert final_nll(tp2_run) == pytest.approx(final_nll(reference_run), rel=1e-6)


@pytest.mark.slow
@pytest.mark.msrun
@pytest.mark.skipif(MSRUN is None, reason="msrun not installed with MindSpore")
def test_tp2_dp2_with_zero1_matches_one_process(tp2_dp2_zero1_run, reference_run):
    """TP 2 x DP 2 (4 ranks) with the optimizer state sharded over the 2 data-parallel ranks: the
    one-process numbers; the checkpoint holds one optimizer shard per data-parallel rank."""
    run = tp2_dp2_zero1_run
    assert "tensor parallel over 2 ranks x 2 data-parallel" in (run / "train.log").read_text()
    assert len(list(step_dir(run, FINAL).glob("optimizer-*.safetensors"))) == 2
    _assert_equals_one_process(run, reference_run, 4)


@pytest.mark.slow
@pytest.mark.msrun
@pytest.mark.skipif(MSRUN is None, reason="msrun not installed with MindSpore")
def test_a_zero1_tp_dp_checkpoint_resumes_on_plain_tp_dp(tmp_path, tiny_data, reference_run, tp2_dp2_zero1_run):
    """Step 5 of the TP 2 x DP 2 ZeRO-1 run (two optimizer shards) resumed by TP 2 x DP 2 without
    ZeRO (the data-parallel gradients all-reduced whole): the unbroken one-process run's losses,
    grad norms and checkpoints to the end."""
    run = copy_run_at(tp2_dp2_zero1_run, tmp_path / "from-zero1", 5)
    shutil.rmtree(run / "ranks")  # the ZeRO-1 job's hashes: this job writes its own
    msrun(tmp_path, tiny_data, run, *TP2, nproc=4, timeout=900)
    assert "resumed from step_000005" in (run / "train.log").read_text()
    _assert_equals_one_process(run, reference_run, 4, steps=list(range(6, FINAL + 1)))


@pytest.mark.sigkill
@pytest.mark.slow
@pytest.mark.msrun
@pytest.mark.skipif(MSRUN is None, reason="msrun not installed with MindSpore")
def test_a_killed_tp2_job_resumes_exactly_on_one_process(tmp_path, tiny_data):
    """TP 2 with rank 1 SIGKILLed after step 5: the job ends; one process resumes the oldest
    verified checkpoint kept and redoes the steps the killed job logged after it, with its losses.
    The model is Qwen3's family with tied embeddings (QK-norm gradients summed over tp, the head
    on the vocabulary-parallel embedding's rows): the redone steps compare TP 2 with one process."""
    import signal

    from mspretrain.checkpoint import store
    from mspretrain.cli import main

    run = tmp_path / "killed"
    qwen3 = ("model.family=qwen3", "model.qk_norm=true", "model.tie_embeddings=true")
    proc = start_launch(tmp_path, tiny_data, run, *LONG, *TP2, *qwen3)
    try:
        beat = wait_for_rank(run, 1, 5, proc)
        os.kill(beat["pid"], signal.SIGKILL)
        ended_within(proc, 0)
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    assert proc.returncode != 0
    before = losses(run)
    kept = sorted(p for p in (run / "checkpoints").glob("step_*[0-9]") if store.verify(p) is None)
    for p in kept[1:]:
        shutil.rmtree(p)
    resume_at = int(kept[0].name.split("_")[1])
    redo = [s for s in before if s > resume_at]
    assert redo, (resume_at, sorted(before))
    long = [a if not a.startswith("train.max_steps=") else f"train.max_steps={max(redo)}" for a in LONG]
    assert main(["train", "--config", str(TINY), "--data", str(tiny_data), "--run", str(run), "--quiet", *long, *qwen3]) == 0
    assert f"resumed from step_{resume_at:06d}" in (run / "train.log").read_text()
    after = losses(run)
    for step in redo:
        assert abs(after[step] - before[step]) <= 1e-5, (step, before[step], after[step])
