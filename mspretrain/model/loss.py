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
"""
from __future__ import annotations

import mindspore as ms
from mindspore import Tensor, ops


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
