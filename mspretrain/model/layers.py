"""The Llama's building blocks below attention (model/decoder.py's docstring has the design): the
numerics (fp32 islands, the GEMM row sums), the weight-holding cells Linear, Embedding, RMSNorm.

Whole weights as arguments. Each weight-holding cell computes with its own Parameter, or with a
whole weight handed to it (`construct(x, w)`): under ZeRO-3 the cell's Parameter is this rank's
slice and the decoder block gathers the weights of all its cells first, as one chain
(model/block.py `Block.pull`, step/zero3.py). `pull(token)` is a cell's part of that chain:
its weight (and bias) gathered after `token`, and the token the next gather waits for.

Declared split. Every weight-holding cell is a `WeightCell` and says at construction how tensor
parallel cuts it (`role`, one of mspretrain/parallel/plan.py `ROLES`: "column", "row", "vocab",
"replicated", "partial"; `blocks`, a fused column weight's row blocks), in the spirit of
OLMo-core's `apply_tp` and torchtitan's parallelize plans: `apply_tp(group)` replaces its
Parameters by this rank's pieces and attaches the collective its role needs (model/parallel.py has
the design). The block and the decoder call their cells' (model/block.py, model/decoder.py
`Decoder.apply_tp`). The ZeRO-3 gathers (`gather`, `bias_gather`) and the tp collective (`tp_out`)
are declared here too, None until step/zero3.py or `apply_tp` sets them, so nothing probes a cell.
"""
from __future__ import annotations

from typing import Any, Protocol

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

COMPUTE_DTYPES = {"fp32": ms.float32, "fp16": ms.float16, "bf16": ms.bfloat16}
NEG = -1e9  # additive mask value; the softmax runs in fp32, so exp(NEG - max) is exactly 0
FLASH_MASK_SIZE = 2048  # FlashAttentionScore's compressed causal mask is always 2048 x 2048


class WeightSource(Protocol):
    """Where a cell's initial weight comes from: model/decoder.py `InitStreams` (the seeded draw)."""

    def parameter(self, shape: tuple[int, ...], std: float) -> Parameter: ...


def one(x: Tensor) -> Tensor:
    """ZeRO-3's ordering token of `x`: its first element. A gather anchored on it waits for x as it
    would on x itself, and the anchor's gradient its bprop returns (step/zero3.py `ShardedGather`,
    zeros that wait for the reduce-scatter) is one element: anchored on the whole tensor, the
    frontend folded each into a constant of the whole weight's (or activation's) shape, three a
    layer held for the graph's life (issue 51)."""
    return x.reshape(-1)[:1]


def relay(last: Tensor, after: Tensor) -> Tensor:
    """ZeRO-3's token out of a chain of gathers: one element of `last` (the chain's last gathered
    weight), available once `after` is too. A later chain anchored on it starts after both; one
    element, so that a cell returning it (Block) keeps no whole weight alive for it."""
    return ops.depend(last.reshape(-1)[:1], after)


def row_sum(x: Tensor) -> Tensor:
    """Sum over the last axis as a GEMM with a ones vector: (..., D) -> (..., 1) fp32. MindSpore's CPU
    ReduceSum is several times slower than its MatMul kernel on these shapes (see loss.py)."""
    D = x.shape[-1]
    return ops.matmul(x.reshape(-1, D), ops.ones((D, 1), ms.float32)).reshape(x.shape[:-1] + (1,))


def spread(col: Tensor, n: int) -> Tensor:
    """(..., 1) -> (..., n), the column repeated, as an outer-product GEMM with a ones row. MindSpore's
    CPU elementwise kernels take 2.5x longer when an operand is broadcast ((2048, 256) * (2048, 1):
    0.85-0.97 ms vs 0.34-0.46 ms same-shape), so a column used by same-shape ops is spread first."""
    return ops.matmul(col.reshape(-1, 1), ops.ones((1, n), col.dtype)).reshape(col.shape[:-1] + (n,))


def rms_statistic(x: Tensor, eps: float) -> Tensor:
    """1 / RMS over the last axis in fp32 (an fp32 island): x (..., D) -> (..., 1) float32."""
    xf = x.astype(ms.float32)
    return ops.rsqrt(row_sum(xf * xf) / x.shape[-1] + eps)


