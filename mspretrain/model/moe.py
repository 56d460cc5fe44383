"""The mixture-of-experts MLP (issue 52): a router and E SwiGLU experts, dropless, static shapes.

Numerics are transformers' Qwen3-MoE (models/qwen3_moe/modeling_qwen3_moe.py, 5.x:
`Qwen3MoeTopKRouter`, `Qwen3MoeExperts`, `load_balancing_loss_func`): router logits x Wr^T,
softmax in fp32, top-k of the probabilities, renormalised to sum 1 when `norm_topk_prob`; each
chosen expert's SwiGLU w2(silu(x Wg^T) * (x Wu^T)) weighted by its routing weight and summed.

Dropless routing with static shapes (the CPU path; graph mode compiles it once):
- The N*K (token, expert) assignments are placed by a counting sort: an assignment's rank among
  those of its expert is the running count of its expert's one-hot column (a cumsum over
  (A, E) integers, no data-dependent shape), its destination row is its expert's segment start
  plus that rank.
- Each expert's segment is padded to a multiple of a block of `b` rows, so every block holds the
  rows of one expert. The padded buffer has a static bound R = A + E*(b-1) rows (rounded up to
  whole blocks); rows no assignment fills read a zero row.
- The padded rows are gathered from the tokens themselves (row -> assignment -> token), not from
  K copies of them. Per block, the block's expert weights are gathered and one batched MatMul
  runs the SwiGLU of all blocks: (R/b, b, D) x (R/b, D, 2F), the gate and up halves sliced from
  its output (`swiglu`). Cost: the active FLOPs times R/A (b is the mean group size, at most 64,
  so padding at most doubles the rows), plus a copy of one expert's weights per block (R/b copies
  of 3*F*D values). On CPU that copy is the price of static shapes without a
  grouped matmul; Ascend runs MindSpore 2.10's `moe_token_permute` and `GroupedMatmul` instead
  (model/moe_kernels.py `grouped_experts`, same inputs and output; `MoE.grouped`).
- Outputs return to their assignments by a gather of the destination rows, are weighted and
  summed over the K choices per token. Gradients flow through the gathers (scatter-adds) into
  exactly the chosen experts' weights and into the router through the routing weights.

The load-balancing statistics of the layer (the router's per-expert probability sum and the top-k
assignment counts over the layer's N tokens) are returned with the output; the decoder sums them
over its MoE layers and `balance_loss` forms transformers' loss from the sums.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from mspretrain.config.schema import ModelConfig
from mspretrain.model.expert_parallel import send_slots
from mspretrain.model.layers import Linear, WeightCell, WeightSource, one
from mspretrain.model.moe_kernels import expert_counts, grouped_experts

MAX_BLOCK = 64  # rows per expert block at most (see the module docstring)


class Stacked(WeightCell):
    """One weight (E, out, in) for all experts, named `weight` like Linear's (so `mlp.w13.weight`).
    A WeightCell so that ZeRO-3 slices and gathers it like any other weight (step/zero3.py); tensor
    parallel does not cut it (model/block.py refuses tp for an MoE layer), expert parallel does (`MoE.apply_ep`).
    `role`: the parameter table's for its name (model/params.py: w13 column, w2 row, as a dense MLP's,
    tests/model/test_params.py), which a tensor-parallel cut of the experts' ffn would follow."""

    def __init__(self, experts: int, out_dim: int, in_dim: int, std: float, rng: WeightSource, role: str) -> None:
        super().__init__(role)
        self.weight = rng.parameter((experts, out_dim, in_dim), std)

    def pull(self, token: Tensor) -> tuple[Tensor, Tensor]:  # as model/layers.py RMSNorm.pull
        if self.gather is None:
            return self.weight, token
        w = self.gather(self.weight, token)
        return w, one(w)


