"""Expert parallel's pieces on one process (issue 52.3; the 2-rank runs are tests/train/test_moe_ep.py):
the parameter table's cut of the expert stacks, `Decoder.apply_ep` keeping a rank's experts, the
local experts' masked outputs and gradients summed over the ranks against the whole MoE, and the
dispatch/combine collectives chosen by device (their Ascend inputs checked on a CPU)."""
from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from mindspore import Parameter, Tensor, ops

from mspretrain.config.schema import ModelConfig, resolve_model
from mspretrain.model.decoder import Decoder, state_numpy
from mspretrain.model.expert_parallel import AllToAllIds, AllToAllRows, GatherIds, GatherRows, ScatterRows, send_slots
from mspretrain.model.parallel import Group
from mspretrain.model.params import ep_piece, expert_parallel

CFG = resolve_model(ModelConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=32, family="qwen3_moe",
                                qk_norm=True, num_experts=4, experts_per_token=2, moe_ffn_dim=32))
W13, W2, ROUTER = "layers.0.mlp.w13.weight", "layers.0.mlp.w2.weight", "layers.0.mlp.router.weight"


def test_the_table_cuts_expert_stacks_along_the_experts():
    assert ep_piece(W13, CFG, 2, 1) == (0, [(2, 4)]) and ep_piece(W2, CFG, 4, 0) == (0, [(0, 1)])
    assert ep_piece(ROUTER, CFG, 2, 1) is None and ep_piece("layers.0.attn.wqkv.weight", CFG, 2, 1) is None
    assert ep_piece(W13, CFG, 1, 0) is None
    dense = resolve_model(ModelConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=32))
    assert ep_piece(W13, dense, 2, 1) is None  # a dense layer's w13 of the same name is not an expert stack
    assert expert_parallel(W2, CFG) and not expert_parallel(W2, dense) and not expert_parallel(ROUTER, CFG)


@pytest.fixture(scope="module")
def whole():
    model = Decoder(CFG, seed=3)
    return model, state_numpy(model)


def test_apply_ep_keeps_this_ranks_experts(whole):
    _, st = whole
    model = Decoder(CFG, seed=3)
    split = model.apply_ep(Group((0, 1), 1, device="cpu"))
    assert split.whole_shapes == {W13: (4, 64, 64), W2: (4, 64, 32)}
    assert split.where == {W13: (0, [(2, 4)]), W2: (0, [(2, 4)])}
    mine = state_numpy(model)
    np.testing.assert_array_equal(mine[W13], st[W13][2:4])
    np.testing.assert_array_equal(mine[W2], st[W2][2:4])
    np.testing.assert_array_equal(mine[ROUTER], st[ROUTER])  # the router stays whole
    moe = model.layers[0].mlp
    assert (moe.local_experts, moe.expert_lo) == (2, 2)
    assert not moe.all_to_all and isinstance(moe.dispatch, GatherRows)  # CPU: mccl has no AlltoAll kernel
    npu = Decoder(CFG, seed=3).layers[0].mlp
    npu.apply_ep(Group((0, 1), 0, name="ep_0", device="ascend"), CFG)  # Ascend: the AllToAll form
    assert npu.all_to_all and npu.ep_size == 2 and isinstance(npu.dispatch, AllToAllRows)
    assert isinstance(npu.dispatch_ids, AllToAllIds) and isinstance(npu.combine, AllToAllRows)
    assert [p.name for p in model.trainable_params()] == [p.name for p in Decoder(CFG, seed=3).trainable_params()]


def _rank_cell(st: dict, rank: int, ep: int):
    """Rank `rank`'s MoE cell of ep ranks, without collectives: its experts' slices of the whole weights."""
    moe = Decoder(CFG, seed=3).layers[0].mlp
    n = CFG.num_experts // ep
    for cell, name in ((moe.w13, W13), (moe.w2, W2)):
        cell.weight = Parameter(Tensor(st[name][rank * n:(rank + 1) * n]), name)
    moe.local_experts, moe.expert_lo, moe.ep_size = n, rank * n, ep
    return moe


