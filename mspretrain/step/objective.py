"""The loss a train step differentiates, for one micro-batch (step/step.py compiles it).

Loss = summed token NLL (fp32 log-softmax) times `scale / global_tokens`, plus the z-loss
(`optim.z_loss`, on the log-sum-exp) and, for a mixture of experts, transformers' load-balancing
loss weighted by `router_aux_loss_coef` and the router z-loss weighted by `router_z_loss_coef`
(both per micro-batch of the whole data-parallel world: its routing stats summed over the ranks,
weighted by its share of the tokens). Under tensor parallel the NLL and the log-sum-exp come
from this rank's vocabulary columns (the decoder's `tp_loss`, model/parallel.py
`VocabParallelNLL`), else from `model/loss.py` `token_nll`. Split out of step/step.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from mindspore import Tensor, ops

from mspretrain.config.schema import ModelConfig, OptimConfig
from mspretrain.model.layers import use_fused_kernels
from mspretrain.model.moe import StatRows, stat_rows


@dataclass(frozen=True)
class Objective:
    """The objective function `fn(tokens, positions, segments, scale)` -> (scaled loss, NLL sum,
    per-row NLL[, per-layer routing stats]) and what the step needs to know of it."""
    fn: Callable[..., Any]
    plain_sums: bool  # Ascend: plain reductions instead of the CPU's GEMM forms
    moe_layers: list[int]  # the MoE layers whose routing stats every step returns (empty: dense)
    moe_k: int  # experts per token (0: dense)
    moe_rows: StatRows = StatRows()  # the rows of the routing stats (model/moe.py)
    bias_rate: float = 0.0  # model.router_bias_update_rate: the step moves the routing biases after each update

    @property
    def moe_stats(self) -> bool:
        return bool(self.moe_layers)


def make_objective(model: Any, optim: OptimConfig, *, global_tokens: float, device: str,
                   cfg: ModelConfig | None, tp_loss: Any = None, stats_group: Any = None) -> Objective:
    """`cfg`: the decoder's config (None: a model without one, the tests' toys: dense, no MoE);
    `tp_loss`: the vocabulary-parallel loss of a model cut by tensor parallel, else None;
    `stats_group`: the data-parallel group (model/parallel.py `Group`) over which an MoE's routing
    stats are summed before the balance and router z-losses are formed (None: one rank)."""
    from mspretrain.model.loss import ChunkedNLL, token_nll
    from mspretrain.model.moe import balance_loss, moe_layers, z_loss

    # Ascend: plain reductions instead of the CPU's GEMM forms (model/decoder.py `use_fused_kernels`)
    plain = use_fused_kernels(device)
    inv_tokens = 1.0 / global_tokens
    z = float(optim.z_loss)
    mcfg = cfg
    moe = mcfg is not None and bool(mcfg.num_experts)
    # MoE (model/moe.py): transformers' load-balancing loss, weighted by router_aux_loss_coef
    balance = float(mcfg.router_aux_loss_coef) if moe else 0.0
    # and the router z-loss (ST-MoE), weighted by router_z_loss_coef
    zr = float(mcfg.router_z_loss_coef) if moe else 0.0
    rows = stat_rows(mcfg) if moe else StatRows()
    sparse_layers = sum(mcfg.is_moe_layer(i) for i in range(mcfg.n_layers)) if balance > 0 or zr > 0 else 0
    # MoE: every step also returns each MoE layer's routing stats (L_moe, 2, E), read back with
    # the rows, for the expert-load metrics; a dense model's graphs are unchanged
    layers_moe = moe_layers(mcfg) if moe else []
    moe_stats = bool(layers_moe)
    # The routing stats of the whole data-parallel world (issue 52: the balance loss "counted over the
    # global batch as Qwen3 does"): an AllReduce with an identity backward (model/parallel.py
    # `ReduceFromTP`), so each rank's router receives exactly its own tokens' part of one process's
    # gradient of the loss formed from the world's sums, and the data-parallel reduction adds them.
    dp = stats_group.size if stats_group is not None and moe_stats else 1
    stats_sum = None
    if dp > 1:
        from mspretrain.model.parallel import ReduceFromTP

        stats_sum = ReduceFromTP(stats_group)

    # optim.loss_chunk_tokens: the head and the NLL over chunks of tokens, each recomputed in the
    # backward (model/loss.py `ChunkedNLL`); a Decoder's, without tensor parallel (config refuses both)
    chunk = int(optim.loss_chunk_tokens) if cfg is not None and tp_loss is None else 0
    chunked = ChunkedNLL(chunk, plain) if chunk else None
    whole = not chunk  # the decoder returns the logits, else (h, head weight)

    def objective(tokens: Tensor, positions: Tensor | None, segments: Tensor | None, scale: Tensor):
        inputs, targets = tokens[:, :-1], tokens[:, 1:]  # (B, T) each
        per = None
        if moe_stats:  # MoE: each layer's routing stats; their sum feeds the load-balancing loss
            logits, per = model(inputs, positions, segments, True, True, whole)
            if stats_sum is not None:  # after the whole forward (its collectives), before any backward one
                first = logits if whole else logits[0]
                per = stats_sum(ops.depend(per, first))
                logits = ops.depend(logits, per) if whole else (ops.depend(logits[0], per), logits[1])
            routed = per[0]
            for i in range(1, len(layers_moe)):  # in layer order, as the decoder's own sum
                routed = routed + per[i]
        else:
            # (B, T, V) fp32, or chunked (h, head weight); a toy model (the tests') takes three arguments
            logits = model(inputs, positions, segments) if whole else model(inputs, positions, segments, False, False, False)
            routed = None
        # (B, T) fp32 each; tensor parallel: from the local vocabulary columns (model/parallel.py)
        if chunked is not None:
            nll, lse = chunked(logits[0], logits[1], targets.reshape(-1))
            nll, lse = nll.reshape(targets.shape), lse.reshape(targets.shape)
        elif tp_loss is None:
            nll, lse = token_nll(logits, targets, plain_sum=plain)
        else:
            nll, lse = tp_loss(logits, targets)
        nll_sum = nll.sum()
        obj = nll_sum
        if z > 0:
            obj = obj + z * (lse * lse).sum()
        if balance > 0:  # per micro-batch, weighted by its share of the tokens (docs/design.md, MoE)
            n = inputs.shape[0] * inputs.shape[1] * dp  # the world's tokens of this micro-batch
            obj = obj + balance_loss(routed, n * sparse_layers, mcfg.num_experts) * (balance * n)
        if zr > 0:  # as the balance loss: per micro-batch, weighted by its share of the tokens
            n = inputs.shape[0] * inputs.shape[1] * dp
            obj = obj + z_loss(routed, rows.z, n * sparse_layers) * (zr * n)
        if moe_stats:
            return obj * (scale * inv_tokens), nll_sum, nll.sum(-1), ops.stop_gradient(per)
        return obj * (scale * inv_tokens), nll_sum, nll.sum(-1)

    return Objective(objective, plain, layers_moe, int(mcfg.experts_per_token) if layers_moe else 0, rows,
                     float(mcfg.router_bias_update_rate) if layers_moe else 0.0)
