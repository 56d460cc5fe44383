"""Independent references of kernels only Ascend has: `rms_norm_reference`, `kernel_discard`,
`flash_reference`."""
from __future__ import annotations

import numpy as np


def rms_norm_reference(x, gamma, epsilon=1e-6):
    """ops.rms_norm's documented semantics (ops/auto_generate/gen_ops_def.py, `rms_norm`):
    y = x * rsqrt(mean(x^2, -1) + eps) * gamma, and rstd; computed here with CPU ops."""
    from mindspore import ops

    rstd = ops.rsqrt((x * x).mean(-1, keep_dims=True) + epsilon)
    return x * rstd * gamma, rstd


def kernel_discard(sparse_mode: int, pre_tokens: int, next_tokens: int, attn_mask: np.ndarray, S: int) -> np.ndarray:
    """The mask FlashAttentionScore applies for self-attention of length S (1 = discard), as 2.10's
    docstring (ops/auto_generate/gen_ops_prim.py) documents it, broadcastable to (B, N1, S, S):

    - the band: query i computes keys i - pre_tokens <= j <= i + next_tokens ("the part between
      counting preTokens and nextTokens"; the bounds as Huawei's CPU golden of the kernel draws them,
      mindstudio-probe's npu_fusion_attention.py generate_atten_mask);
    - sparse_mode 2 (leftUpCausal) and 4 (band) take the compressed 2048x2048 mask, triu(1), and
      apply causal (2, pre/next ignored) or the band (4); S1 == S2 here, so left-up and right-down
      origins coincide;
    - sparse_mode 0 takes the full (B, 1, S, S) mask and computes only within the band."""
    i, j = np.arange(S)[:, None], np.arange(S)[None, :]
    outside_band = (j - i > next_tokens) | (i - j > pre_tokens)
    if sparse_mode in (2, 4):
        assert attn_mask.shape == (2048, 2048) and np.array_equal(attn_mask, np.triu(np.ones((2048, 2048), bool), 1))
        return (j > i)[None, None] if sparse_mode == 2 else outside_band[None, None]
    assert sparse_mode == 0 and attn_mask.ndim == 4 and attn_mask.shape[1:] == (1, S, S)
    return attn_mask | outside_band[None, None]


def flash_reference(prim, seen: list | None = None, out_dtype=np.float16):
    """FlashAttentionScore as documented (BNSD; N2 divides N1; the mask of `kernel_discard`), in
    numpy, with layout assertions; `seen` collects (sparse_mode, pre_tokens, next_tokens, attn_mask).

    UNVERIFIED ON HARDWARE: this is checked against our reading of the kernel's docs, not against
    the kernel (CPU has none). A misreading shared by the model code and this stand-in passes
    here; `mspretrain selftest` runs the same comparison against the real kernel on a 910B."""
    import mindspore as ms

    attrs = prim.init_attrs

    def run(q, k, v, real_shift, drop_mask, padding_mask, attn_mask, prefix, qlen, kvlen):
        assert attrs["input_layout"] == "BNSD" and attrs["keep_prob"] == 1.0
        assert real_shift is None and drop_mask is None and padding_mask is None and prefix is None and qlen is None
        assert q.dtype == k.dtype == v.dtype and q.dtype in (ms.float16, ms.bfloat16)
        qn, kn, vn = (t.asnumpy().astype(np.float32) for t in (q, k, v))
        B, N1, S1, D = qn.shape
        N2 = kn.shape[1]
        assert attrs["head_num"] == N1 and N1 % N2 == 0 and kn.shape == vn.shape == (B, N2, S1, D)
        mask = attn_mask.asnumpy().astype(bool)
        if seen is not None:
            seen.append((attrs["sparse_mode"], attrs["pre_tokens"], attrs["next_tokens"], attn_mask))
        discard = kernel_discard(attrs["sparse_mode"], attrs["pre_tokens"], attrs["next_tokens"], mask, S1)
        kr, vr = np.repeat(kn, N1 // N2, axis=1), np.repeat(vn, N1 // N2, axis=1)  # head h uses kv head h // G
        s = attrs["scale_value"] * qn @ kr.transpose(0, 1, 3, 2)
        s = np.where(discard, -np.inf, s)
        p = np.exp(s - s.max(-1, keepdims=True))
        out = (p / p.sum(-1, keepdims=True)) @ vr
        return (None, None, None, ms.Tensor(out.astype(out_dtype)))

    return run
