"""Attention of the Llama block: RoPE (HF's rotate-half layout, Llama-3.1's rescaling) and the
grouped-query attention cell on the math path or Ascend's fused kernel (model/decoder.py's docstring
has the design). Its weights: its own Parameters, or the whole ones handed in (`ws`, ZeRO-3:
model/block.py `Block.pull`)."""
from __future__ import annotations

import math

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops
from mindspore.ops.operations.nn_ops import FlashAttentionScore

from mspretrain.config.schema import ModelConfig
from mspretrain.model.layers import Linear, RMSNorm, SoftmaxFP32, WeightSource

# Attention's whole weights when it does not use its own Parameters (ZeRO-3): wqkv's weight and
# bias, q_norm's and k_norm's weight, wo's weight; None where the model has none (`Attention.pull`).
AttentionWeights = tuple  # (Tensor, Tensor | None, Tensor | None, Tensor | None, Tensor)
NO_WEIGHTS = (None, None, None, None, None)


def llama3_inv_freq(inv_freq: np.ndarray, factor: float, low: float, high: float, old_len: int) -> np.ndarray:
    """Llama-3.1's RoPE rescaling, line for line transformers' `_compute_llama3_parameters`
    (modeling_rope_utils.py): long wavelengths divided by `factor`, short ones kept, a smooth
    blend between. The attention factor of this rope type is 1, so cos/sin are not scaled."""
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    inv_l = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(medium, smoothed, inv_l)


