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
- Per block, the block's expert weights are gathered and one batched MatMul runs the SwiGLU of all
  blocks: (R/b, b, D) x (R/b, D, 2F). Cost: the active FLOPs times R/A (b is the mean group
  size, at most 64, so padding at most doubles the rows), plus a copy of one expert's weights per
  block (R/b copies of 3*F*D values). On CPU that copy is the price of static shapes without a
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

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from mspretrain.config.schema import ModelConfig
from mspretrain.model.layers import Linear, WeightSource
from mspretrain.model.moe_kernels import grouped_experts

MAX_BLOCK = 64  # rows per expert block at most (see the module docstring)


class Stacked(nn.Cell):
    """One weight (E, out, in) for all experts, named `weight` like Linear's (so `mlp.w13.weight`)."""

    def __init__(self, experts: int, out_dim: int, in_dim: int, std: float, rng: WeightSource) -> None:
        super().__init__()
        self.weight = rng.parameter((experts, out_dim, in_dim), std)


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
        self.w13 = Stacked(cfg.num_experts, 2 * self.ffn, cfg.dim, cfg.init_std, rng)
        self.w2 = Stacked(cfg.num_experts, cfg.dim, self.ffn, cfg.init_std / math.sqrt(2 * cfg.n_layers), rng)
        self.bmm_t = ops.BatchMatMul(transpose_b=True)
        self.grouped = False  # the Ascend kernels instead of the blocks (set by the Decoder, model/moe_kernels.py)
        # Qwen2-MoE: a shared expert every token goes through, scaled by sigmoid(x Wg^T) (Qwen2MoeSparseMoeBlock)
        self.shared_ffn = cfg.shared_expert_ffn_dim
        if self.shared_ffn:
            S = self.shared_ffn
            self.shared_w13 = Linear(cfg.dim, 2 * S, cfg.init_std, rng, dtype, role="column", blocks=(S, S))
            self.shared_w2 = Linear(S, cfg.dim, cfg.init_std / math.sqrt(2 * cfg.n_layers), rng, dtype, role="row")
            self.shared_gate = Linear(cfg.dim, 1, cfg.init_std, rng, dtype)

    def route(self, x2: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x2 (N, D) -> (probs (N, E) fp32, top-k weights (N, K) compute dtype, top-k experts (N, K) int32)."""
        logits = self.router(x2)
        probs = ops.softmax(logits.astype(ms.float32), -1)
        top, idx = ops.topk(probs, self.top_k)
        if self.norm_topk:
            top = top / top.sum(-1, keepdims=True)
        return probs, top.astype(self.dtype), idx.astype(ms.int32)

    def construct(self, x: Tensor) -> tuple[Tensor, Tensor]:
        B, T, D = x.shape
        N, E, K, F = B * T, self.experts, self.top_k, self.ffn
        A = N * K
        b = block_rows(A, E)
        R = -(-(A + E * (b - 1)) // b) * b  # static bound on the padded rows
        x2 = x.reshape(N, D)
        probs, top, idx = self.route(x2)
        if self.grouped:  # Ascend: MindSpore's fused permutation and grouped matmul (model/moe_kernels.py)
            ya, counts = grouped_experts(x2, idx, top, self.w13.weight, self.w2.weight, self.dtype)
        else:  # the sorted, padded blocks (module docstring)
            e = ops.stop_gradient(idx.reshape(A))  # (A,) expert of each assignment, token-major
            onehot = ops.one_hot(e, E, Tensor(1, ms.int32), Tensor(0, ms.int32))  # (A, E)
            rank = ops.gather_d(ops.cumsum(onehot, 0), 1, e.reshape(A, 1)).reshape(A) - 1  # rank within its expert
            counts = onehot.sum(0)  # (E,)
            padded = (counts + (b - 1)) // b * b
            ends = ops.cumsum(padded, 0)
            dest = ops.gather(ends - padded, e, 0) + rank  # (A,) its row in the padded buffer
            # which assignment fills each padded row (A: none, the zero row)
            src = ops.scatter_nd(dest.reshape(A, 1), ops.arange(1, A + 1, dtype=ms.int32), (R,)) - 1
            src = ops.stop_gradient(ops.select(src < 0, ops.fill(ms.int32, (R,), A), src))
            xa = ops.broadcast_to(x2.expand_dims(1), (N, K, D)).reshape(A, D)
            xp = ops.gather(ops.concat((xa, ops.zeros((1, D), x.dtype)), 0), src, 0)  # (R, D)
            # the expert of each block: the number of segments ending at or before its first row
            starts = ops.arange(0, R, b, dtype=ms.int32).reshape(R // b, 1)
            block_e = ops.minimum((starts >= ends.reshape(1, E)).astype(ms.int32).sum(1), E - 1)
            block_e = ops.stop_gradient(block_e)
            w13, w2 = ops.gather(self.w13.weight, block_e, 0), ops.gather(self.w2.weight, block_e, 0)
            if self.dtype != ms.float32:
                w13, w2 = w13.astype(self.dtype), w2.astype(self.dtype)
            xb = xp.reshape(R // b, b, D)
            gate = self.bmm_t(xb, w13[:, :F])  # (R/b, b, F)
            up = self.bmm_t(xb, w13[:, F:])
            yb = self.bmm_t(ops.silu(gate) * up, w2).reshape(R, D)
            ya = ops.gather(yb, dest, 0) * top.reshape(A, 1)  # (A, D), weighted
        y = ya.reshape(N, K, D).sum(1)
        if self.shared_ffn:
            g, u = self.shared_w13.parts(x2, (self.shared_ffn, self.shared_ffn))
            y = y + ops.sigmoid(self.shared_gate(x2)) * self.shared_w2(ops.silu(g) * u)
        y = y.reshape(B, T, D)
        stats = ops.stack((probs.sum(0), ops.stop_gradient(counts.astype(ms.float32))))
        return y, stats


def balance_loss(stats: Tensor, rows: int, experts: int) -> Tensor:
    """transformers' `load_balancing_loss_func` from summed stats: stats (2, E) = (sum over the MoE
    layers' tokens of router probabilities, of top-k assignment counts), `rows` = tokens x MoE
    layers: E * sum_e (counts_e / rows) * (probs_e / rows)."""
    return (stats[0] * stats[1]).sum() * (experts / float(rows) / float(rows))


def load_metrics(per: np.ndarray, layers: list[int], top_k: int) -> dict[str, float]:
    """The expert-load metrics of one step (issue 52.6; names in docs/operators.md) from each MoE
    layer's routing stats summed over the step's micro-batches, per (L_moe, 2, E): router
    probability sums and top-k assignment counts over this rank's tokens.

    - `moe/layer_{i}/max_over_mean`: the busiest expert's assignments over the mean (1 = balanced,
      E/K at most: every token sends one of its K choices to that expert);
    - `moe/layer_{i}/top_share`: the share of the layer's tokens that chose the busiest expert (K/E
      balanced, 1 = every token; a router collapse, forensics/diagnose.py);
    - `moe/balance_loss`: transformers' load-balancing loss over the step's tokens of all MoE
      layers together (`balance_loss`'s formula; the objective's is per micro-batch, so with
      accumulation the two differ), whether or not `router_aux_loss_coef` weights it in;
    - `moe/dropped_tokens`: 0, routing is dropless (no capacity factor yet)."""
    per = np.asarray(per, dtype=np.float64)
    probs, counts = per[:, 0], per[:, 1]
    experts = per.shape[-1]
    out: dict[str, float] = {}
    for i, c, p in zip(layers, counts, probs):
        tokens = p.sum()  # each token's probabilities sum to 1
        mean = c.sum() / experts
        out[f"moe/layer_{i}/max_over_mean"] = float(c.max() / mean) if mean > 0 else 0.0
        out[f"moe/layer_{i}/top_share"] = float(c.max() / tokens) if tokens > 0 else 0.0
    rows = probs.sum()
    out["moe/balance_loss"] = float((counts.sum(0) * probs.sum(0)).sum() * experts / rows / rows) if rows > 0 else 0.0
    out["moe/dropped_tokens"] = 0.0
    return out


def moe_layers(cfg: ModelConfig) -> list[int]:
    """The indices of the layers that hold experts."""
    return [i for i in range(cfg.n_layers) if cfg.is_moe_layer(i)]


def reference_moe(x: np.ndarray, router: np.ndarray, w13: np.ndarray, w2: np.ndarray, k: int, norm: bool) -> np.ndarray:
    """The MoE MLP in float64 numpy, expert by expert (the tests' reference): x (N, D)."""
    logits = x @ router.T
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    idx = np.argsort(-p, -1, kind="stable")[:, :k]
    top = np.take_along_axis(p, idx, -1)
    if norm:
        top = top / top.sum(-1, keepdims=True)
    F = w13.shape[1] // 2
    y = np.zeros_like(x)
    for n in range(x.shape[0]):
        for j in range(k):
            e = idx[n, j]
            g, u = w13[e, :F] @ x[n], w13[e, F:] @ x[n]
            y[n] += top[n, j] * (w2[e] @ (g / (1 + np.exp(-g)) * u))
    return y
