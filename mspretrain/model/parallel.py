"""Tensor parallel (`parallel.tp`, Megatron-LM's): the Decoder of model/decoder.py cut across the tp
ranks of a group, each rank holding 1/tp of every matrix and computing 1/tp of every layer.

What is split, per layer (Megatron's column- and row-parallel linears, arXiv 1909.08053 §3):
- column-parallel `wqkv` (rows): rank r holds the q rows of query heads [r·H/tp, (r+1)·H/tp), and
  the k rows and v rows of kv heads [r·KV/tp, (r+1)·KV/tp), in that order (q | k | v, as the
  whole weight is laid out), the Qwen2 q/k/v bias with its rows; `w13` (rows): the gate rows
  [r·F/tp, (r+1)·F/tp) and the same up rows. Their input passes through `CopyToTP` (Megatron's
  `f`: identity forward, a tp all-reduce of the input's gradient backward).
- row-parallel `wo` and `w2` (columns: the input features of the local heads / the local ffn
  units); their output passes through `ReduceFromTP` (Megatron's `g`: a tp all-reduce forward,
  identity backward). One all-reduce of a (B, T, D) activation per attention and per MLP forward,
  one per attention and per MLP backward.
- vocabulary-parallel `embed` and `lm_head` (rows [r·V/tp, (r+1)·V/tp)): the embedding looks up
  the tokens in its rows, zeros for the others, and all-reduces (B, T, D); the head computes the
  local logits (B, T, V/tp) from the final norm's output (after `f`), and `VocabParallelNLL`
  reduces the (B·T,) max, sum-exp and target logit across tp as Megatron's
  `vocab_parallel_cross_entropy` does; its backward (softmax - one-hot on the local columns) is local.
- replicated: every RMSNorm weight. Their input is the residual stream, identical on every tp rank
  (the `g` all-reduces made it so), and the gradient reaching a norm's output is whole: the `f`
  after the norm all-reduced it. So each rank computes the whole, identical norm-weight gradient and
  no tp all-reduce is needed (Megatron needs one only with sequence parallelism, where each rank
  sees a slice of the tokens). Qwen3's QK-norm weights are replicated too, but each is shared by
  all heads and a rank sees its H/tp (KV/tp) heads only: its gradient is a partial sum, summed
  over tp by the train step (`PartialSum`, `TPSplit.partial`: the cells of role "partial") before the data-parallel reduction.

GQA: the kv heads are split across tp, so n_kv_heads % tp == 0 is required; fewer kv heads than
tp (replicating a kv head over several ranks, whose k/v gradients would then need an all-reduce
among those ranks) is refused, in one line naming the largest tp that divides n_kv_heads.

Collectives (`Group`): a tp group (and a dp group) of this rank, made with
`mindspore.communication.create_group` by the ranks in it, and the primitives with `group=`. By
device: HCCL on Ascend. MindSpore 2.10's CPU backend (mccl) creates sub-groups and all-reduces in
them (measured under msrun with 4 CPU ranks: tp and dp groups of 2, AllReduce in each and in the
world in one graph), but has AllReduce(SUM) only (comm_ops.py, AllReduce: "On the CPU, only 'sum'
is supported") and refuses Broadcast outside the world group ("Broadcast only support
mccl_world_group on CPU", measured): so on CPU a max is a sum of one slot per group member
followed by a max over the slots, and a broadcast in a group the group's sum of the root's value
and the others' zeros (exact: a sum of disjoint pieces).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from mspretrain.config.schema import ModelConfig
from mspretrain.errors import UserError


@dataclass(frozen=True)
class Group:
    """One communication group of this rank and how its collectives are formed (module docstring).
    `ranks`: its world ranks in group order; `rank`: this rank's index among them. `name`: a
    created communication group, None when the group is the whole world."""
    ranks: tuple[int, ...] = (0,)
    rank: int = 0
    name: str | None = None
    device: str = "cpu"
    _kw: dict[str, str] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.name:
            self._kw["group"] = self.name

    @property
    def size(self) -> int:
        return len(self.ranks)

    def all_reduce(self) -> Any:
        return ops.AllReduce(ops.ReduceOp.SUM, **self._kw)

    def max(self) -> nn.Cell:
        return GroupMax(self)

    def reduce_scatter(self) -> Any:  # Ascend only (mccl has no ReduceScatter kernel)
        return ops.ReduceScatter(ops.ReduceOp.SUM, **self._kw)

    def all_gather(self) -> Any:  # Ascend only (mccl fails on a second AllGather in one graph)
        return ops.AllGather(**self._kw)

    def broadcast(self, root: int) -> Any:
        """From group member `root` (its index in `ranks`, not its world rank); called with a 1-tuple
        and returning one, as `ops.Broadcast`.

        Broadcast's `root_rank` is the root's rank inside `group`: comm_ops.py's docstring says
        "global rank", but HCCL's HcclBroadcast takes the root's index in the communicator, and
        MindSpore 2.10's own callers convert before they reach the kernel
        (mint/distributed/distributed.py and ops/function/comm_func.py, `broadcast`:
        `src_rank = get_group_rank_from_world_rank(src, group)`; boost/adasum.py builds
        `P.Broadcast(b_rank, group=...)` with b_rank in range(len(group))). A world rank past the
        group's size fails with HCCL_E_PARA at the first step, one inside it broadcasts from the wrong
        member (issue 51). In the world group (name None) both are the same number. Only a 910B
        confirms what HCCL does with it; tests/step/test_collective_sequence.py checks the compiled
        root on every rank of the tp x dp layouts."""
        if self.device == "ascend" or self.name is None:
            return ops.Broadcast(root, **self._kw)
        return GroupBroadcast(self, root)


class GroupMax(nn.Cell):
    """The elementwise max of `x` over the group: AllReduce(MAX) with HCCL; on CPU (SUM only) every
    member's value summed into its own slot of a (size, ...) buffer, then the max over the slots."""

    def __init__(self, group: Group) -> None:
        super().__init__()
        self.native = group.device == "ascend"
        self.size, self.slot = group.size, group.rank
        self.op = ops.AllReduce(ops.ReduceOp.MAX if self.native else ops.ReduceOp.SUM, **group._kw)

    def construct(self, x: Tensor) -> Tensor:
        if self.native:
            return self.op(x)
        parts = [x.expand_dims(0)]
        if self.slot:
            parts = [ops.zeros((self.slot,) + x.shape, x.dtype)] + parts
        if self.size - self.slot - 1:
            parts = parts + [ops.zeros((self.size - self.slot - 1,) + x.shape, x.dtype)]
        return self.op(ops.concat(parts, 0)).max(axis=0)