def rope_tables(head_dim: int, max_seq_len: int, theta: float,
                llama3: tuple[float, float, float, int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin of shape (max_seq_len, head_dim) in HF's rotate-half layout, float32. `llama3` =
    (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings) rescales."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)  # (hd/2,)
    if llama3 is not None:
        inv_freq = llama3_inv_freq(inv_freq, *llama3)
    angles = np.outer(np.arange(max_seq_len, dtype=np.float64), inv_freq)  # (S, hd/2)
    angles = np.concatenate([angles, angles], axis=-1)  # (S, hd)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x (B, T, N, hd); cos/sin broadcastable to it, e.g. (T, 1, hd) or (B, T, 1, hd)."""
    x1, x2 = ops.split(x, x.shape[-1] // 2, -1)  # split, not slicing: its gradient is one Concat
    rotated = ops.concat((-x2, x1), -1)  # rotate_half(x)
    return x * cos + rotated * sin


class Attention(nn.Cell):
    def __init__(self, cfg: ModelConfig, rng: WeightSource, dtype: ms.Type, use_flash: bool) -> None:
        super().__init__()
        self.n_heads, self.n_kv = cfg.n_heads, cfg.n_kv_heads
        self.group = cfg.n_heads // cfg.n_kv_heads
        self.head_dim = cfg.head_size
        self.dtype = dtype
        self.scale = 1.0 / math.sqrt(self.head_dim)
        out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
        # tensor parallel (model/block.py `Block.apply_tp`): wqkv's q | k | v rows cut per block, wo's input columns
        q, kv = cfg.n_heads * self.head_dim, cfg.n_kv_heads * self.head_dim
        self.wqkv = Linear(cfg.dim, q + 2 * kv, cfg.init_std, rng, dtype, bias=cfg.qkv_bias, role="column", blocks=(q, kv, kv))
        self.wo = Linear(cfg.n_heads * self.head_dim, cfg.dim, out_std, rng, dtype, role="row")
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:  # Qwen3: one RMSNorm weight over head_dim for all q heads, one for all k heads
            # shared by all heads, a tp rank sees its own heads only: a partial gradient on each
            self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps, dtype, role="partial")
            self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps, dtype, role="partial")
        self.bmm_qk = ops.BatchMatMul(transpose_b=True)
        self.bmm_pv = ops.BatchMatMul()
        self.softmax = SoftmaxFP32()
        self.use_flash = use_flash
        self.window = cfg.sliding_window  # 0 = full attention; windowed only when T > window (static)
        if use_flash:
            # Causal without documents: leftUpCausal (sparse_mode 2) with the compressed 2048x2048
            # mask; with documents: the full (B, 1, T, T) mask (sparse_mode 0). 1 = masked out.
            self.flash_causal = FlashAttentionScore(
                head_num=cfg.n_heads, scale_value=self.scale, pre_tokens=2147483647, next_tokens=0,
                input_layout="BNSD", sparse_mode=2)
            self.flash_masked = FlashAttentionScore(
                head_num=cfg.n_heads, scale_value=self.scale, pre_tokens=2147483647, next_tokens=0,
                input_layout="BNSD", sparse_mode=0)
            if cfg.sliding_window:
                # Mistral's window (key j visible from query i iff 0 <= i - j < window) is the
                # kernel's band: it computes the keys i - pre_tokens <= j <= i + next_tokens
                # (2.10's FlashAttentionScore docstring, gen_ops_prim.py: "the part between counting
                # preTokens and nextTokens"; the bounds as Huawei's CPU golden of the kernel draws
                # them: mindstudio-probe msprobe/pytorch/bench_functions/npu_fusion_attention.py,
                # generate_atten_mask, masks triu(k=next+1) and tril(k=-pre-1)), so pre_tokens =
                # window - 1 and next_tokens = 0. For S1 == S2 (self-attention) the band's left-up
                # and right-down origins coincide.
                # Without documents: band mode (sparse_mode 4) with the same compressed 2048x2048
                # mask as sparse_mode 2 (the docstring: modes 2, 3, 4 take the "optimized" mask),
                # so blocks outside the band are skipped and no (B, 1, T, T) mask exists.
                self.flash_band = FlashAttentionScore(
                    head_num=cfg.n_heads, scale_value=self.scale, pre_tokens=cfg.sliding_window - 1,
                    next_tokens=0, input_layout="BNSD", sparse_mode=4)
                # With documents: band mode cannot carry them (its attn_mask must be the compressed
                # 2048x2048 one, per sample masks are for modes 0/1/5), and the varlen layout (TND,
                # actual_seq_qlen) allows only sparse_mode 2 or 3, no band. So the full (B, 1, T, T)
                # mask (causal, window, documents) in sparse_mode 0, which the docstring says
                # computes "the part between preTokens and nextTokens": the same band bounds let
                # the kernel skip the blocks outside the window; the mask decides within it.
                self.flash_band_masked = FlashAttentionScore(
                    head_num=cfg.n_heads, scale_value=self.scale, pre_tokens=cfg.sliding_window - 1,
                    next_tokens=0, input_layout="BNSD", sparse_mode=0)

    def construct(self, x: Tensor, cos: Tensor, sin: Tensor, bias: Tensor, discard: Tensor | None,
                  ws: AttentionWeights = NO_WEIGHTS) -> Tensor:
        q, k, v = self.project(x, cos, sin, ws)
        return self.output(self.core(q, k, v, bias, discard), ws[4])

    def pull(self, token: Tensor) -> tuple[AttentionWeights, Tensor]:
        """ZeRO-3: this cell's whole weights, gathered one after the other from `token` in the order
        the forward uses them (layers.py `Linear.pull`), and the token after the last."""
        w, b, token = self.wqkv.pull(token)
        if self.qk_norm:  # q_norm's, then k_norm's: one order although both apply side by side
            qn, token = self.q_norm.pull(token)
            kn, token = self.k_norm.pull(token)
            wo, _, token = self.wo.pull(token)
            return (w, b, qn, kn, wo), token
        wo, _, token = self.wo.pull(token)
        return (w, b, None, None, wo), token

    def core(self, q: Tensor, k: Tensor, v: Tensor, bias: Tensor, discard: Tensor | None) -> Tensor:
        """The attention this layer runs (flash or math) on projected q (B, H, T, hd), k/v (B, KV, T, hd).

        Public so that `mspretrain selftest` can compare the two kernels on the same inputs."""
        return self._flash(q, k, v, discard) if self.use_flash else self.attend(q, k, v, bias)  # (B, H, T, hd)

    def project(self, x: Tensor, cos: Tensor, sin: Tensor, ws: AttentionWeights = NO_WEIGHTS) -> tuple[Tensor, Tensor, Tensor]:
        """x (B, T, D) -> q (B, H, T, hd), k and v (B, KV, T, hd), RoPE applied to q and k."""
        B, T = x.shape[0], x.shape[1]
        H, KV, hd = self.n_heads, self.n_kv, self.head_dim
        qk, v = self.wqkv.parts(x, ((H + KV) * hd, KV * hd), ws[0], ws[1])  # (B, T, (H+KV)*hd), (B, T, KV*hd)
        qk = qk.reshape(B, T, H + KV, hd)
        if self.qk_norm:  # before RoPE, as Qwen3Attention does
            q, k = ops.split(qk, (H, KV), 2)
            qk = ops.concat((self.q_norm(q, ws[2]), self.k_norm(k, ws[3])), 2)
        qk = apply_rope(qk, cos, sin)  # one RoPE call for q and k
        q, k = ops.split(qk.transpose(0, 2, 1, 3), (H, KV), 1)  # (B, H, T, hd), (B, KV, T, hd)
        return q, k, v.reshape(B, T, KV, hd).transpose(0, 2, 1, 3)  # v: (B, KV, T, hd)

    def output(self, o: Tensor, w: Tensor | None = None) -> Tensor:
        B, H, T, hd = o.shape
        return self.wo(o.transpose(0, 2, 1, 3).reshape(B, T, H * hd), w)  # (B, T, H*hd) -> (B, T, D)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, bias: Tensor) -> Tensor:
        """Math path. q (B, H, T, hd), k/v (B, KV, S, hd), bias (B|1, 1, T, S) or (B, H, T, S) -> (B, H, T, hd)."""
        B, T, S = q.shape[0], q.shape[2], k.shape[2]
        KV, G, hd = self.n_kv, self.group, self.head_dim
        q = (q * self.scale).reshape(B, KV, G * T, hd)  # heads sharing a KV head: (B, KV, G*T, hd)
        scores = self.bmm_qk(q, k)  # (B, KV, G*T, S)
        scores = scores.reshape(B, KV * G, T, S).astype(ms.float32) + bias  # bias (B|1, 1, T, S) or (B, H, T, S)
        probs = self.softmax(scores).astype(self.dtype).reshape(B, KV, G * T, S)  # (B, KV, G*T, S)
        o = self.bmm_pv(probs, v)  # (B, KV, G*T, hd)
        return o.reshape(B, KV * G, T, hd)  # head h = kv * G + g, as HF's repeat_kv: (B, H, T, hd)

    def _flash(self, q: Tensor, k: Tensor, v: Tensor, discard: Tensor) -> Tensor:
        """discard: the model's one compressed (2048, 2048) causal mask, or a (B, 1, T, T) document mask
        (which holds the window too). The kernel is chosen at compile time from static shapes."""
        windowed = bool(self.window) and q.shape[2] > self.window  # as Decoder._mask decides it
        if discard.ndim == 2:
            if windowed:
                out = self.flash_band(q, k, v, None, None, None, discard, None, None, None)
            else:
                out = self.flash_causal(q, k, v, None, None, None, discard, None, None, None)
        elif windowed:
            out = self.flash_band_masked(q, k, v, None, None, None, discard, None, None, None)
        else:
            out = self.flash_masked(q, k, v, None, None, None, discard, None, None, None)
        return out[3]  # (softmax_max, softmax_sum, softmax_out, attention_out)


