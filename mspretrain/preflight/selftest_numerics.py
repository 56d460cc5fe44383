"""The selftest's checks that compare two numeric paths on this device: FlashAttentionScore
against the math attention, each family's feature (sliding window, q/k/v bias, q/k norm) against
the fp32 CPU path, and fp16/bf16 train steps (with an injected overflow) against fp32.

Every comparison goes through one function (`compare_outputs`), so the CPU tests run the
comparison logic with the math path on both sides and a 910B run only swaps the candidate. The
train-step check uses only the public `TrainStep(...).run(micro_batches, lr, scale)` and
`LossScaler`: an overflow is injected by running one step with an infinite scale (every dtype
overflows on it), which must come back not finite, change no weight, and halve the scaler's scale.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, Callable

import numpy as np

from mspretrain.config import schema as cfgmod
from mspretrain.families import FAMILIES, Family
from mspretrain.preflight.selftest_result import FAILED, NEEDS_ASCEND, PASSED, SKIPPED, Check, Context

# max |flash - fp32 math| accepted per dtype on attention outputs of N(0, 1) inputs: the output's
# own rounding is at most |out| x 2^-11 (fp16) / 2^-8 (bf16) with |out| <= ~3, plus the kernel's
# blockwise (online) softmax, which rounds its partial sums in the compute dtype.
ATTENTION_TOLERANCE = {"fp16": 1e-2, "bf16": 3e-2}
# max |loss - fp32 loss| over the train-step check's two finite steps (mean token NLL ~5.5): a
# loss carries the rounding of every layer, about 2^-11 (fp16) / 2^-8 (bf16) relative per layer.
LOSS_TOLERANCE = {"fp16": 1e-2, "bf16": 5e-2}  # measured on CPU: fp16 3e-5 from fp32


# --------------------------------------------------------------------------- the one comparison

@dataclass(frozen=True)
class Comparison:
    max_abs_diff: float
    tolerance: float

    @property
    def passed(self) -> bool:
        return bool(self.max_abs_diff <= self.tolerance)  # NaN compares False: a NaN never passes


def compare_outputs(candidate: np.ndarray, reference: np.ndarray, dtype: str,
                    tolerances: dict[str, float] = ATTENTION_TOLERANCE) -> Comparison:
    """Max |candidate - reference| (in fp32) against `tolerances[dtype]`; shapes must agree.
    The one comparison of two numeric paths: flash vs math attention, fp16/bf16 vs fp32 steps."""
    a, b = np.asarray(candidate, np.float32), np.asarray(reference, np.float32)
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {a.shape} vs {b.shape}")
    diff = float(np.abs(a - b).max()) if a.size else 0.0
    if not np.isfinite(a).all():
        diff = float("nan")
    return Comparison(diff, tolerances[dtype])


def attention_inputs(cfg_model, dtype: str, *, batch: int = 2, seq: int = 128, seed: int = 0) -> dict[str, np.ndarray]:
    """Random q (B, H, T, hd), k/v (B, KV, T, hd) from N(0, 1) and document ids (two documents per row)."""
    rng = np.random.default_rng(seed)
    hd = cfg_model.head_size
    q = rng.standard_normal((batch, cfg_model.n_heads, seq, hd)).astype(np.float32)
    k = rng.standard_normal((batch, cfg_model.n_kv_heads, seq, hd)).astype(np.float32)
    v = rng.standard_normal((batch, cfg_model.n_kv_heads, seq, hd)).astype(np.float32)
    cut = np.array([seq // 3, seq // 2])[:batch]
    segments = (np.arange(seq)[None, :] >= cut[:, None]).astype(np.int32)
    return {"q": q, "k": k, "v": v, "segments": segments}


def attention_output(model, inputs: dict[str, np.ndarray], *, documents: bool) -> np.ndarray:
    """Layer 0's attention kernel of `model` (flash or math, as the model selected) on `inputs`, in
    the model's compute dtype; the masks come from the model itself, as in training."""
    import mindspore as ms

    q, k, v = (ms.Tensor(inputs[n]).astype(model.dtype) for n in ("q", "k", "v"))
    seg = ms.Tensor(inputs["segments"]) if documents else None
    bias, discard = model._mask(seg, q.shape[2])
    return model.layers[0].attn.core(q, k, v, bias, discard).astype(ms.float32).asnumpy()


