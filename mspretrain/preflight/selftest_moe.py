"""The selftest's MoE check (issue 52 item 8): the dropless routing on MindSpore's fused kernels
(model/moe_kernels.py: moe_token_permute, GroupedMatmul, moe_token_unpermute) against the CPU
path's sorted blocks in fp32 (model/moe.py), on one small random MoE layer run on this device.

Both layers hold the same weights (drawn from one seed, then rescaled so that outputs are of order
1 and a tolerance means something). The tokens are chosen so that routing cannot flip with the
compute dtype: only tokens whose K-th and (K+1)-th router logits (fp64) differ by at least
ROUTING_MARGIN are kept, so both sides choose the same experts and any difference is the kernels'.
Compared: the layer's output (max |diff| against MOE_TOLERANCE), its assignment counts (equal), and
in fp32 the gradients of the expert weights (the kernels' backward). On CPU the check says it needs
Ascend; tests/model/test_moe_kernels.py runs it as a 910B would, the kernels replaced by their contracts.
"""
from __future__ import annotations

from dataclasses import asdict
from typing import Any

import numpy as np

from mspretrain.preflight.selftest_numerics import Comparison, compare_outputs
from mspretrain.preflight.selftest_result import FAILED, NEEDS_ASCEND, PASSED, Check, Context

NAME = "moe kernels"
DTYPES = ("fp32", "fp16", "bf16")
# max |kernel path - fp32 sorted path| on outputs of order 1: fp32 only reorders sums; fp16/bf16
# round inputs, weights and the two matmuls' outputs (2^-11 / 2^-8 relative), as ATTENTION_TOLERANCE
MOE_TOLERANCE = {"fp32": 1e-4, "fp16": 1e-2, "bf16": 5e-2}
ROUTING_MARGIN = 0.5  # router logits; bf16 rounds a logit of ~10 by ~0.04
SHAPE = {"dim": 128, "num_experts": 8, "experts_per_token": 2, "moe_ffn_dim": 64}


def _model_config():
    from mspretrain.config.schema import ModelConfig, resolve_model

    return resolve_model(ModelConfig(n_layers=1, n_heads=2, n_kv_heads=2, vocab_size=64, max_seq_len=64,
                                     family="qwen3_moe", qk_norm=True, **SHAPE))


def _layer(cfg, dtype: str, seed: int):
    """One MoE layer of `cfg` in `dtype`, weights drawn from `seed` and scaled to unit-order outputs."""
    import mindspore as ms

    from mspretrain.model.decoder import InitStreams
    from mspretrain.model.layers import COMPUTE_DTYPES
    from mspretrain.model.moe import MoE

    layer = MoE(cfg, InitStreams(seed), COMPUTE_DTYPES[dtype])
    rng = np.random.default_rng(seed)
    E, D, F = cfg.num_experts, cfg.dim, cfg.moe_ffn_dim
    # router logits of std 2 on N(0, 1) tokens: the softmax neither uniform nor one-hot
    layer.router.weight.set_data(ms.Tensor((rng.standard_normal((E, D)) * 2 / np.sqrt(D)).astype(np.float32)))
    layer.w13.weight.set_data(ms.Tensor((rng.standard_normal((E, 2 * F, D)) / np.sqrt(D)).astype(np.float32)))
    layer.w2.weight.set_data(ms.Tensor((rng.standard_normal((E, D, F)) / np.sqrt(F)).astype(np.float32)))
    return layer


def robust_tokens(router: np.ndarray, k: int, n: int, seed: int) -> np.ndarray:
    """n tokens (n, D) fp32 whose router logits keep their top-k set under rounding (see the docstring)."""
    rng = np.random.default_rng(seed + 1)
    out: list[np.ndarray] = []
    while len(out) < n:
        x = rng.standard_normal((4 * n, router.shape[1])).astype(np.float32)
        logits = np.sort(x.astype(np.float64) @ router.T.astype(np.float64), -1)[:, ::-1]
        out.extend(x[logits[:, k - 1] - logits[:, k] >= ROUTING_MARGIN])
    return np.stack(out[:n])


def compare_moe(dtype: str, *, tokens: int = 64, seed: int = 0) -> dict[str, Any]:
    """The kernel path in `dtype` against the sorted path in fp32 on this device."""
    import mindspore as ms

    cfg = _model_config()
    ref, cand = _layer(cfg, "fp32", seed), _layer(cfg, dtype, seed)
    cand.grouped = True
    x = robust_tokens(ref.router.weight.asnumpy(), cfg.experts_per_token, tokens, seed)
    xt = ms.Tensor(x.reshape(1, tokens, cfg.dim))
    y_ref, s_ref = ref(xt)
    y_c, s_c = cand(xt.astype(cand.dtype))
    out: dict[str, Any] = {"output": compare_outputs(y_c.astype(ms.float32).asnumpy(), y_ref.asnumpy(), dtype, MOE_TOLERANCE)}
    out["same_routing"] = bool((s_c.asnumpy()[1] == s_ref.asnumpy()[1]).all())
    if dtype == "fp32":  # the kernels' backward: d sum(y * r) / d (w13, w2)
        r = ms.Tensor(np.random.default_rng(seed + 2).standard_normal(y_ref.shape).astype(np.float32))
        grads = []
        for layer in (ref, cand):
            params = [layer.w13.weight, layer.w2.weight]
            fn = ms.value_and_grad(lambda a, layer=layer: (layer(a)[0] * r).sum(), None, params)
            grads.append(fn(xt)[1])
        out["grad_w13"] = compare_outputs(grads[1][0].asnumpy(), grads[0][0].asnumpy(), dtype, MOE_TOLERANCE)
        out["grad_w2"] = compare_outputs(grads[1][1].asnumpy(), grads[0][1].asnumpy(), dtype, MOE_TOLERANCE)
    return out


def check_moe_kernels(ctx: Context, dtypes: tuple[str, ...] = DTYPES) -> Check:
    if ctx.target != "ascend":
        return Check(NAME, NEEDS_ASCEND, "moe_token_permute and GroupedMatmul run only on Ascend "
                                         "(the comparison is tested on CPU with their documented contracts)")
    res = {dtype: compare_moe(dtype) for dtype in dtypes}
    ok = all(r["same_routing"] and all(c.passed for c in r.values() if isinstance(c, Comparison)) for r in res.values())
    detail = "; ".join(f"{d}: " + ", ".join(f"{k} max |diff| {c.max_abs_diff:.3g}" for k, c in r.items() if isinstance(c, Comparison))
                       + ("" if r["same_routing"] else ", ROUTING DIFFERS") for d, r in res.items())
    shape = ", ".join(f"{k} {v}" for k, v in SHAPE.items())
    return Check(NAME, PASSED if ok else FAILED,
                 f"fused permute + grouped matmul vs the fp32 sorted path ({shape}, 64 tokens): {detail} "
                 f"(tolerance {', '.join(f'{d} {MOE_TOLERANCE[d]:g}' for d in dtypes)})",
                 data={d: {k: (asdict(c) if isinstance(c, Comparison) else c) for k, c in r.items()} for d, r in res.items()})