def block_rows(assignments: int, experts: int) -> int:
    """Rows per expert block: the mean rows per expert (so padding at most doubles the rows), 1..MAX_BLOCK."""
    return max(1, min(MAX_BLOCK, assignments // experts))


class MoE(nn.Cell):
    """construct(x (B, T, D)) -> (y (B, T, D), stats (2, E) fp32: probability sums, assignment counts)."""

    def __init__(self, cfg: ModelConfig, rng: WeightSource, dtype: ms.Type) -> None:
        super().__init__()
        self.experts, self.top_k, self.norm_topk = cfg.num_experts, cfg.experts_per_token, cfg.norm_topk_prob
        self.ffn = cfg.expert_ffn
        self.dtype = dtype
        # draw order (model/decoder.py InitStreams): router, w13, w2
        self.router = Linear(cfg.dim, cfg.num_experts, cfg.init_std, rng, dtype)  # (E, D), HF mlp.gate.weight
        self.w13 = Stacked(cfg.num_experts, 2 * self.ffn, cfg.dim, cfg.init_std, rng, "column")
        self.w2 = Stacked(cfg.num_experts, cfg.dim, self.ffn, cfg.init_std / math.sqrt(2 * cfg.n_layers), rng, "row")
        self.bmm_t = ops.BatchMatMul(transpose_b=True)
        self.grouped = False  # the Ascend kernels instead of the blocks (set by the Decoder, model/moe_kernels.py)
        # expert parallel (`apply_ep`): the experts held here and the dispatch/combine collectives
        self.local_experts, self.expert_lo = cfg.num_experts, 0
        self.dispatch = self.dispatch_ids = self.combine = None
        self.all_to_all, self.ep_size = False, 1  # the AllToAll form (Ascend) or the gather form
        # Qwen2-MoE: a shared expert every token goes through, scaled by sigmoid(x Wg^T) (Qwen2MoeSparseMoeBlock)
        self.shared_ffn = cfg.shared_expert_ffn_dim
        if self.shared_ffn:
            S = self.shared_ffn
            self.shared_w13 = Linear(cfg.dim, 2 * S, cfg.init_std, rng, dtype, role="column", blocks=(S, S))
            self.shared_w2 = Linear(S, cfg.dim, cfg.init_std / math.sqrt(2 * cfg.n_layers), rng, dtype, role="row")
            self.shared_gate = Linear(cfg.dim, 1, cfg.init_std, rng, dtype)
        # the router options (each off by default, leaving the graph as it was): see `StatRows`
        self.rows = stat_rows(cfg)
        self.capacity_factor = float(cfg.capacity_factor)
        if cfg.router_bias_update_rate > 0:
            # DeepSeek-V3's auxiliary-loss-free balancing: a per-expert bias on the top-k choice,
            # model state outside the gradient (`update_expert_bias` moves it after each step)
            self.expert_bias = Parameter(Tensor(np.zeros(cfg.num_experts, np.float32)), name="expert_bias", requires_grad=False)
        else:
            self.expert_bias = None

    def route(self, x2: Tensor, wr: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """x2 (N, D) -> (probs (N, E) fp32, top-k weights (N, K) compute dtype, top-k experts (N, K)
        int32, and with the router z-loss the sum over the N tokens of logsumexp(logits)^2, else None).
        wr: the router's whole weight under ZeRO-3 (`pull`), else None (its Parameter)."""
        logits = self.router(x2, wr).astype(ms.float32)
        probs = ops.softmax(logits, -1)
        if self.expert_bias is None:
            top, idx = ops.topk(probs, self.top_k)
        else:  # DeepSeek-V3: the bias decides the choice only; the weights are the unbiased probabilities
            _, idx = ops.topk(probs + self.expert_bias, self.top_k)
            idx = ops.stop_gradient(idx)
            top = ops.gather_d(probs, 1, idx)
        if self.norm_topk:
            top = top / top.sum(-1, keepdims=True)
        z = None
        if self.rows.z is not None:  # ST-MoE router z-loss (Zoph et al. 2022, eq. 5), summed here, averaged by the objective
            lse = ops.logsumexp(logits, -1)
            z = (lse * lse).sum()
        return probs, top.astype(self.dtype), idx.astype(ms.int32), z

    def apply_ep(self, group: Any, cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], Any]]:
        """Expert parallel (model/expert_parallel.py): keep ep rank `group.rank`'s E/ep experts of
        each stack (model/params.py `ep_piece`: the parameter table says how an expert stack is
        cut), the router and the shared expert whole, and attach the dispatch and combine
        collectives of `group`. Returns {parameter name: (whole shape, where)} of the cut stacks."""
        from mspretrain.model.expert_parallel import AllToAllIds, AllToAllRows, GatherIds, GatherRows, ScatterRows, native
        from mspretrain.model.lazy import whole_value
        from mspretrain.model.parallel import cut, piece_tensor
        from mspretrain.model.params import ep_piece

        out = {}
        for cell in (self.w13, self.w2):
            p = cell.weight
            name, dtype, grad, shape = p.name, p.dtype, p.requires_grad, tuple(p.shape)
            where = ep_piece(name, cfg, group.size, group.rank)
            # whole_value: a lazily drawn stack is drawn into an array freed as soon as it is cut (model/lazy.py)
            cell.weight = Parameter(piece_tensor(cut(whole_value(p), where), dtype, group.device), name, grad)
            cell.weight.name = name  # the Cell may prefix a Parameter assigned later: keep the model's name
            out[name] = (shape, where)
        (lo, hi), = out[self.w13.weight.name][1][1]
        self.local_experts, self.expert_lo = hi - lo, lo
        self.ep_size = group.size
        # by device (model/expert_parallel.py): HCCL's AlltoAll on Ascend; on CPU (mccl has no AlltoAll
        # kernel) the gather form's AllReduce sums
        self.all_to_all = native(group)
        if self.all_to_all:
            self.dispatch, self.dispatch_ids, self.combine = AllToAllRows(group), AllToAllIds(group), AllToAllRows(group)
        else:
            self.dispatch, self.dispatch_ids, self.combine = GatherRows(group), GatherIds(group), ScatterRows(group)
        return out

    def pull(self, token: Tensor) -> tuple[tuple, Tensor]:
        """ZeRO-3 (step/zero3.py): this layer's whole weights, gathered one after the other from
        `token` (router, w13, w2, then the shared expert's w13, w2 and gate, None without one), and
        the token after the last; `construct(x, ws)` takes the tuple."""
        wr, _, token = self.router.pull(token)
        w13, token = self.w13.pull(token)
        w2, token = self.w2.pull(token)
        if not self.shared_ffn:
            return (wr, w13, w2, None, None, None), token
        s13, _, token = self.shared_w13.pull(token)
        s2, _, token = self.shared_w2.pull(token)
        sg, _, token = self.shared_gate.pull(token)
        return (wr, w13, w2, s13, s2, sg), token

    def construct(self, x: Tensor, ws: tuple | None = None) -> tuple[Tensor, Tensor]:
        """ws: the whole weights under ZeRO-3 (`pull`), else None (the Parameters)."""
        B, T, D = x.shape
        N = B * T
        x2 = x.reshape(N, D)
        if ws is None:  # route(x2) as it was called before ZeRO-3 (tests/model/test_moe_hf.py wraps it)
            probs, top, idx, z = self.route(x2)
            ws = (None, self.w13.weight, self.w2.weight, None, None, None)
        else:
            probs, top, idx, z = self.route(x2, ws[0])
        if self.capacity_factor > 0:
            return self._capacity(x, x2, probs, top, idx, z, ws)
        if self.combine is not None:  # expert parallel (`apply_ep`)
            return self._expert_parallel(x, x2, probs, top, idx, z)
        ya, counts = self._experts(x2, idx, top, ws[1], ws[2])
        return self._finish(x, x2, ya.reshape(N, self.top_k, D).sum(1), probs, counts, z, None, ws)

    def _expert_parallel(self, x: Tensor, x2: Tensor, probs: Tensor, top: Tensor, idx: Tensor,
                         z: Tensor | None) -> tuple[Tensor, Tensor]:
        """This rank's experts run on the ep group's assignments that chose them, the outputs summed
        back to each token's rank: on Ascend the tokens sent to the ranks of their experts and back
        by AlltoAll, on CPU gathered to every rank and reduce-scattered back (model/expert_parallel.py)."""
        N, D = x2.shape
        K = self.top_k
        if self.all_to_all:
            buf, ids, dest = self.a2a_send(x2, top, idx)
            recv = self.dispatch(buf)  # (n*N, D + K): slot s holds rank s's tokens that chose an expert here
            y = self.a2a_receive(self.combine(self.a2a_local(recv, self.dispatch_ids(ids, recv))), dest)
        else:
            packed = self.dispatch(ops.concat((x2, top), -1))  # (n*N, D + K): every ep rank's tokens and weights
            ids = self.dispatch_ids(idx, packed)  # (n*N, K) their experts
            ya = self.local_outputs(packed[:, :D], packed[:, D:], ids)
            y = self.combine(ya.reshape(-1, K, D).sum(1))  # (N, D): this rank's tokens, every expert's share summed
        counts = ops.stop_gradient(expert_counts(idx, self.experts))  # this rank's tokens' choices (the stats)
        return self._finish(x, x2, y, probs, counts, z, None)

    def a2a_send(self, x2: Tensor, top: Tensor, idx: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The AllToAll form's send side (model/expert_parallel.py `send_slots`): this rank's tokens and
        routing weights packed (n*N, D + K) in the ranks' slots, their whole-model expert ids (n*N, K)
        (-1 on an empty row), and each token's row per rank (N, n) for `a2a_receive`."""
        N, D = x2.shape
        K = self.top_k
        src, dest = send_slots(idx, self.local_experts, self.ep_size)
        packed = ops.concat((x2, top), -1)
        buf = ops.gather(ops.concat((packed, ops.zeros((1, D + K), packed.dtype)), 0), src, 0)
        ids = ops.gather(ops.concat((idx, ops.fill(ms.int32, (1, K), -1)), 0), src, 0)
        return buf, ops.stop_gradient(ids), dest

    def a2a_local(self, recv: Tensor, ids: Tensor) -> Tensor:
        """The received rows (M, D + K) with their expert ids (M, K) -> (M, D): each row's weighted
        outputs of this rank's experts summed (another rank's expert or an empty row weighs 0)."""
        D, K = recv.shape[1] - self.top_k, self.top_k
        return self.local_outputs(recv[:, :D], recv[:, D:], ids).reshape(-1, K, D).sum(1)

    def a2a_receive(self, back: Tensor, dest: Tensor) -> Tensor:
        """The rows returned by the reverse exchange (n*N, D), in the send buffer's layout -> (N, D):
        each token's outputs from the ranks it was sent to, summed (row n*N: a zero row)."""
        N, n = dest.shape
        D = back.shape[1]
        ext = ops.concat((back, ops.zeros((1, D), back.dtype)), 0)
        return ops.gather(ext, dest.reshape(N * n), 0).reshape(N, n, D).sum(1)

    def local_outputs(self, xg: Tensor, top: Tensor, ids: Tensor) -> Tensor:
        """The weighted outputs (M*K, D) of this rank's experts [expert_lo, expert_lo + local) for
        tokens xg (M, D) with whole-model expert ids (M, K) and weights top (M, K): an assignment
        to another rank's expert weighs 0 (it runs local expert 0, static shapes). Summed over the
        ep ranks, the whole MoE's (tests/model/test_moe_ep.py)."""
        local = ids - self.expert_lo
        inside = ops.logical_and(local >= 0, local < self.local_experts)
        local = ops.stop_gradient(ops.select(inside, local, ops.zeros_like(local)))
        ya, _ = self._experts(xg, local, top * inside.astype(top.dtype), self.w13.weight, self.w2.weight)
        return ya

    def _experts(self, x2: Tensor, idx: Tensor, top: Tensor, w13s: Tensor, w2s: Tensor) -> tuple[Tensor, Tensor]:
        """Dropless: tokens x2 (N, D), their experts idx (N, K) among this cell's `local_experts`
        stacked ones (w13s, w2s: the stacks, whole), weights top (N, K) -> (each assignment's
        weighted output (N*K, D) token-major, the assignments per expert (local_experts,))."""
        N, D = x2.shape
        E, K, F = self.local_experts, self.top_k, self.ffn
        A = N * K
        b = block_rows(A, E)
        R = -(-(A + E * (b - 1)) // b) * b  # static bound on the padded rows
        if self.grouped:  # Ascend: MindSpore's fused permutation and grouped matmul (model/moe_kernels.py)
            return grouped_experts(x2, idx, top, w13s, w2s, self.dtype)
        e = ops.stop_gradient(idx.reshape(A))  # (A,) expert of each assignment, token-major
        onehot = ops.one_hot(e, E, Tensor(1, ms.int32), Tensor(0, ms.int32))  # (A, E)
        rank = ops.gather_d(ops.cumsum(onehot, 0), 1, e.reshape(A, 1)).reshape(A) - 1  # rank within its expert
        counts = onehot.sum(0)  # (E,)
        padded = (counts + (b - 1)) // b * b
        ends = ops.cumsum(padded, 0)
        dest = ops.gather(ends - padded, e, 0) + rank  # (A,) its row in the padded buffer
        # which token fills each padded row (N: none, the zero row): assignment i is token i // K's.
        # Gathered from the tokens, not from K copies of them (no (A, D) copy, forward or backward)
        src = ops.scatter_nd(dest.reshape(A, 1), ops.arange(1, A + 1, dtype=ms.int32), (R,)) - 1
        tok = ops.stop_gradient(ops.select(src < 0, ops.fill(ms.int32, (R,), N), src // K))
        xp = ops.gather(ops.concat((x2, ops.zeros((1, D), x2.dtype)), 0), tok, 0)  # (R, D)
        # the expert of each block: the number of segments ending at or before its first row
        starts = ops.arange(0, R, b, dtype=ms.int32).reshape(R // b, 1)
        block_e = ops.minimum((starts >= ends.reshape(1, E)).astype(ms.int32).sum(1), E - 1)
        block_e = ops.stop_gradient(block_e)
        w13, w2 = ops.gather(w13s, block_e, 0), ops.gather(w2s, block_e, 0)
        if self.dtype != ms.float32:
            w13, w2 = w13.astype(self.dtype), w2.astype(self.dtype)
        yb = swiglu(self.bmm_t, xp.reshape(R // b, b, D), w13, w2, F).reshape(R, D)
        ya = ops.gather(yb, dest, 0) * top.reshape(A, 1)  # (A, D), weighted
        return ya, counts

    def _finish(self, x: Tensor, x2: Tensor, y: Tensor, probs: Tensor, counts: Tensor, z: Tensor | None,
                dropped: Tensor | None, ws: tuple = (None,) * 6) -> tuple[Tensor, Tensor]:
        """The experts' output y (N, D) (each token's weighted outputs summed), the shared expert
        (its whole weights ws[3:] under ZeRO-3, else None: its Parameters), and the stats."""
        B, T, D = x.shape
        E = self.experts
        if self.shared_ffn:
            g, u = self.shared_w13.parts(x2, (self.shared_ffn, self.shared_ffn), ws[3])
            y = y + ops.sigmoid(self.shared_gate(x2, ws[5])) * self.shared_w2(ops.silu(g) * u, ws[4])
        y = y.reshape(B, T, D)
        rows = [probs.sum(0), ops.stop_gradient(counts.astype(ms.float32))]
        if z is not None:  # the layer's z sum in every column (a column's value is the sum; the decoder adds layers)
            rows.append(ops.broadcast_to(z.reshape(1), (E,)))
        if dropped is not None:
            rows.append(ops.stop_gradient(dropped.astype(ms.float32)))
        return y, ops.stack(rows)

    def _capacity(self, x: Tensor, x2: Tensor, probs: Tensor, top: Tensor, idx: Tensor, z: Tensor | None,
                  ws: tuple) -> tuple[Tensor, Tensor]:
        """The capacity-factor path (`model.capacity_factor` > 0): every expert takes at most
        C = ceil(factor * N * K / E) assignments, in routing order as GShard's (first choices of
        all tokens in token order, then the second choices, ...); an assignment beyond its expert's
        C is dropped (its weighted output is 0: the token keeps its other experts and the residual).
        Static shapes without padding: the buffer is (E, C, D), one batched MatMul with the stacked
        weights as they are (no per-block gather). Stats gain the dropped assignments per expert."""
        B, T, D = x.shape
        N, E, K, F = B * T, self.experts, self.top_k, self.ffn
        A = N * K
        C = capacity(self.capacity_factor, N, K, E)
        e = ops.stop_gradient(idx.transpose(1, 0).reshape(A))  # (A,) choice-major: routing priority
        onehot = ops.one_hot(e, E, Tensor(1, ms.int32), Tensor(0, ms.int32))  # (A, E)
        rank = ops.gather_d(ops.cumsum(onehot, 0), 1, e.reshape(A, 1)).reshape(A) - 1
        counts = onehot.sum(0)  # (E,) chosen, before the drop (the balance loss's f_e)
        dest = ops.select(rank < C, e * C + rank, ops.fill(ms.int32, (A,), E * C))  # E*C: dropped
        dest = ops.stop_gradient(dest.reshape(K, N).transpose(1, 0).reshape(A))  # back to token-major
        # which assignment fills each of the E*C rows (A: none); dropped ones all land on row E*C, cut off
        src = ops.scatter_nd(dest.reshape(A, 1), ops.arange(1, A + 1, dtype=ms.int32), (E * C + 1,))[:E * C] - 1
        tok = ops.stop_gradient(ops.select(src < 0, ops.fill(ms.int32, (E * C,), N), src // K))  # N: the zero row
        xb = ops.gather(ops.concat((x2, ops.zeros((1, D), x.dtype)), 0), tok, 0).reshape(E, C, D)
        w13, w2 = ws[1], ws[2]
        if self.dtype != ms.float32:
            w13, w2 = w13.astype(self.dtype), w2.astype(self.dtype)
        yb = swiglu(self.bmm_t, xb, w13, w2, F).reshape(E * C, D)
        yb = ops.concat((yb, ops.zeros((1, D), yb.dtype)), 0)  # row E*C: a dropped assignment's output
        ya = ops.gather(yb, dest, 0) * top.reshape(A, 1)
        dropped = ops.maximum(counts - C, 0)
        return self._finish(x, x2, ya.reshape(N, K, D).sum(1), probs, counts, z, dropped, ws)


def swiglu(bmm_t: Any, xb: Tensor, w13: Tensor, w2: Tensor, F: int) -> Tensor:
    """The experts' SwiGLU on row blocks xb (G, b, D), one expert's weights per block: w13 (G, 2F, D)
    gate | up, w2 (G, D, F) -> (G, b, D). One BatchMatMul over w13 whole, the gate and up halves
    sliced from its output: slicing the (per-block copies of the) weights instead cost a copy of
    each half forward and a zero-filled (G, 2F, D) StridedSliceGrad per half backward
    (docs/benchmarks.md, issue 52's MoE step)."""
    h = bmm_t(xb, w13)  # (G, b, 2F)
    return bmm_t(ops.silu(h[:, :, :F]) * h[:, :, F:], w2)


def capacity(factor: float, tokens: int, k: int, experts: int) -> int:
    """Assignments an expert takes at most: ceil(factor * tokens * K / E) (GShard/Switch), at least
    1 and at most `tokens` (a token chooses an expert once, so more rows would stay empty)."""
    return max(1, min(tokens, math.ceil(factor * tokens * k / experts)))


@dataclass(frozen=True)
class StatRows:
    """The rows of an MoE layer's routing stats (E columns each): 0 the router probabilities summed
    over the layer's tokens, 1 the top-k assignment counts (before any drop), then, only with their
    option on (so a default run's stats and graph are as they were): `z` the sum over tokens of
    logsumexp(router logits)^2 (every column holds it), `dropped` the assignments dropped per expert."""
    z: int | None = None
    dropped: int | None = None

    @property
    def count(self) -> int:
        return 2 + (self.z is not None) + (self.dropped is not None)


def stat_rows(cfg: ModelConfig) -> StatRows:
    z = 2 if cfg.router_z_loss_coef > 0 else None
    dropped = 2 + (z is not None) if cfg.capacity_factor > 0 else None
    return StatRows(z, dropped)


def balance_loss(stats: Tensor, rows: int, experts: int) -> Tensor:
    """transformers' `load_balancing_loss_func` from summed stats: stats (2, E) = (sum over the MoE
    layers' tokens of router probabilities, of top-k assignment counts), `rows` = tokens x MoE
    layers: E * sum_e (counts_e / rows) * (probs_e / rows)."""
    return (stats[0] * stats[1]).sum() * (experts / float(rows) / float(rows))


def z_loss(stats: Tensor, row: int, rows: int) -> Tensor:
    """The router z-loss from summed stats: the mean over `rows` (tokens x MoE layers) of
    logsumexp(router logits)^2 (ST-MoE, Zoph et al. 2022, eq. 5; `StatRows.z`)."""
    return stats[row, 0] * (1.0 / float(rows))


def load_metrics(per: np.ndarray, layers: list[int], top_k: int, rows: StatRows | None = None) -> dict[str, float]:
    """The expert-load metrics of one step (issue 52.6; names in docs/operators.md) from each MoE
    layer's routing stats summed over the step's micro-batches, per (L_moe, R, E): router
    probability sums and top-k assignment counts over this rank's tokens, then the option rows
    `rows` (StatRows) names.

    - `moe/layer_{i}/max_over_mean`: the busiest expert's assignments over the mean (1 = balanced,
      E/K at most: every token sends one of its K choices to that expert);
    - `moe/layer_{i}/top_share`: the share of the layer's tokens that chose the busiest expert (K/E
      balanced, 1 = every token; a router collapse, forensics/diagnose.py);
    - `moe/balance_loss`: transformers' load-balancing loss over the step's tokens of all MoE
      layers together (`balance_loss`'s formula; the objective's is per micro-batch, so with
      accumulation the two differ), whether or not `router_aux_loss_coef` weights it in;
    - `moe/z_loss` (only with `model.router_z_loss_coef` > 0): the router z-loss over the step's
      tokens of all MoE layers, unweighted;
    - `moe/dropped_tokens`: the (token, expert) assignments dropped over capacity in the step, all
      MoE layers (a token dropped by j of its K experts counts j); 0 when routing is dropless."""
    rows = rows or StatRows()
    per = np.asarray(per, dtype=np.float64)
    probs, counts = per[:, 0], per[:, 1]
    experts = per.shape[-1]
    out: dict[str, float] = {}
    for i, c, p in zip(layers, counts, probs):
        tokens = p.sum()  # each token's probabilities sum to 1
        mean = c.sum() / experts
        out[f"moe/layer_{i}/max_over_mean"] = float(c.max() / mean) if mean > 0 else 0.0
        out[f"moe/layer_{i}/top_share"] = float(c.max() / tokens) if tokens > 0 else 0.0
    total = probs.sum()
    out["moe/balance_loss"] = float((counts.sum(0) * probs.sum(0)).sum() * experts / total / total) if total > 0 else 0.0
    if rows.z is not None:
        out["moe/z_loss"] = float(per[:, rows.z, 0].sum() / total) if total > 0 else 0.0
    out["moe/dropped_tokens"] = float(per[:, rows.dropped].sum()) if rows.dropped is not None else 0.0
    return out


def update_expert_bias(model: nn.Cell, layers: list[int], counts: np.ndarray, rate: float) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing (arXiv 2412.19437, section 2.1.2), after an
    optimizer step: each MoE layer's bias b_e += rate * sign(mean load - load_e), with load_e the
    step's top-k assignments to e (`counts` (L_moe, E), summed over its micro-batches). In fp32 on
    the host, outside the gradient; the bias is a model Parameter, so checkpoints carry it."""
    for i, c in zip(layers, np.asarray(counts, np.float64)):
        bias = model.layers[i].mlp.expert_bias
        step = (np.float32(rate) * np.sign(c.mean() - c)).astype(np.float32)
        ops.assign(bias, Tensor(bias.asnumpy() + step))  # in place: a compiled step holds the Parameter's memory (set_data is not seen)


def reference_z_loss(logits: np.ndarray) -> float:
    """The router z-loss of one layer's logits (N, E) in float64 (the tests' reference)."""
    m = logits.max(-1, keepdims=True)
    lse = (m + np.log(np.exp(logits - m).sum(-1, keepdims=True)))[:, 0]
    return float((lse * lse).mean())


def reference_capacity(idx: np.ndarray, experts: int, cap: int) -> np.ndarray:
    """Which top-k assignments (N, K) survive capacity `cap` per expert, in GShard's routing order
    (all first choices in token order, then the second choices, ...): a loop (the tests' reference)."""
    used = np.zeros(experts, int)
    keep = np.zeros(idx.shape, bool)
    for j in range(idx.shape[1]):
        for n in range(idx.shape[0]):
            e = idx[n, j]
            if used[e] < cap:
                keep[n, j] = True
            used[e] += 1
    return keep


def moe_layers(cfg: ModelConfig) -> list[int]:
    """The indices of the layers that hold experts."""
    return [i for i in range(cfg.n_layers) if cfg.is_moe_layer(i)]


def reference_moe(x: np.ndarray, router: np.ndarray, w13: np.ndarray, w2: np.ndarray, k: int, norm: bool,
                  bias: np.ndarray | None = None, capacity_factor: float = 0.0) -> np.ndarray:
    """The MoE MLP in float64 numpy, expert by expert (the tests' reference): x (N, D); `bias`
    (E,) chooses the experts only (aux-loss-free balancing), `capacity_factor` drops assignments."""
    logits = x @ router.T
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    idx = np.argsort(-(p if bias is None else p + bias), -1, kind="stable")[:, :k]
    top = np.take_along_axis(p, idx, -1)
    if norm:
        top = top / top.sum(-1, keepdims=True)
    if capacity_factor > 0:
        top = top * reference_capacity(idx, router.shape[0], capacity(capacity_factor, x.shape[0], k, router.shape[0]))
    F = w13.shape[1] // 2
    y = np.zeros_like(x)
    for n in range(x.shape[0]):
        for j in range(k):
            e = idx[n, j]
            g, u = w13[e, :F] @ x[n], w13[e, F:] @ x[n]
            y[n] += top[n, j] * (w2[e] @ (g / (1 + np.exp(-g)) * u))
    return y