def compare_attention(candidate, reference, dtype: str, *, seq: int = 128, seed: int = 0) -> dict[str, Comparison]:
    """Causal and document-masked attention of `candidate` against `reference` (two Decoder models of
    the same shape; GQA when the shape has fewer KV heads), on the same random inputs."""
    import mindspore as ms

    inputs = attention_inputs(candidate.cfg, dtype, seq=seq, seed=seed)
    # both sides get the same, already rounded values: the difference is the kernels', not the inputs'
    half = {"fp16": ms.float16, "bf16": ms.bfloat16}[dtype]
    inputs.update({n: ms.Tensor(inputs[n]).astype(half).astype(ms.float32).asnumpy() for n in ("q", "k", "v")})
    return {kind: compare_outputs(attention_output(candidate, inputs, documents=docs),
                                  attention_output(reference, inputs, documents=docs), dtype)
            for kind, docs in (("causal", False), ("documents", True))}


# --------------------------------------------------------------------------- checks

def check_attention(ctx: Context, dtype: str) -> Check:
    name = f"flash attention {dtype}"
    if ctx.target != "ascend":
        return Check(name, NEEDS_ASCEND, "FlashAttentionScore runs only on Ascend (the comparison is tested on CPU with the math path)")
    from mspretrain.device import flash_head_dim_problem
    from mspretrain.model.decoder import Decoder

    # the config's head size and GQA grouping, one layer, at most 8 heads: the kernel, not the model, is under test
    m = ctx.cfg.model
    hd = m.head_size
    if flash_head_dim_problem(hd):
        return Check(name, SKIPPED, f"the config's {flash_head_dim_problem(hd)}: training will run the math attention")
    heads = min(m.n_heads, 8)
    kv = max(1, heads // (m.n_heads // (m.n_kv_heads or m.n_heads)))  # n_kv_heads 0 = no grouping
    shape = cfgmod.resolve_model(replace(m, dim=hd * heads, n_heads=heads, n_kv_heads=kv, n_layers=1, ffn_dim=0,
                                         vocab_size=256, max_seq_len=max(m.max_seq_len, 256)))
    flash = Decoder(shape, dtype=dtype, attention="flash", device="ascend")
    math32 = Decoder(shape, dtype="fp32", attention="math", device="ascend")
    res = compare_attention(flash, math32, dtype, seq=256)
    ok = all(c.passed for c in res.values())
    detail = ", ".join(f"{k} max |diff| {c.max_abs_diff:.3g}" for k, c in res.items())
    return Check(name, PASSED if ok else FAILED,
                 f"FlashAttentionScore vs fp32 math attention (head size {hd}, {heads} heads / {kv} KV heads, 256 tokens): "
                 f"{detail} (tolerance {ATTENTION_TOLERANCE[dtype]:g})",
                 data={k: asdict(c) for k, c in res.items()})


# --------------------------------------------------------------------------- what a family adds

# max |logits - fp32 CPU-path logits| of the feature checks' model. Its init_std (0.05, 2.5 x Llama's)
# gives logits of a few units and attention far from uniform, so each feature moves the logits by
# far more than rounding does: its "effect" (the fp32 logits with the feature against without it)
# must be FEATURE_EFFECT_MARGIN x the tolerance, or a kernel ignoring the feature could pass.
# Measured on CPU (fp16 math path against fp32): max |diff| 2.2e-3 (qkv bias) to 4.5e-3 (qk norm),
# effects 1.7 (qk norm) to 3.1 (qkv bias). fp16: ~7 x the worst measured; bf16 keeps 3 fewer
# mantissa bits (x 8) and the flash kernel rounds its blockwise softmax in the compute dtype.
FEATURE_TOLERANCE = {"fp16": 3e-2, "bf16": 2e-1}
FEATURE_EFFECT_MARGIN = 5.0


@dataclass(frozen=True)
class Feature:
    """A family's switch in ModelConfig, checked on the device against the CPU path in fp32."""
    name: str  # the check's name
    family: str  # model.family that has it
    on: dict[str, Any]  # ModelConfig fields that switch it on
    drawn: tuple[str, ...]  # name endings of the parameters drawn (not left at their init), so that they matter
    off: dict[str, Any]  # fields that switch it off again, for the effect ({}: the drawn weights at their init)


def window_for(seq: int) -> int:
    """The sliding window of the feature check: a fifth of the sequence (102 of 512 tokens on a
    910B: no multiple of a kernel block, so the band cuts through blocks and, with band mode,
    whole blocks lie outside it)."""
    return max(2, seq // 5)


def _family_with(has: Callable[[Family], bool]) -> str:
    """The first family of the table (families.py) that `has` holds for: the one each check builds."""
    return next(f.name for f in FAMILIES if has(f))


def features(seq: int) -> dict[str, Feature]:
    plain = _family_with(lambda f: not (f.qkv_bias or f.qk_norm or f.sliding_window))
    return {
        "sliding window": Feature("sliding window", _family_with(lambda f: f.sliding_window), {"sliding_window": window_for(seq)}, (),
                                  {"sliding_window": 0, "family": plain}),
        "qkv bias": Feature("qkv bias", _family_with(lambda f: f.qkv_bias), {"qkv_bias": True}, ("attn.wqkv.bias",), {}),
        "qk norm": Feature("qk norm", _family_with(lambda f: f.qk_norm), {"qk_norm": True},
                           ("attn.q_norm.weight", "attn.k_norm.weight"), {}),
    }


def feature_seq(target: str) -> int:
    """512 tokens on a 910B (four 128-token blocks), 64 on CPU (the math path's cost is T^2)."""
    return 512 if target == "ascend" else 64


def feature_config(feature: Feature, seq: int) -> cfgmod.ModelConfig:
    """2 layers, head size 64 (a FlashAttentionScore size), 2 query heads sharing 1 KV head (GQA)."""
    return cfgmod.resolve_model(cfgmod.ModelConfig(dim=128, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=256,
                                                   max_seq_len=seq, init_std=0.05, family=feature.family, **feature.on))


def feature_inputs(seq: int, batch: int = 2, seed: int = 0) -> dict[str, np.ndarray]:
    """Tokens (B, T), and document ids with the positions restarting at each document (two per row)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 256, (batch, seq)).astype(np.int32)
    cut = np.array([seq // 3, seq // 2])[:batch, None]
    idx = np.arange(seq)[None, :]
    segments = (idx >= cut).astype(np.int32)
    positions = np.where(idx >= cut, idx - cut, idx).astype(np.int32)
    return {"tokens": tokens, "segments": segments, "positions": positions}


def feature_logits(model, inputs: dict[str, np.ndarray], *, documents: bool) -> np.ndarray:
    """The model's forward pass (its public call, as training runs it), fp32 logits (B, T, V)."""
    import mindspore as ms

    pos, seg = ((ms.Tensor(inputs["positions"]), ms.Tensor(inputs["segments"])) if documents else (None, None))
    return model(ms.Tensor(inputs["tokens"]), pos, seg).asnumpy()


def feature_candidate(cfg_model, dtype: str, target: str):
    """The model as training builds it on `target`: flash attention and fused kernels on a 910B
    (asked for explicitly there, so that a model that could not take it fails instead of passing
    on the math path), the math path elsewhere."""
    from mspretrain.model.decoder import Decoder

    return Decoder(cfg_model, dtype=dtype, attention="flash" if target == "ascend" else "auto", device=target, seed=0)


def compare_feature(feature: Feature, target: str, dtypes: tuple[str, ...], seq: int) -> dict[str, Any]:
    """Each dtype's candidate against the fp32 CPU path (math attention, the CPU kernels' graph),
    causal and with documents, on the same weights; and the feature's effect on that reference."""
    from mspretrain.model.decoder import Decoder, load_numpy, state_numpy

    shape = feature_config(feature, seq)
    reference = Decoder(shape, dtype="fp32", attention="math", device="cpu", seed=0)
    init = {k: v.copy() for k, v in state_numpy(reference).items()}
    rng = np.random.default_rng(1)
    state = dict(init)
    for name in (n for n in init if n.endswith(feature.drawn)):  # () draws none
        # around the init (zeros for a bias, ones for a norm weight), at the scale of what it adds to
        state[name] = init[name] + 0.5 * rng.standard_normal(init[name].shape).astype(np.float32)
    load_numpy(reference, state)
    baseline = Decoder(cfgmod.resolve_model(replace(shape, **feature.off)), dtype="fp32", attention="math", device="cpu", seed=0)
    load_numpy(baseline, init if feature.drawn else state)
    inputs = feature_inputs(seq)
    kinds = (("causal", False), ("documents", True))
    ref = {kind: feature_logits(reference, inputs, documents=docs) for kind, docs in kinds}
    effect = max(float(np.abs(ref[kind] - feature_logits(baseline, inputs, documents=docs)).max()) for kind, docs in kinds)
    out: dict[str, Any] = {"effect": effect, "seq_len": seq, "dtypes": {}}
    for dtype in dtypes:
        candidate = feature_candidate(shape, dtype, target)
        load_numpy(candidate, state)
        res = {kind: asdict(compare_outputs(feature_logits(candidate, inputs, documents=docs), ref[kind], dtype, FEATURE_TOLERANCE))
               for kind, docs in kinds}
        out["dtypes"][dtype] = {**res, "flash_attention": bool(candidate.use_flash)}
    return out


def check_feature(ctx: Context, name: str) -> Check:
    """A family's feature on this device (fp16, and bf16 on a 910B) against the fp32 CPU path."""
    seq = feature_seq(ctx.target)
    feature = features(seq)[name]
    dtypes = ("fp16", "bf16") if ctx.target == "ascend" else ("fp16",)
    res = compare_feature(feature, ctx.target, dtypes, seq)
    worst = max(FEATURE_TOLERANCE[d] for d in dtypes)
    problems = []
    if not res["effect"] >= FEATURE_EFFECT_MARGIN * worst:  # NaN fails too
        problems.append(f"the feature moves the fp32 logits by only {res['effect']:.3g}: the comparison cannot see it")
    parts = []
    for dtype, r in res["dtypes"].items():
        diffs = {k: r[k]["max_abs_diff"] for k in ("causal", "documents")}
        kernel = "flash" if r["flash_attention"] else "math"
        parts.append(f"{dtype} ({kernel}) max |diff| {max(diffs.values()):.2g}")
        bad = [k for k in diffs if not r[k]["max_abs_diff"] <= r[k]["tolerance"]]
        if bad:
            problems.append(f"{dtype} {'/'.join(bad)} logits differ by {max(diffs[k] for k in bad):.3g} "
                            f"(tolerance {FEATURE_TOLERANCE[dtype]:g})")
    what = {"sliding window": f"window {window_for(seq)} of {seq} tokens", "qkv bias": "q/k/v bias drawn N(0, 0.5)",
            "qk norm": "q/k norm weights drawn 1 + N(0, 0.5)"}[name]
    detail = (f"{feature.family} 2-layer model, {what}, causal and with documents, logits vs the fp32 CPU path: "
              + ", ".join(parts) + f" (tolerance {', '.join(f'{d} {FEATURE_TOLERANCE[d]:g}' for d in dtypes)}; "
              f"the feature itself moves them by {res['effect']:.2g})")
    if ctx.target != "ascend":
        detail += "; bf16 and the flash kernel need Ascend"
    return Check(name, FAILED if problems else PASSED, "; ".join(problems) if problems else detail, data=res)


def three_steps(dtype: str, target: str, *, jit: bool) -> tuple[list[float], list[str], Any]:
    """Three steps of a tiny model with dynamic loss scaling (1024) through the public TrainStep API;
    the second runs with an infinite scale (an overflow in any dtype). Returns the two finite
    steps' losses, the problems seen, and the LossScaler."""
    from mspretrain.model.decoder import Decoder
    from mspretrain.step.loss_scale import LossScaler
    from mspretrain.step.step import TrainStep

    m = cfgmod.resolve_model(cfgmod.ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, max_seq_len=64))
    model = Decoder(m, dtype=dtype, device=target, seed=0)
    batch, seq = 2, 32
    step = TrainStep(model, cfgmod.OptimConfig(lr=1e-3), global_tokens=batch * seq, jit=jit)
    scaler = LossScaler.from_config(cfgmod.PrecisionConfig(dtype=dtype, loss_scale="dynamic", init_scale=1024.0))
    tokens = np.random.default_rng(0).integers(0, m.vocab_size, (batch, seq + 1)).astype(np.int32)
    weights = lambda: [p.asnumpy().copy() for p in model.trainable_params()]  # noqa: E731
    losses, problems = [], []
    for i, inject in enumerate((False, True, False)):
        before, scale_before = weights(), scaler.scale
        res = step.run([(tokens, None, None)], 1e-3, float("inf") if inject else scaler.scale)
        scaler.update(res.finite)
        changed = any(not np.array_equal(a, b) for a, b in zip(before, weights()))
        if inject:
            if res.finite:
                problems.append("the injected overflow was not detected")
            if changed:
                problems.append("the overflowed step changed weights")
            if scaler.scale != scale_before * 0.5:
                problems.append(f"scale {scale_before:g} -> {scaler.scale:g}, not halved")
        else:
            losses.append(res.loss)
            if not (res.finite and np.isfinite(res.loss)):
                problems.append(f"step {i + 1} is not finite (loss {res.loss})")
            elif not changed:
                problems.append(f"step {i + 1} changed no weight")
    return losses, problems, scaler


def check_train_step(ctx: Context, dtype: str) -> Check:
    """fp16/bf16 steps with an injected overflow, their losses compared with the same steps in fp32."""
    name = f"train step {dtype}"
    if dtype == "bf16" and ctx.target != "ascend":
        return Check(name, NEEDS_ASCEND, "bf16 has no CPU kernels in MindSpore")
    # --quick on CPU runs the steps eagerly: the same TrainStep, without ~30 s of graph compilation
    jit = not (ctx.quick and ctx.target != "ascend")
    losses, problems, scaler = three_steps(dtype, ctx.target, jit=jit)
    ref, ref_problems, _ = three_steps("fp32", ctx.target, jit=jit)
    problems += [f"fp32 reference: {p}" for p in ref_problems]
    cmp = compare_outputs(np.array(losses), np.array(ref), dtype, LOSS_TOLERANCE) if len(losses) == len(ref) else None
    if cmp is not None and not cmp.passed:
        problems.append(f"losses {[round(x, 4) for x in losses]} differ from fp32's {[round(x, 4) for x in ref]} "
                        f"by {cmp.max_abs_diff:.3g} (tolerance {cmp.tolerance:g})")
    detail = (f"3 steps of a 2-layer model, dynamic loss scale 1024: losses {losses[0]:.4f} -> {losses[-1]:.4f} "
              f"(fp32: {ref[0]:.4f} -> {ref[-1]:.4f}, max |diff| {cmp.max_abs_diff:.2g} <= {cmp.tolerance:g}); "
              f"overflow injected at step 2: skipped, weights unchanged, scale halved to {scaler.scale:g}"
              if not problems else "; ".join(problems))
    return Check(name, FAILED if problems else PASSED, detail,
                 data={"losses": losses, "fp32_losses": ref, "final_scale": scaler.scale, "skipped": scaler.overflows})