@pytest.mark.parametrize("ep", [2, 4])
def test_local_experts_summed_over_ranks_are_the_whole_moe(whole, ep):
    """What the combine sums: each rank's masked local outputs for every token of the group; their sum
    is the whole MoE's output, and each rank's expert gradients are the whole model's rows of its experts."""
    model, st = whole
    moe = model.layers[0].mlp
    x = Tensor(np.random.default_rng(0).standard_normal((24, 64)).astype(np.float32))
    _, top, idx, _ = moe.route(x)
    dy = Tensor(np.random.default_rng(1).standard_normal((24 * 2, 64)).astype(np.float32))

    def grads(cell):
        fn = lambda t: (cell.local_outputs(x, t, idx) * dy).sum()  # noqa: E731
        out, (g_top, g_w) = ms.value_and_grad(fn, 0, [cell.w13.weight, cell.w2.weight])(top)
        return cell.local_outputs(x, top, idx).asnumpy(), g_top.asnumpy(), [g.asnumpy() for g in g_w]

    y_whole, gt_whole, gw_whole = grads(moe)
    y_sum, gt_sum = 0, 0
    n = CFG.num_experts // ep
    for r in range(ep):
        y, gt, gw = grads(_rank_cell(st, r, ep))
        y_sum, gt_sum = y_sum + y, gt_sum + gt
        for got, want in zip(gw, gw_whole):
            np.testing.assert_allclose(got, want[r * n:(r + 1) * n], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(y_sum, y_whole, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gt_sum, gt_whole, rtol=1e-5, atol=1e-6)  # the routing weights' gradient too


def test_dispatch_collectives_by_device():
    """Ascend: HCCL's AllGather and ReduceScatter in the ep group (the bprops each other's);
    CPU (mccl: no ReduceScatter, one AllGather per graph): AllReduce sums of zero-padded slots."""
    npu = Group((0, 1), 1, name="ep_0", device="ascend")
    g, s, i = GatherRows(npu), ScatterRows(npu), GatherIds(npu)
    assert g.native and s.native and i.native
    assert isinstance(g.gather, ops.AllGather) and isinstance(g.scatter, ops.ReduceScatter)
    assert isinstance(s.scatter, ops.ReduceScatter) and isinstance(s.gather, ops.AllGather)
    assert isinstance(i.op, ops.AllGather)
    for prim in (g.gather, g.scatter, s.scatter, s.gather, i.op):
        assert prim.group == "ep_0"
    assert g.scatter.op == s.scatter.op == ops.ReduceOp.SUM
    a, b = AllToAllRows(npu), AllToAllIds(npu)
    for op in (a.op, a.back, b.op):  # rows split into the group's blocks along dim 0, received blocks concatenated there
        assert isinstance(op, ops.AlltoAll) and op.group == "ep_0"
        assert (op.split_count, op.split_dim, op.concat_dim) == (2, 0, 0)
    cpu = Group((0, 1), 1, device="cpu")
    g, s, i = GatherRows(cpu), ScatterRows(cpu), GatherIds(cpu)
    assert not (g.native or s.native or i.native)
    assert all(isinstance(op, ops.AllReduce) for op in (g.sum, g.back, s.sum, s.back, i.op))
    assert (g.size, g.slot) == (2, 1)


# ----------------------------------------------------------------- the AllToAll form (Ascend), simulated

def exchange(bufs: list) -> list:
    """An AllToAll over len(bufs) ranks on dim 0, by hand: rank r receives block r of every rank's
    buffer, in rank order (comm_ops.py `AlltoAll`'s definition; the reference the cells' layout is held to)."""
    n = len(bufs)
    m = bufs[0].shape[0] // n
    return [ops.concat([b[r * m:(r + 1) * m] for b in bufs], 0) for r in range(n)]


def test_send_slots_against_a_loop():
    """Slot r of the send buffer: the tokens with an expert on rank r, in token order, once each; the
    rest empty (row index N); dest is each token's row there, n*N where it sends nothing."""
    rng = np.random.default_rng(5)
    N, K, E, n = 12, 2, 8, 4
    idx = np.stack([rng.choice(E, K, replace=False) for _ in range(N)]).astype(np.int32)
    idx[3] = [0, 1]  # both experts on rank 0: sent once
    src, dest = (t.asnumpy() for t in send_slots(Tensor(idx), E // n, n))
    for r in range(n):
        mine = [t for t in range(N) if (idx[t] // (E // n) == r).any()]
        assert list(src[r * N:r * N + len(mine)]) == mine and (src[r * N + len(mine):(r + 1) * N] == N).all()
        for t in range(N):
            assert dest[t, r] == (r * N + mine.index(t) if t in mine else n * N)


@pytest.mark.parametrize("ep", [2, 4])
def test_all_to_all_form_over_simulated_ranks_is_the_whole_moe(whole, ep):
    """The Ascend form end to end, its two exchanges simulated (`exchange`): each rank routes its own
    tokens, sends them to the ranks of their experts, runs its experts on what it received and sums
    what comes back. Outputs equal the whole MoE's on all ranks' tokens, and (through the exchange's
    own reverse as backward) the gradients of every rank's tokens, experts and router."""
    model, st = whole
    N = 12
    xs = [Tensor(np.random.default_rng(10 + r).standard_normal((N, 64)).astype(np.float32)) for r in range(ep)]
    dys = [Tensor(np.random.default_rng(20 + r).standard_normal((N, 64)).astype(np.float32)) for r in range(ep)]
    cells = [_rank_cell(st, r, ep) for r in range(ep)]

    def ranks(*x):
        sends = [c.a2a_send(xr, *c.route(xr)[1:3]) for c, xr in zip(cells, x)]
        recv = exchange([b for b, _, _ in sends])
        rids = exchange([i for _, i, _ in sends])
        back = exchange([c.a2a_local(rv, ri) for c, rv, ri in zip(cells, recv, rids)])
        return sum(((c.a2a_receive(bk, d) * dy).sum() for c, bk, (_, _, d), dy in zip(cells, back, sends, dys)), Tensor(0.0))

    moe = model.layers[0].mlp
    params = [p for c in cells for p in (c.w13.weight, c.w2.weight, c.router.weight)]
    loss, (gx, gp) = ms.value_and_grad(ranks, tuple(range(ep)), params)(*xs)
    whole_fn = lambda x: (moe(x.reshape(1, ep * N, 64))[0].reshape(ep * N, 64) * ops.concat(dys, 0)).sum()  # noqa: E731
    want, (wgx, wgp) = ms.value_and_grad(whole_fn, 0, [moe.w13.weight, moe.w2.weight, moe.router.weight])(ops.concat(xs, 0))
    assert float(loss) == pytest.approx(float(want), rel=1e-5)
    np.testing.assert_allclose(np.concatenate([g.asnumpy() for g in gx]), wgx.asnumpy(), rtol=1e-4, atol=1e-6)
    n = CFG.num_experts // ep
    for r in range(ep):
        np.testing.assert_allclose(gp[3 * r].asnumpy(), wgp[0].asnumpy()[r * n:(r + 1) * n], rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(gp[3 * r + 1].asnumpy(), wgp[1].asnumpy()[r * n:(r + 1) * n], rtol=1e-4, atol=1e-6)
    router = sum(gp[3 * r + 2].asnumpy() for r in range(ep))  # each rank's router gradient: its own tokens' part
    np.testing.assert_allclose(router, wgp[2].asnumpy(), rtol=1e-4, atol=1e-6)