def softmax_fp32(scores: Tensor) -> Tensor:
    """Attention softmax in fp32 (an fp32 island), whatever the compute dtype."""
    return ops.softmax(scores.astype(ms.float32), -1)


class SoftmaxFP32(nn.Cell):
    """softmax_fp32 with a hand-written backward, dx = p * (dp - rowsum(dp * p)), whose row sum is a
    GEMM: MindSpore's generated softmax backward spends most of its time in ReduceSum."""

    def construct(self, scores: Tensor) -> Tensor:
        return softmax_fp32(scores)

    def bprop(self, scores: Tensor, out: Tensor, dout: Tensor) -> tuple[Tensor]:
        return ((out * (dout - spread(row_sum(dout * out), out.shape[-1]))).astype(scores.dtype),)


class RMSNormFn(nn.Cell):
    """y = x * rms_statistic(x) * w, with the statistics in fp32 and a hand-written backward (the
    generated one is a chain of slow ReduceSum/Tile ops): with xh = x * r and g = dy * w,
    dw = sum over tokens of dy * xh, dx = r * (g - xh * mean(g * xh))."""

    def __init__(self, eps: float, dtype: ms.Type) -> None:
        super().__init__()
        self.eps = eps
        self.dtype = dtype

    def construct(self, x: Tensor, w: Tensor) -> Tensor:
        y = x.astype(ms.float32) * spread(rms_statistic(x, self.eps), x.shape[-1])
        if self.dtype == ms.float32:
            return y * w
        return y.astype(self.dtype) * w.astype(self.dtype)

    def bprop(self, x: Tensor, w: Tensor, out: Tensor, dout: Tensor) -> tuple[Tensor, Tensor]:
        D = x.shape[-1]
        r_row = rms_statistic(x, self.eps)  # recomputed: (..., 1) fp32
        r = spread(r_row, D)
        xh = x.astype(ms.float32) * r  # (..., D)
        dy = dout.astype(ms.float32)
        dw = ops.matmul(ops.ones((1, dy.size // D), ms.float32), (dy * xh).reshape(-1, D)).reshape(D)  # column sum
        g = dy * w
        dx = r * g - spread(r_row * (row_sum(g * xh) / D), D) * xh
        return dx.astype(x.dtype), dw


class WeightCell(nn.Cell):
    """A cell holding a `weight` (and maybe a `bias`) Parameter, with its declared tensor-parallel
    `role` and the slots the parallel layouts fill (module docstring)."""

    def __init__(self, role: str, blocks: tuple[int, ...] | None = None) -> None:
        super().__init__()
        from mspretrain.parallel.plan import ROLES

        if role not in ROLES:
            raise ValueError(f"split role {role!r} is not one of {ROLES}")
        self.role, self.blocks = role, blocks
        self.has_bias = False
        self.gather = None  # ZeRO-3: a ShardedGather, `weight` then this rank's slice (step/zero3.py)
        self.bias_gather = None  # ZeRO-3, the same for the bias
        self.tp_out = None  # tensor parallel: the collective on the output its role needs (`apply_tp`)

    def _cut(self, attr: str, group: Any) -> tuple[tuple[int, ...], Any] | None:
        """Replace Parameter `attr` by tp rank `group.rank`'s piece of it (same name, dtype and
        requires_grad): (its whole shape, where the piece lies), or None for a whole one."""
        from mspretrain.model.lazy import whole_value
        from mspretrain.model.parallel import cut, piece_tensor
        from mspretrain.parallel.plan import tp_where

        p = getattr(self, attr)
        where = tp_where(self.role, tuple(p.shape), self.blocks, group.size, group.rank)
        if where is None:
            return None
        name, dtype, grad, shape = p.name, p.dtype, p.requires_grad, tuple(p.shape)
        # whole_value: a lazily drawn weight is drawn into an array freed as soon as it is cut, not
        # into the dropped Parameter (which only the cycle collector frees: model/lazy.py)
        setattr(self, attr, Parameter(piece_tensor(cut(whole_value(p), where), dtype, group.device), name, grad))
        getattr(self, attr).name = name  # the Cell may prefix a Parameter assigned later: keep the model's name
        return shape, where

    def apply_tp(self, group: Any) -> dict[str, tuple[tuple[int, ...], Any]]:
        """Cut this cell's Parameters to tp rank `group.rank`'s pieces by its role; returns
        {parameter name: (whole shape, where)} of the cut ones. The collective a role needs is the
        subclass's to attach."""
        out = {}
        for attr in ("weight", "bias") if self.has_bias else ("weight",):
            name = getattr(self, attr).name
            done = self._cut(attr, group)
            if done is not None:
                out[name] = done
        return out


class Linear(WeightCell):
    """y = x @ W^T (+ b); W (out, in) fp32, cast to the compute dtype at use. The bias (Qwen2's q/k/v)
    starts at zero, as transformers' `_init_weights` sets it. `w`, `b`: the whole weight and bias
    when the Parameters are ZeRO-3 slices (`pull`), else None (the Parameters). `role`: how tensor
    parallel cuts it ("column": its output rows, per row block of `blocks`; "row": its input
    columns, its output then summed over tp; "vocab": the lm_head's rows; "replicated": whole)."""

    def __init__(self, in_dim: int, out_dim: int, std: float, rng: WeightSource, dtype: ms.Type,
                 bias: bool = False, role: str = "replicated", blocks: tuple[int, ...] | None = None) -> None:
        super().__init__(role, blocks)
        self.out_dim = out_dim
        self.dtype = dtype
        self.weight = rng.parameter((out_dim, in_dim), std)
        self.has_bias = bias
        if bias:
            self.bias = Parameter(Tensor(np.zeros(out_dim, np.float32)), name="bias")
        self.matmul = ops.MatMul(transpose_b=True)

    def pull(self, token: Tensor) -> tuple[Tensor, Tensor | None, Tensor]:
        """(weight, bias or None, token): each gathered after the token (the bias after its own
        weight, so the two are ordered), the token then the last gathered one; a Parameter that
        is not sharded (frozen) is itself and leaves the token as it is."""
        if self.gather is None:
            w = self.weight
        else:
            w = self.gather(self.weight, token)
            token = one(w)
        if not self.has_bias:
            return w, None, token
        if self.bias_gather is None:
            return w, self.bias, token
        b = self.bias_gather(self.bias, token)
        return w, b, one(b)

    def _weights(self, w: Tensor | None, b: Tensor | None) -> tuple[Tensor, Tensor | None]:
        if w is None:
            w, b = self.weight, (self.bias if self.has_bias else None)
        if self.has_bias and self.dtype != ms.float32:
            b = b.astype(self.dtype)
        return (w if self.dtype == ms.float32 else w.astype(self.dtype)), b

    def construct(self, x: Tensor, w: Tensor | None = None, b: Tensor | None = None) -> Tensor:
        w, b = self._weights(w, b)
        lead = x.shape[:-1]
        y = self.matmul(x.reshape(-1, x.shape[-1]), w)  # (N, out)
        if self.has_bias:
            y = y + b
        y = y.reshape(lead + (self.out_dim,))
        return y if self.tp_out is None else self.tp_out(y)

    def parts(self, x: Tensor, rows: tuple[int, ...], w: Tensor | None = None, b: Tensor | None = None) -> tuple[Tensor, ...]:
        """x @ W_i^T for consecutive row blocks W_i of a fused weight. The weight is split, not the
        output: on CPU, MindSpore's Split/Concat copy, and an (out, in) weight is far smaller than the
        (tokens, out) activation, so this beats one big MatMul followed by a split (see train.md)."""
        w, b = self._weights(w, b)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])  # (N, in)
        if self.has_bias:
            return tuple((self.matmul(x2, wi) + bi).reshape(lead + (n,))
                         for wi, bi, n in zip(ops.split(w, rows, 0), ops.split(b, rows, 0), rows))
        return tuple(self.matmul(x2, wi).reshape(lead + (n,)) for wi, n in zip(ops.split(w, rows, 0), rows))

    def apply_tp(self, group: Any) -> dict[str, tuple[tuple[int, ...], Any]]:
        if self.has_bias and self.role != "column":  # a row-parallel bias would be added tp times
            raise ValueError(f"a {self.role} Linear with a bias is not cut by tensor parallel")
        out = super().apply_tp(group)
        if self.role == "column":
            self.out_dim //= group.size
        elif self.role == "row":
            from mspretrain.model.parallel import ReduceFromTP

            self.tp_out = ReduceFromTP(group)
        return out


class Embedding(WeightCell):
    """The token embedding; `role` "vocab": tensor parallel cuts its rows (the vocabulary)."""

    def __init__(self, vocab: int, dim: int, std: float, rng: WeightSource, role: str = "vocab") -> None:
        super().__init__(role)
        self.weight = rng.parameter((vocab, dim), std)
        self.tp = None  # tensor parallel: the vocabulary-parallel lookup of this rank's rows (model/parallel.py)

    def pull(self, token: Tensor) -> tuple[Tensor, Tensor]:  # as Linear.pull
        if self.gather is None:
            return self.weight, token
        w = self.gather(self.weight, token)
        return w, one(w)

    def construct(self, tokens: Tensor, w: Tensor | None = None) -> Tensor:
        w = self.weight if w is None else w
        if self.tp is not None:
            return self.tp(w, tokens)
        return ops.gather(w, tokens, 0)  # (B, T) -> (B, T, D) fp32

    def apply_tp(self, group: Any) -> dict[str, tuple[tuple[int, ...], Any]]:
        from mspretrain.model.parallel import VocabLookup

        out = super().apply_tp(group)
        rows = int(self.weight.shape[0])
        self.tp = VocabLookup(group.rank * rows, rows, group)
        return out


class RMSNorm(WeightCell):
    """`fused` (set by Decoder on Ascend, `use_fused_kernels`): MindSpore's RmsNorm kernel, statistics
    and weight in fp32 as MindSpore Transformers' LlamaRMSNorm runs it (compute_type fp32), with
    its generated RmsNormGrad; else the CPU form above (`RMSNormFn`). RmsNorm has no CPU kernel in
    MindSpore 2.10 (ops/auto_generate/gen_ops_def.py, `rms_norm`: "Supported Platforms: Ascend").
    `role`: "replicated" (whole on every tp rank; it feeds column-parallel layers, so its output
    passes Megatron's `f`), or "partial" (Qwen3's QK-norms: whole, each rank's gradient a part)."""

    def __init__(self, dim: int, eps: float, dtype: ms.Type, role: str = "replicated") -> None:
        super().__init__(role)
        self.fn = RMSNormFn(eps, dtype)
        self.weight = Parameter(Tensor(np.ones(dim, np.float32)), name="weight")
        self.fused = False

    def pull(self, token: Tensor) -> tuple[Tensor, Tensor]:  # as Linear.pull
        if self.gather is None:
            return self.weight, token
        w = self.gather(self.weight, token)
        return w, one(w)

    def construct(self, x: Tensor, w: Tensor | None = None) -> Tensor:  # w: the whole weight (ZeRO-3)
        w = self.weight if w is None else w
        if self.fused:
            y = ops.rms_norm(x.astype(ms.float32), w, self.fn.eps)[0]
            y = y if self.fn.dtype == ms.float32 else y.astype(self.fn.dtype)
        else:
            y = self.fn(x, w)
        return y if self.tp_out is None else self.tp_out(y)

    def apply_tp(self, group: Any) -> dict[str, tuple[tuple[int, ...], Any]]:
        if self.role == "replicated":  # Megatron's `f` before the column-parallel layer it feeds
            from mspretrain.model.parallel import CopyToTP

            self.tp_out = CopyToTP(group)
        return {}


class SoftmaxPlain(nn.Cell):
    """softmax_fp32 with MindSpore's generated backward: Ascend's SoftmaxGrad kernel, where the
    row-sum GEMM of `SoftmaxFP32.bprop` would be a size-1 matmul on the matrix unit."""

    def construct(self, scores: Tensor) -> Tensor:
        return softmax_fp32(scores)


def use_fused_kernels(device: str) -> bool:
    """The kernels by device, like the attention kernel: Ascend runs MindSpore's fused RmsNorm and
    plain reductions; the CPU keeps the GEMM forms (row_sum / spread) tuned for its backend."""
    return device == "ascend"