class GroupBroadcast(nn.Cell):
    """Broadcast from group member `root` in a sub-group on CPU (mccl broadcasts in the world group
    only): the root contributes its value, the others zeros, and the group's sum is the root's value."""

    def __init__(self, group: Group, root: int) -> None:
        super().__init__()
        self.mine = group.rank == root
        self.sum = group.all_reduce()

    def construct(self, xs: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        x = xs[0]
        return (self.sum(x if self.mine else ops.zeros_like(x)),)


class CopyToTP(nn.Cell):
    """Megatron's `f`: identity forward; backward, the gradient summed over the tp group (every
    rank's column-parallel slice contributed a part of the input's gradient)."""

    def __init__(self, group: Group) -> None:
        super().__init__()
        self.sum = group.all_reduce()

    def construct(self, x: Tensor) -> Tensor:
        return x

    def bprop(self, x: Tensor, out: Tensor, dout: Tensor) -> tuple[Tensor]:
        return (self.sum(dout),)


class ReduceFromTP(nn.Cell):
    """Megatron's `g`: the partial results of a row-parallel layer summed over the tp group;
    backward, identity (the summed output is replicated, so each rank's gradient is the whole one).
    MindSpore's own AllReduce bprop is an AllReduce (grad_comm_ops.py, get_bprop_all_reduce): hence
    the hand-written one."""

    def __init__(self, group: Group) -> None:
        super().__init__()
        self.sum = group.all_reduce()

    def construct(self, x: Tensor) -> Tensor:
        return self.sum(x)

    def bprop(self, x: Tensor, out: Tensor, dout: Tensor) -> tuple[Tensor]:
        return (dout,)


class PartialSum(nn.Cell):
    """The train step's sum over tp of the gradients that are partial on each rank (Qwen3's QK-norm
    weights): one AllReduce of them flattened together, after every gradient exists (after the
    whole backward and its tp collectives, so every rank issues it at the same place)."""

    def __init__(self, indices: list[int], shapes: list[tuple[int, ...]], group: Group) -> None:
        super().__init__()
        self.indices, self.shapes = tuple(indices), tuple(tuple(s) for s in shapes)
        self.sizes = tuple(int(np.prod(s)) for s in shapes)
        self.sum = group.all_reduce()

    def construct(self, grads: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        flat = ops.concat([grads[i].reshape(-1).astype(ms.float32) for i in self.indices])
        total = self.sum(ops.depend(flat, grads))
        pieces = ops.split(total, self.sizes) if len(self.sizes) > 1 else (total,)
        out = list(grads)
        for i, shape, piece in zip(self.indices, self.shapes, pieces):
            out[i] = piece.reshape(shape).astype(grads[i].dtype)
        return tuple(out)


class VocabLookup(nn.Cell):
    """The vocabulary-parallel embedding's lookup (Embedding.tp): the tokens in this rank's rows
    [start, start + rows) are looked up, the others give zeros, and the tp sum is every token's row."""

    def __init__(self, start: int, rows: int, group: Group) -> None:
        super().__init__()
        self.start, self.rows = start, rows
        self.reduce = ReduceFromTP(group)

    def construct(self, w: Tensor, tokens: Tensor) -> Tensor:
        local = tokens - self.start
        inside = ops.logical_and(local >= 0, local < self.rows)
        out = ops.gather(w, ops.clamp(local, 0, self.rows - 1), 0)
        return self.reduce(out * inside.astype(out.dtype).expand_dims(-1))


class VocabParallelNLL(nn.Cell):
    """Token NLL and log-sum-exp from this rank's logits (B, T, V/tp) of the vocabulary columns
    [start, start + V/tp): model/loss.py `token_nll`'s numbers, with the row max, the sum of
    exp(logit - max) and the target's logit each reduced across tp, as Megatron-LM's
    `_VocabParallelCrossEntropy` (tensor_parallel/cross_entropy.py) does. Backward without a
    collective: d nll / d logits = softmax - one-hot, d lse / d logits = softmax, both on the local
    columns, with softmax = exp(logit - lse) from the forward's output.

    The three reductions are chained (the target logit's after the sum-exp's) so that every rank
    issues them in one order (CPU's runtime launches whatever is ready)."""

    def __init__(self, start: int, columns: int, group: Group, plain_sum: bool = False) -> None:
        super().__init__()
        self.start, self.columns = start, columns
        self.core = _StackedNLL(columns, group, plain_sum)

    def construct(self, logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        local = targets.astype(ms.int32) - self.start
        inside = ops.logical_and(local >= 0, local < self.columns).astype(ms.float32)  # the target is this rank's
        out = self.core(logits.astype(ms.float32), ops.clamp(local, 0, self.columns - 1), inside)
        return out[0], out[1]


class _StackedNLL(nn.Cell):
    """VocabParallelNLL's computation on the local column index of each target and whether it is
    this rank's, with (nll, lse) stacked into one tensor. Two MindSpore 2.10 limits, measured in
    graph mode, shape it: the gradient of a tuple taken apart after a cell with a bprop fails to
    compile ("The func graph is empty ... zeros_like"), and so does a composite function such as
    ops.clamp or ops.zeros_like called both in a cell's construct and in its bprop."""

    def __init__(self, columns: int, group: Group, plain_sum: bool) -> None:
        super().__init__()
        self.columns, self.plain_sum = columns, plain_sum
        self.max = group.max()
        self.sum_exp = group.all_reduce()
        self.sum_target = group.all_reduce()

    def construct(self, logits: Tensor, idx: Tensor, inside: Tensor) -> Tensor:
        B, T, V = logits.shape
        peak = self.max(ops.stop_gradient(logits.max(axis=-1)))  # (B, T)
        e = ops.exp(logits - ops.broadcast_to(peak.expand_dims(-1), logits.shape)).reshape(B * T, V)
        rows = e.sum(-1) if self.plain_sum else ops.matmul(e, ops.ones((V, 1), ms.float32)).reshape(-1)
        total = self.sum_exp(rows).reshape(B, T)
        picked = ops.gather_d(logits, -1, idx.expand_dims(-1)).squeeze(-1) * inside
        picked = self.sum_target(ops.depend(picked, total))
        shifted_lse = ops.log(total)
        return ops.stack((shifted_lse - (picked - peak), shifted_lse + peak))

    def bprop(self, logits: Tensor, idx: Tensor, inside: Tensor, out: Tensor, dout: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        lse, d_nll, d_lse = out[1], dout[0], dout[1]
        soft = ops.exp(logits - ops.broadcast_to(lse.expand_dims(-1), logits.shape))
        grad = soft * ops.broadcast_to((d_nll + d_lse).expand_dims(-1), logits.shape)
        hot = ops.one_hot(idx, self.columns, ops.ones((), ms.float32), ops.zeros((), ms.float32))
        # the target's column is on this rank (inside 1), or no column is
        grad = grad - hot * ops.broadcast_to((d_nll * inside).expand_dims(-1), logits.shape)
        return grad, idx * 0, inside * 0


# --------------------------------------------------------------------------- the split

def flash_with_heads(old: Any, heads: int) -> Any:
    """A FlashAttentionScore like `old` (model/decoder.py Attention) with `heads` heads. 2.10's
    generated primitive keeps its arguments as attributes (gen_ops_prim.py, FlashAttentionScore
    __init__: `_set_prim_arg_with_handler`); input_layout is BNSD wherever model/attention.py builds one."""
    from mindspore.ops.operations.nn_ops import FlashAttentionScore

    return FlashAttentionScore(head_num=heads, scale_value=old.scale_value, pre_tokens=old.pre_tokens,
                               next_tokens=old.next_tokens, input_layout="BNSD", sparse_mode=old.sparse_mode)


def check_tp(cfg: ModelConfig, tp: int) -> None:
    """Refuse, in one line each, a model that `parallel.tp` cannot cut (module docstring); the rule's
    one home is mspretrain/parallel/plan.py `tp_refusal`, which `plan`'s layout table asks too."""
    from mspretrain.parallel.plan import tp_refusal

    refused = tp_refusal(cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim, cfg.vocab_size, tp)
    if refused:
        raise UserError(*refused)


@dataclass(frozen=True)
class TPSplit:
    """What `Decoder.apply_tp` made of a whole model: the tp group, the whole shapes of the cut
    parameters and where this rank's piece of each lies (mspretrain/parallel/plan.py `tp_where`),
    and the replicated parameters whose gradient is partial on each rank (cells of role "partial").
    The train step (its grad norm, `PartialSum`) and step/tp.py (whole tensors in and out) read it."""
    group: Group
    whole_shapes: dict[str, tuple[int, ...]]
    where: dict[str, tuple[int, list[tuple[int, int]]]]
    partial: frozenset[str]


def tp_rows(name: str, shape: tuple[int, ...], cfg: ModelConfig, tp: int, rank: int) -> tuple[int, list[tuple[int, int]]] | None:
    """Where rank `rank`'s piece of the whole parameter `name` (of `shape`) lies, by name alone, for
    code that holds names and no model (the tests' references, checkpoint re-cuts): the parameter
    table's role and fused parts (model/params.py `tp_piece`), which tests/model/test_params.py holds
    equal to the roles the cells declare. None for a whole one."""
    from mspretrain.model.params import tp_piece

    return tp_piece(name, cfg, tp, rank)


def cut(whole: np.ndarray, where: tuple[int, list[tuple[int, int]]] | None) -> np.ndarray:
    """This rank's piece of a whole tensor (a copy), `where` from `tp_rows`."""
    if where is None:
        return np.array(whole, copy=True)
    axis, ranges = where
    return np.ascontiguousarray(np.concatenate([np.take(whole, np.arange(a, b), axis) for a, b in ranges], axis))


def place(piece: np.ndarray, where: tuple[int, list[tuple[int, int]]] | None, shape: tuple[int, ...]) -> np.ndarray:
    """The whole tensor of `shape` holding `piece` at its place and zeros elsewhere (summed over
    the tp ranks: the whole tensor). A replicated piece is placed by tp rank 0 alone (`None`
    handled by the caller)."""
    out = np.zeros(shape, piece.dtype)
    axis, ranges = where
    at = 0
    for a, b in ranges:
        index = [slice(None)] * len(shape)
        index[axis] = slice(a, b)
        src = [slice(None)] * len(shape)
        src[axis] = slice(at, at + b - a)
        out[tuple(index)] = piece[tuple(src)]
        at += b - a
    return out


def piece_tensor(arr: np.ndarray, dtype: Any, device: str) -> Tensor:
    """A rank's piece (a tp cut, a ZeRO-3 slice: host memory) as the Tensor its Parameter wraps:
    on an NPU sent to the device now, the piece alone (issue 51.2: the whole fp32 model was built
    in HBM and then cut, 122 GiB for Qwen2.5-32B against a 58 GiB pool; the model is now drawn on
    the host for these layouts, `Decoder(host_weights=True)`, train/build.py); elsewhere it stays
    on the host. `Tensor.to("Ascend")` as model/decoder.py `_draw` (MindSpore 2.10
    common/tensor.py). Pass the result straight to `Parameter(..., name, grad)`, positionally and
    unnamed (decoder.py `_normal` says why: another reference makes MindSpore copy it back)."""
    t = Tensor(arr).astype(dtype)
    if device == "ascend" and ms.get_current_device().device_target == "Ascend":
        return t.to("Ascend")
    return t


def split_model(model: Any, tp: Group) -> TPSplit:
    """Cut a whole Decoder (model/decoder.py) into this rank's tensor-parallel piece, in place: the
    decoder's own `apply_tp` (each cell cut by its declared role, model/layers.py)."""
    return model.apply_tp(tp)
