"""Token negative log-likelihood in fp32, sparse (no one-hot), fast on CPU.

Design choices:
- nll = logsumexp(logits) - logits[target]. The target logit is gathered, never selected with a
  (B, T, V) one-hot; the log-sum-exp is returned too, so a z-loss (lse^2) costs nothing extra.
- Both terms are taken relative to the row maximum, so two large numbers are never subtracted
  (logits of 1e4 keep full precision).
- The sum over the vocabulary is a MatMul with a ones vector, not a ReduceSum: on MindSpore's CPU
  backend a last-axis ReduceSum over (B*T, V) is several times slower than the GEMM kernel, and
  the GEMM's backward is an outer product rather than a broadcast. Measured on (8, 256, 8000),
  forward + backward: 184 ms vs 413 ms for the ReduceSum form (PyTorch's fused cross-entropy:
  414 ms on the same run), see docs/benchmarks/train.md.
- Logits are expected in fp32 (the model's lm_head is an fp32 island); the function casts
  defensively. The reduction (sum over tokens / number of target tokens) belongs to the train
  step and eval, which know the masks and the global token count.
- `ChunkedNLL` (optim.loss_chunk_tokens): the LM head and the NLL over a chunk of tokens at a
  time, each chunk a Cell recomputed in the backward pass (`Cell.recompute()`), so the fp32 logits
  (and exp, and their gradient) of one chunk are alive at once instead of the micro-batch's: at a
  151,936-token vocabulary 4,096 tokens' logits are 2.5 GB, a 512-token chunk's 0.3 GB. The cost is
  the head's matmul once more in the backward (2*N*D*V FLOPs). MindSpore Transformers bounds this
  tensor differently (a vocabulary-parallel cross-entropy over the model-parallel group); with no
  tensor parallel under expert parallel here, chunking over tokens is what bounds it.
"""
from __future__ import annotations

import mindspore as ms
from mindspore import Tensor, nn, ops


def token_nll(logits: Tensor, targets: Tensor, plain_sum: bool = False) -> tuple[Tensor, Tensor]:
    """logits (B, T, V) fp32, targets (B, T) int -> (nll (B, T) fp32, lse (B, T) fp32).
    plain_sum (Ascend, model/decoder.py `use_fused_kernels`): the row sum is a ReduceSum, not a GEMM
    with a ones vector (a size-1 dimension wastes the matrix unit)."""
    logits = logits.astype(ms.float32)
    B, T, V = logits.shape
    peak = ops.stop_gradient(logits.max(-1, keepdims=True))  # (B, T, 1): shift for a stable exp
    e = ops.exp(logits - peak).reshape(B * T, V)  # (B*T, V)
    rows = e.sum(-1) if plain_sum else ops.matmul(e, ops.ones((V, 1), ms.float32))  # row sums (GEMM on CPU)
    shifted_lse = ops.log(rows).reshape(B, T)
    picked = ops.gather_d(logits, -1, targets.astype(ms.int32).expand_dims(-1))  # (B, T, 1)
    nll = shifted_lse - (picked - peak).squeeze(-1)  # both relative to the peak: no cancellation
    return nll, shifted_lse + peak.squeeze(-1)


class HeadChunk(nn.Cell):
    """One chunk's logits h @ w^T (fp32) and `token_nll` of them; recomputed in the backward."""

    def __init__(self, plain_sum: bool) -> None:
        super().__init__()
        self.plain_sum = plain_sum
        self.matmul = ops.MatMul(transpose_b=True)

    def construct(self, h: Tensor, w: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        logits = self.matmul(h, w).expand_dims(0)  # (1, n, V) fp32
        nll, lse = token_nll(logits, targets.expand_dims(0), self.plain_sum)
        return nll.reshape(-1), lse.reshape(-1)


class ChunkedNLL(nn.Cell):
    """`token_nll` of h @ w^T over `chunk` tokens at a time (the module docstring): h (N, D) fp32,
    w (V, D), targets (N,) -> (nll (N,), lse (N,)) fp32. The chunks are static slices (the last
    one shorter when `chunk` does not divide N)."""

    def __init__(self, chunk: int, plain_sum: bool = False) -> None:
        super().__init__()
        self.chunk = chunk
        self.head = HeadChunk(plain_sum)
        self.head.recompute()

    def construct(self, h: Tensor, w: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        n = h.shape[0]
        nlls, lses = (), ()
        for a in range(0, n, self.chunk):
            b = min(a + self.chunk, n)
            nll, lse = self.head(h[a:b], w.astype(ms.float32), targets[a:b])
            nlls, lses = nlls + (nll,), lses + (lse,)
        return ops.concat(nlls), ops.concat(lses)
