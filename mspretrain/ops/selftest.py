"""`mspretrain selftest`: the first command on a new node — a verdict in minutes, before a month of compute.

Each check is a function returning a `Check` with a status:
- "passed" / "failed": it ran here and its numbers are in the result;
- "needs Ascend": this machine cannot run it (CPU development box); never reported as passed;
- "skipped": it could run but an earlier result or an option made it pointless (said why).
Design choices:
- Checks that compare two numeric paths go through one function each (`compare_outputs` for
  FlashAttentionScore against the math attention), so CPU tests run the comparison logic with
  the math path on both sides and the 910B run only swaps the candidate.
- The training-step check uses only the public `TrainStep(...).run(micro_batches, lr, scale)`
  and `LossScaler`: an overflow is injected by running one step with an infinite scale (every
  dtype overflows on it), which must come back not finite, change no weight, and halve the
  scaler's scale.
- Measured numbers feed the plan: the decoder-layer timing gives tokens/s per device, written to
  the JSON as `tokens_per_s_per_device`, which `mspretrain plan --from-selftest FILE` reads.
- Nothing here writes outside a fresh `--run DIR/.selftest-XXXX/` (removed at the end; a run dir
  the selftest created is removed too if it stays empty) and the JSON the user asks for.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np

from mspretrain import config as cfgmod
from mspretrain.config import Config
from mspretrain.errors import UserError
from mspretrain.fsutil import read_json

PASSED, FAILED, NEEDS_ASCEND, SKIPPED = "passed", "failed", "needs Ascend", "skipped"
STATUSES = (PASSED, FAILED, NEEDS_ASCEND, SKIPPED)
GB = 1e9
# max |flash - fp32 math| accepted per dtype on attention outputs of N(0, 1) inputs: the output's
# own rounding is at most |out| x 2^-11 (fp16) / 2^-8 (bf16) with |out| <= ~3, plus the kernel's
# blockwise (online) softmax, which rounds its partial sums in the compute dtype.
ATTENTION_TOLERANCE = {"fp16": 1e-2, "bf16": 3e-2}
# max |loss - fp32 loss| over the train-step check's two finite steps (mean token NLL ~5.5): a
# loss carries the rounding of every layer, about 2^-11 (fp16) / 2^-8 (bf16) relative per layer.
LOSS_TOLERANCE = {"fp16": 1e-2, "bf16": 5e-2}  # measured on CPU: fp16 3e-5 from fp32
LLAMA_VOCAB = 32000  # used for FLOPs per token when neither the config nor --data gives a vocabulary


@dataclass
class Check:
    name: str
    status: str
    detail: str
    seconds: float = 0.0
    data: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        out = {"name": self.name, "status": self.status, "detail": self.detail, "seconds": round(self.seconds, 2)}
        out.update(self.data)
        return out


@dataclass
class Context:
    """What every check may read: the config, the resolved target, the run dir's scratch space."""
    cfg: Config
    target: str  # "cpu" | "ascend"
    work: Path
    quick: bool = False
    devices: int = 1
    vocab_note: str = ""
    results: dict[str, Any] = field(default_factory=dict)  # numbers later checks use


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
    """Causal and document-masked attention of `candidate` against `reference` (two Llama models of
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

def _timed(name: str, fn: Callable[[], Check]) -> Check:
    t0 = time.perf_counter()
    try:
        check = fn()
    except UserError as exc:
        check = Check(name, FAILED, f"{exc.cause} ({exc.fix})" if getattr(exc, "fix", None) else str(exc))
    except Exception as exc:  # a check that crashes is a failed check, with the reason, not a traceback
        check = Check(name, FAILED, f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}")
    check.seconds = time.perf_counter() - t0
    return check


def check_devices(ctx: Context) -> Check:
    if ctx.target != "ascend":
        return Check("devices", NEEDS_ASCEND, f"no NPU visible; running on CPU ({os.cpu_count()} cores)",
                     data={"npus": 0, "cpu_cores": os.cpu_count()})
    from mindspore.device_context.ascend import device_count

    n = int(device_count())
    nodes = len([p for p in Path("/dev").glob("davinci[0-9]*")])
    # fewer than the device nodes is not an error: ASCEND_RT_VISIBLE_DEVICES may hide some on purpose
    visible = os.environ.get("ASCEND_RT_VISIBLE_DEVICES")
    return Check("devices", PASSED if n >= 1 else FAILED,
                 f"{n} NPUs visible to MindSpore" + (f", {nodes} /dev/davinci* nodes" if nodes else "")
                 + (f", ASCEND_RT_VISIBLE_DEVICES={visible}" if visible else ""), data={"npus": n, "device_nodes": nodes})


def check_versions(ctx: Context) -> Check:
    import mindspore as ms

    from mspretrain import __version__
    from mspretrain.ops.doctor import check_ascend

    cann = next((f.detail for f in check_ascend() if f.name == "CANN toolkit"), None)
    data = {"mindspore": ms.__version__, "mspretrain": __version__, "python": sys.version.split()[0], "cann": cann}
    ok = ms.__version__.startswith("2.10")
    return Check("versions", PASSED if ok else FAILED,
                 f"MindSpore {ms.__version__}, CANN {cann or 'not installed'}, Python {data['python']}"
                 + ("" if ok else " (mspretrain is built and tested against MindSpore 2.10)"), data=data)


def check_doctor(ctx: Context) -> Check:
    from mspretrain.ops.doctor import run_checks

    findings = run_checks(ctx.work.parent, ctx.cfg)
    fails = [f for f in findings if f.status == "fail"]
    warns = [f for f in findings if f.status == "warn"]
    detail = (f"{len(findings)} environment checks: {len(fails)} failed, {len(warns)} warnings"
              + "".join(f"; FAIL {f.name}: {f.detail}" for f in fails) + "".join(f"; warn {f.name}" for f in warns))
    return Check("doctor", FAILED if fails else PASSED, detail,
                 data={"findings": [asdict(f) for f in findings]})


def check_attention(ctx: Context, dtype: str) -> Check:
    name = f"flash attention {dtype}"
    if ctx.target != "ascend":
        return Check(name, NEEDS_ASCEND, "FlashAttentionScore runs only on Ascend (the comparison is tested on CPU with the math path)")
    from mspretrain.device import flash_head_dim_problem
    from mspretrain.model.llama import Llama

    # the config's head size and GQA grouping, one layer, at most 8 heads: the kernel, not the model, is under test
    m = ctx.cfg.model
    hd = m.head_size
    if flash_head_dim_problem(hd):
        return Check(name, SKIPPED, f"the config's {flash_head_dim_problem(hd)}: training will run the math attention")
    heads = min(m.n_heads, 8)
    kv = max(1, heads // (m.n_heads // (m.n_kv_heads or m.n_heads)))  # n_kv_heads 0 = no grouping
    shape = cfgmod.resolve_model(replace(m, dim=hd * heads, n_heads=heads, n_kv_heads=kv, n_layers=1, ffn_dim=0,
                                         vocab_size=256, max_seq_len=max(m.max_seq_len, 256)))
    flash = Llama(shape, dtype=dtype, attention="flash", device="ascend")
    math32 = Llama(shape, dtype="fp32", attention="math", device="ascend")
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


def features(seq: int) -> dict[str, Feature]:
    return {
        "sliding window": Feature("sliding window", "mistral", {"sliding_window": window_for(seq)}, (),
                                  {"sliding_window": 0, "family": "llama"}),
        "qkv bias": Feature("qkv bias", "qwen2", {"qkv_bias": True}, ("attn.wqkv.bias",), {}),
        "qk norm": Feature("qk norm", "qwen3", {"qk_norm": True}, ("attn.q_norm.weight", "attn.k_norm.weight"), {}),
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
    from mspretrain.model.llama import Llama

    return Llama(cfg_model, dtype=dtype, attention="flash" if target == "ascend" else "auto", device=target, seed=0)


def compare_feature(feature: Feature, target: str, dtypes: tuple[str, ...], seq: int) -> dict[str, Any]:
    """Each dtype's candidate against the fp32 CPU path (math attention, the CPU kernels' graph),
    causal and with documents, on the same weights; and the feature's effect on that reference."""
    from mspretrain.model.llama import Llama, load_numpy, state_numpy

    shape = feature_config(feature, seq)
    reference = Llama(shape, dtype="fp32", attention="math", device="cpu", seed=0)
    init = {k: v.copy() for k, v in state_numpy(reference).items()}
    rng = np.random.default_rng(1)
    state = dict(init)
    for name in (n for n in init if n.endswith(feature.drawn)):  # () draws none
        # around the init (zeros for a bias, ones for a norm weight), at the scale of what it adds to
        state[name] = init[name] + 0.5 * rng.standard_normal(init[name].shape).astype(np.float32)
    load_numpy(reference, state)
    baseline = Llama(cfgmod.resolve_model(replace(shape, **feature.off)), dtype="fp32", attention="math", device="cpu", seed=0)
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
    from mspretrain.model.llama import Llama
    from mspretrain.train.loss_scale import LossScaler
    from mspretrain.train.step import TrainStep

    m = cfgmod.resolve_model(cfgmod.ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, max_seq_len=64))
    model = Llama(m, dtype=dtype, device=target, seed=0)
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


def check_collectives(ctx: Context) -> Check:
    name = "collectives"
    if ctx.target != "ascend":
        return Check(name, NEEDS_ASCEND, "AllReduce/AllGather/Broadcast/ReduceScatter bandwidth is measured across the node's NPUs "
                                         "through msrun with HCCL; CPU data parallel is covered by tests/test_distributed.py")
    from mspretrain.ops import collectives_worker

    n = ctx.results.get("npus", 0) or visible_npus()
    if n < 2:
        return Check(name, SKIPPED, f"{n} NPU visible: nothing to communicate with")
    out = ctx.work / "collectives"
    out.mkdir(parents=True, exist_ok=True)
    size_mb = 64 if ctx.quick else 256
    res = collectives_worker.launch(n, out, size_mb=size_mb, target="ascend")
    return _collectives_check(res, n, size_mb)


ZERO2 = "zero2 step"
# max |difference| of the ZeRO-2 ranks from one process (fp32 both): the same micro-batch gradients,
# summed across ranks instead of accumulated in one process, differ only in the order of fp32 sums.
# Measured on 2 CPU workers: losses 4.8e-7, grad norms 0, weights 5.4e-7. AdamW's first steps move
# each weight by ~lr = 1e-3, so a wrong gradient sum or a stale slice shows 100 x above these bounds.
ZERO2_TOLERANCE = {"losses": 1e-5, "grad_norms": 1e-4, "weights": 1e-5}


def zero2_ranks(ctx: Context) -> dict[str, Any] | Check:
    """The ZeRO-2 step on every NPU of the node (msrun workers), run before this process binds one
    (as the collectives); a Check when it could not run."""
    from mspretrain.ops import zero2_worker

    n = ctx.results.get("npus", 0) or visible_npus()
    if n < 2:
        return Check(ZERO2, SKIPPED, f"{n} NPU visible: no ranks to shard over")
    out = ctx.work / "zero2"
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    try:
        res = zero2_worker.launch(n, out, target=ctx.target)
    except UserError as exc:
        return Check(ZERO2, FAILED, f"{exc.cause} ({exc.fix})" if getattr(exc, "fix", None) else str(exc),
                     seconds=time.perf_counter() - t0)
    res["seconds"] = time.perf_counter() - t0
    return res


def check_zero2(ctx: Context, ranks: dict[str, Any] | Check | None) -> Check:
    """The ranks' ZeRO-2 steps against the same steps on one process, computed here."""
    if isinstance(ranks, Check):
        return ranks
    if ranks is None:
        return Check(ZERO2, NEEDS_ASCEND, "a ZeRO-2 step (reduce-scatter, sharded AdamW, all-gather) on every NPU through msrun "
                                          "against one process; tested on 2 CPU processes in tests/test_selftest.py")
    from mspretrain.ops import zero2_worker

    ref = zero2_worker.run_steps(ctx.target, 1, 0, zero2_worker.global_batches(ranks["devices"]))
    return zero2_check(ranks, ref)


def zero2_check(ranks: dict[str, Any], ref: dict[str, Any]) -> Check:
    """The comparison: every rank finite, with rank 0's losses, grad norms and weights within
    ZERO2_TOLERANCE of the single process, and every rank holding the same weights (digest)."""
    n, recs = ranks["devices"], ranks["ranks"]
    problems = []
    if len(recs) != n:
        problems.append(f"{len(recs)} of {n} ranks reported")
    if len({r["digest"] for r in recs}) > 1:
        odd = [r["rank"] for r in recs if r["digest"] != recs[0]["digest"]]
        problems.append(f"ranks {odd} hold other weights than rank 0 after the all-gather")
    if not all(all(r["finite"]) for r in recs) or not all(ref["finite"]):
        problems.append("a step overflowed (fp32: a collective returned garbage)")
    diffs = {"losses": float(np.abs(np.subtract(recs[0]["losses"], ref["losses"])).max()) if recs else float("nan"),
             "grad_norms": float(np.abs(np.subtract(recs[0]["grad_norms"], ref["grad_norms"])).max()) if recs else float("nan"),
             "weights": max(float(np.abs(ranks["weights"][k] - ref["weights"][k]).max()) for k in ref["weights"])}
    for k, d in diffs.items():
        if not d <= ZERO2_TOLERANCE[k]:
            problems.append(f"{k} differ from one process by {d:.3g} (tolerance {ZERO2_TOLERANCE[k]:g})")
    calls = ref.get("collectives", {})
    mine = recs[0].get("collectives", {}) if recs else {}
    from mspretrain.ops.zero2_worker import STEPS

    detail = (f"{n} ranks, {STEPS} fp32 steps of a 2-layer model with 2 micro-batches a rank, "
              f"{mine.get('calls', '?')} collectives a step (split, single and bucketed parameters): losses "
              f"{' -> '.join(f'{x:.4f}' for x in ref['losses'])} as one process (max |diff| {diffs['losses']:.2g}), "
              f"weights max |diff| {diffs['weights']:.2g}, replicas identical")
    data = {"devices": n, "max_abs_diff": diffs, "tolerance": ZERO2_TOLERANCE, "losses": recs[0]["losses"] if recs else [],
            "reference_losses": ref["losses"], "collectives": mine, "reference_collectives": calls,
            "ranks_seconds": ranks.get("seconds")}
    return Check(ZERO2, FAILED if problems else PASSED, "; ".join(problems) if problems else detail, data=data)


def visible_npus(env: dict[str, str] | None = None, dev: Path = Path("/dev")) -> int:
    """NPUs this process may use, without asking the runtime (which would bind one): the
    ASCEND_RT_VISIBLE_DEVICES list when set, else the /dev/davinciN nodes."""
    env = os.environ if env is None else env
    visible = env.get("ASCEND_RT_VISIBLE_DEVICES", "").strip()
    if visible:
        return len([v for v in visible.split(",") if v.strip()])
    return len(list(dev.glob("davinci[0-9]*")))


def check_hbm(total_bytes: int, max_device_memory_gb: float) -> Check:
    """Each device's HBM against `device.max_device_memory` (the pool MindSpore may take): a 910B4
    has 32 GB, so the 910B templates' 58 GB would fail at the first large allocation. The rule is
    device.py's `pool_problem`, which `doctor` and `launch` apply before the pool is set."""
    from mspretrain.device import GIB, pool_fix, pool_problem

    total_gb = total_bytes / GIB
    if total_bytes <= 0:
        return Check("device memory", SKIPPED, "the runtime reported no HBM size")
    problem = pool_problem(total_bytes, max_device_memory_gb)
    detail = f"{total_gb:.1f} GB HBM per device, device.max_device_memory {max_device_memory_gb:g} GB"
    if problem:
        detail += f": larger than the device; {pool_fix(total_bytes)}"
    return Check("device memory", FAILED if problem else PASSED, detail,
                 data={"hbm_bytes": total_bytes, "max_device_memory_gb": max_device_memory_gb})


def check_device_memory(ctx: Context) -> Check:
    if ctx.target != "ascend":
        return Check("device memory", NEEDS_ASCEND, "HBM per device against device.max_device_memory")
    import mindspore as ms

    from mspretrain.device import plan_device

    # mindspore.hal.get_device_properties: the one 2.10 API that reports an NPU's HBM size (hal/device.py;
    # marked "will be deprecated", no successor named). It needs the device initialised: one op first.
    (ms.Tensor([1.0]) + 1).asnumpy()
    props = ms.hal.get_device_properties(0, "Ascend")
    return check_hbm(int(getattr(props, "total_memory", 0)), plan_device(ctx.cfg, target="ascend").max_device_memory_gb)


def _collectives_check(res: dict[str, Any], n: int, size_mb: int) -> Check:
    bad = [k for k, v in res["ops"].items() if not v["correct"]]
    detail = f"{n} devices, {size_mb} MB per op: " + ", ".join(
        f"{k} {v['bus_gbps']:.1f} GB/s bus" for k, v in res["ops"].items())
    if bad:
        detail += f"; WRONG RESULT from {', '.join(bad)}"
    return Check("collectives", FAILED if bad else PASSED, detail, data={"devices": n, "ops": res["ops"],
                                                                        "bus_gbps": _reduction_bus_gbps(res["ops"])})


def _reduction_bus_gbps(ops: dict[str, Any]) -> float | None:
    """The bus bandwidth of the gradient reduction's collectives (the slower of ReduceScatter and AllReduce)."""
    rates = [v["bus_gbps"] for k, v in ops.items() if k in ("ReduceScatter", "AllReduce") and v.get("bus_gbps")]
    return min(rates) if rates else None


def check_checkpoint(ctx: Context) -> Check:
    """Write, verify, cold-read and load a checkpoint on the run dir's disk; predict a 7B resume."""
    from safetensors.numpy import load_file

    from mspretrain.checkpoint import store
    from mspretrain.checkpoint.diskspeed import layout_7b, read_cold, verify_time
    from mspretrain.model.presets import preset

    total = (64 if ctx.quick else 512) * 2**20
    rng = np.random.default_rng(0)
    n_model = total // 3 // 4  # a third as weights, two thirds as optimizer state, as in a real checkpoint
    model = {"w": rng.standard_normal(n_model, dtype=np.float32)}
    optim = {"exp_avg.w": rng.standard_normal(n_model, dtype=np.float32),
             "exp_avg_sq.w": rng.standard_normal(n_model, dtype=np.float32)}
    ck = ctx.work / "checkpoints" / store.step_dir_name(1)
    t0 = time.perf_counter()
    store.write_checkpoint_dir(ck, step=1, model=model, optimizer=optim, train_state={"selftest": True},
                               data_state=None, config=ctx.cfg)
    t_write = time.perf_counter() - t0
    files = [ck / store.MODEL_FILE, ck / store.OPTIM_FILE]
    nbytes = sum(p.stat().st_size for p in files)
    problem = store.verify(ck)
    t0 = time.perf_counter()
    mode = ""
    for p in files:
        _, mode = read_cold(p)
    t_read = time.perf_counter() - t0
    loaded = {**load_file(str(files[0])), **load_file(str(files[1]))}
    same = all(np.array_equal(loaded[k], v) for k, v in {**model, **optim}.items())
    sha = _sha256_rate()
    write_bps, read_bps = nbytes / t_write, nbytes / t_read
    # a 7B checkpoint as this config would write it on one 8-device node (weights + optimizer state)
    cfg7 = replace(ctx.cfg, model=preset("llama2-7b"))
    layout = layout_7b(cfg7, ranks=8)
    ck_bytes, largest = sum(layout.values()), max(layout.values())
    own = [v for k, v in layout.items() if k != store.MODEL_FILE][0]
    cores = max(1, (os.cpu_count() or 8) // max(ctx.devices, 1))
    t_verify = verify_time(ck_bytes, largest, read_bps, read_bps, sha, sha * cores)
    t_load = (layout[store.MODEL_FILE] + own) / read_bps
    ok = problem is None and same
    detail = (f"{nbytes / 2**20:.0f} MB written (fsync + hash) at {write_bps / GB:.2f} GB/s, read cold ({mode}) at "
              f"{read_bps / GB:.2f} GB/s, verify {'ok' if problem is None else 'FAILED: ' + problem}, load "
              f"{'bit-identical' if same else 'DIFFERENT'}; predicted Llama-2-7B resume ({ck_bytes / 1e9:.0f} GB, {ctx.devices} "
              f"device(s), {cores} cores each for hashing): verify {t_verify:.0f} s + load {t_load:.0f} s = {(t_verify + t_load) / 60:.1f} min")
    return Check("checkpoint", PASSED if ok else FAILED, detail,
                 data={"bytes": nbytes, "write_gbps": write_bps / GB, "cold_read_gbps": read_bps / GB, "read_mode": mode,
                       "sha256_gbps": sha / GB, "resume_7b_s": t_verify + t_load, "resume_7b_bytes": ck_bytes})


def _sha256_rate(size: int = 64 << 20) -> float:
    data = np.random.default_rng(1).integers(0, 255, size, dtype=np.uint8).tobytes()
    t0 = time.perf_counter()
    hashlib.sha256(data).digest()
    return size / (time.perf_counter() - t0)


def layer_flops_per_token(m, seq: int) -> float:
    """Training FLOPs of one decoder layer per token, on monitor/mfu.py's accounting (PaLM appendix B)."""
    hd = m.head_size
    params = 2 * m.dim * m.n_heads * hd + 2 * m.dim * m.n_kv_heads * hd + 3 * m.dim * m.ffn_dim
    return 6.0 * params + 12.0 * m.n_heads * hd * seq


def check_layer(ctx: Context) -> Check:
    """One decoder layer of the chosen config, forward + backward, timed; tokens/s and MFU per device."""
    name = "decoder layer"
    dtype = ctx.cfg.precision.dtype
    if dtype == "bf16" and ctx.target != "ascend":
        return Check(name, NEEDS_ASCEND, "the config computes in bf16, which has no CPU kernels")
    import mindspore as ms

    from mspretrain.device import select_attention
    from mspretrain.model import llama
    from mspretrain.monitor.mfu import device_peak_tflops, flops_per_token

    m = ctx.cfg.model
    seq = ctx.cfg.data.seq_len
    micro = ctx.cfg.train.micro_batch or 1
    if ctx.quick and ctx.target != "ascend":
        seq = min(seq, 256)
    layer_cfg = cfgmod.resolve_model(replace(m, n_layers=1, max_seq_len=max(m.max_seq_len, seq), vocab_size=m.vocab_size or 1))
    use_flash = select_attention("auto", ctx.target, dtype, layer_cfg.head_size)
    compute = llama.COMPUTE_DTYPES[dtype]
    block = llama.Block(layer_cfg, llama.InitStreams(0), compute, use_flash)
    if ctx.cfg.train.recompute:
        block.recompute()
    cos, sin = llama.rope_tables(layer_cfg.head_size, seq, layer_cfg.rope_theta)
    cos_t, sin_t = (ms.Tensor(t[:, None, :]).astype(compute) for t in (cos, sin))  # (T, 1, hd), as Llama._rope
    causal = np.triu(np.ones((seq, seq), np.float32), 1) * llama.NEG
    bias = ms.Tensor(causal[None, None])
    discard = ms.Tensor(np.triu(np.ones((llama.FLASH_MASK_SIZE,) * 2, np.uint8), 1)) if use_flash else None
    x = ms.Tensor(np.random.default_rng(1).standard_normal((micro, seq, layer_cfg.dim)).astype(np.float32)).astype(compute)
    params = block.trainable_params()

    def loss(x):
        return block(x, cos_t, sin_t, bias, discard).astype(ms.float32).sum()

    grad = ms.value_and_grad(loss, None, params)
    if ctx.cfg.train.mode == "jit":  # compiled at the config's device.jit_level, as training should be
        grad = ms.jit(grad, jit_level=ctx.cfg.device.jit_level)

    def once() -> None:
        _, grads = grad(x)
        grads[0].asnumpy()  # wait for the device

    once()  # compile
    reps = 2 if ctx.quick else 5
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        once()
        times.append(time.perf_counter() - t0)
    t_layer = float(np.median(times))
    tokens = micro * seq
    rate = layer_flops_per_token(layer_cfg, seq) * tokens / t_layer  # achieved FLOP/s on this layer
    vocab = m.vocab_size or LLAMA_VOCAB
    full = cfgmod.resolve_model(replace(m, vocab_size=vocab))
    tps = rate / flops_per_token(full, seq)  # whole model, assuming every matmul runs at this layer's rate
    peak = device_peak_tflops(ctx.target, dtype, ctx.cfg.device.peak_tflops) * 1e12
    mfu = min(1.0, rate / peak) if peak else None  # a low measured CPU peak: never above 100 % (monitor/mfu.py)
    ctx.results["tokens_per_s_per_device"] = tps
    data = {"dtype": dtype, "seq_len": seq, "micro_batch": micro, "layer_s": t_layer, "layer_tflops": rate / 1e12,
            "tokens_per_s_per_device": tps, "mfu": mfu, "flash_attention": use_flash,
            "model": {"dim": m.dim, "n_layers": m.n_layers, "n_heads": m.n_heads, "n_kv_heads": layer_cfg.n_kv_heads,
                      "ffn_dim": layer_cfg.ffn_dim, "vocab_size": vocab}}
    detail = (f"{dtype}, {micro} x {seq} tokens, {'flash' if use_flash else 'math'} attention: {t_layer * 1e3:.1f} ms forward+backward "
              f"({rate / 1e12:.3g} TFLOPS) -> {tps:,.0f} tokens/s per device for all {m.n_layers} layers"
              + (f", MFU {mfu:.1%}" if mfu is not None else ", MFU unknown (set device.peak_tflops)")
              + (f" (vocabulary {vocab}: {ctx.vocab_note})" if not m.vocab_size else ""))
    detail += _plan_estimate(ctx, full, tps, data)
    return Check(name, PASSED, detail, data=data)


def _plan_estimate(ctx: Context, model, tps: float, data: dict[str, Any]) -> str:
    from mspretrain.ops.plan import make_plan

    try:
        plan = make_plan(replace(ctx.cfg, model=model), devices=ctx.devices, tokens=None, data_dir=None,
                         tokens_per_s_per_device=tps, bus_gbps=ctx.results.get("bus_gbps"))
    except UserError as exc:
        return f"; no plan wall time ({exc.cause})"
    hours = (plan.get("time") or {}).get("hours")  # make_plan's wall time at the measured rate
    overlap = ""
    if "overlap" in plan:  # item 1's estimate, at the bus bandwidth the collectives check measured
        o = plan["overlap"]
        data["overlap"] = {k: o[k] for k in ("comm_s", "backward_s", "exposed_s", "bus_gbps")}
        overlap = (f"; overlap: reduction {o['comm_s'] * 1e3:,.0f} ms at {o['bus_gbps']:.0f} GB/s ({o['bus_source']}) vs backward "
                   f"{o['backward_s'] * 1e3:,.0f} ms, exposed {o['exposed_s'] * 1e3:,.0f} ms")
    if hours is None:
        return overlap
    data["plan_hours"] = hours
    when = f"{hours:,.1f} h" if hours >= 1 else f"{hours * 60:.1f} min"
    return f"; plan: {when} wall time on {ctx.devices} device(s) for the config's budget" + overlap


# --------------------------------------------------------------------------- running

def run_selftest(cfg: Config, run_dir: Path, *, target: str | None = None, quick: bool = False,
                 only: tuple[str, ...] = (), log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Every check in order; returns the JSON document (see docs/operators.md, "selftest")."""
    from mspretrain.device import plan_device, resolve_target, setup_mindspore

    t_start = time.perf_counter()
    target = target or resolve_target(cfg.device.target)
    # a bf16 config on a CPU box is still worth checking: the bf16 checks say "needs Ascend"
    on_this_device = target if not (target == "cpu" and cfg.precision.dtype == "bf16") else None
    cfgmod.validate(cfg, device=on_this_device, budget=False)  # selftest trains a few fixed steps, not the config's budget
    # On Ascend the collectives check runs first, in msrun children, before this process binds an
    # NPU (setup_mindspore): a parent holding device 0 would collide with the rank that needs it.
    # The ZeRO-2 ranks run there too; their single-process reference is computed after setup.
    early: dict[str, Check] = {}
    ranks: dict[str, Any] | Check | None = None
    wanted = [name for name in ("collectives", ZERO2) if not only or name in only]
    if target == "ascend" and wanted:
        run_dir_ = Path(run_dir)
        run_dir_.mkdir(parents=True, exist_ok=True)
        pre = Context(cfg=cfg, target=target, work=Path(tempfile.mkdtemp(prefix=".selftest-", dir=run_dir_)), quick=quick)
        try:
            if "collectives" in wanted:
                early["collectives"] = _timed("collectives", lambda: check_collectives(pre))
            if ZERO2 in wanted and early.get("collectives", Check("", PASSED, "")).status == FAILED:
                ranks = Check(ZERO2, SKIPPED, "the collectives check failed: a ZeRO-2 step needs them")
            elif ZERO2 in wanted:
                log(f"selftest: {ZERO2} (ranks) ...")
                ranks = zero2_ranks(pre)
        finally:
            shutil.rmtree(pre.work, ignore_errors=True)
    setup_mindspore(plan_device(cfg, target=target))
    run_dir = Path(run_dir)
    created = not run_dir.exists()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=".selftest-", dir=run_dir))  # never a name the user's files could have
    except OSError as exc:  # a read-only or full run dir: one line, not a traceback
        from mspretrain.outputs import os_error

        raise os_error(exc, f"the selftest's scratch files in {run_dir}",
                       "pass --run a directory you can write to (the checkpoint check measures its disk)") from None
    ctx = Context(cfg=cfg, target=target, work=work, quick=quick)
    if "collectives" in early:
        ctx.results["bus_gbps"] = early["collectives"].data.get("bus_gbps")
    ctx.vocab_note = "not in the config, Llama-2's 32000 assumed for FLOPs"
    steps: list[tuple[str, Callable[[], Check]]] = [
        ("devices", lambda: check_devices(ctx)), ("versions", lambda: check_versions(ctx)),
        ("doctor", lambda: check_doctor(ctx)),
        ("flash attention fp16", lambda: check_attention(ctx, "fp16")),
        ("flash attention bf16", lambda: check_attention(ctx, "bf16")),
        *((name, lambda name=name: check_feature(ctx, name)) for name in features(feature_seq(target))),
        ("train step fp16", lambda: check_train_step(ctx, "fp16")),
        ("train step bf16", lambda: check_train_step(ctx, "bf16")),
        ("device memory", lambda: check_device_memory(ctx)),
        ("collectives", lambda: check_collectives(ctx)), (ZERO2, lambda: check_zero2(ctx, ranks)),
        ("checkpoint", lambda: check_checkpoint(ctx)),
        ("decoder layer", lambda: check_layer(ctx)),
    ]
    checks = []
    try:
        for name, fn in steps:
            if only and name not in only:
                checks.append(Check(name, SKIPPED, "not selected (--only)"))
                continue
            log(f"selftest: {name} ...")
            check = early[name] if name in early else _timed(name, fn)
            if name == "devices":
                ctx.results["npus"] = check.data.get("npus", 0)
                ctx.devices = max(1, check.data.get("npus", 0))
            checks.append(check)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if created and not any(run_dir.iterdir()):
            run_dir.rmdir()
    import mindspore as ms

    doc = {"selftest_version": 1, "target": target, "mindspore": ms.__version__, "quick": quick,
           "devices": ctx.devices, "seconds": round(time.perf_counter() - t_start, 1),
           "checks": [c.as_dict() for c in checks],
           "tokens_per_s_per_device": ctx.results.get("tokens_per_s_per_device")}
    layer = next((c for c in checks if c.name == "decoder layer" and c.status == PASSED), None)
    if layer is not None:
        doc["config"] = {**layer.data["model"], "seq_len": layer.data["seq_len"], "dtype": layer.data["dtype"]}
    return doc


def failed(doc: dict[str, Any]) -> bool:
    return any(c["status"] == FAILED for c in doc["checks"])


def format_table(doc: dict[str, Any]) -> str:
    width = max(len(c["name"]) for c in doc["checks"])
    lines = [f"{'check':<{width}}  {'status':<12}  {'time':>6}  detail"]
    for c in doc["checks"]:
        lines.append(f"{c['name']:<{width}}  {c['status']:<12}  {c['seconds']:>5.1f}s  {c['detail']}")
    n = {s: sum(c["status"] == s for c in doc["checks"]) for s in STATUSES}
    lines.append(f"{n[PASSED]} passed, {n[FAILED]} failed, {n[NEEDS_ASCEND]} need Ascend, {n[SKIPPED]} skipped "
                 f"in {doc['seconds']:.0f} s on {doc['target']}"
                 + ("" if doc["target"] == "ascend" else " — this is not a verdict on a 910B node"))
    return "\n".join(lines)


def read_selftest(path: str | Path) -> dict[str, Any]:
    """A selftest JSON as written by `mspretrain selftest --json`; one-line errors otherwise."""
    p = Path(path)
    if not p.is_file():
        from mspretrain.fsutil import why_not

        raise UserError(f"selftest file {p} {why_not(p)}", "write one with `mspretrain selftest --config CFG --out selftest.json`")
    doc = read_json(p, "pass the output of `mspretrain selftest --json`")
    if not isinstance(doc, dict) or not isinstance(doc.get("checks"), list):
        raise UserError(f"{p} is not a selftest result (no \"checks\" list)", "pass the output of `mspretrain selftest --json`")
    return doc


def measured_tokens_per_s(doc: dict[str, Any], cfg: Config, source: str = "the selftest") -> float:
    """tokens/s per device measured by the selftest's decoder-layer check, for the plan of `cfg`."""
    tps = doc.get("tokens_per_s_per_device")
    if not isinstance(tps, (int, float)) or tps <= 0:
        layer = next((c for c in doc["checks"] if c.get("name") == "decoder layer"), {})
        raise UserError(f"{source} has no measured tokens/s (decoder layer: {layer.get('status', 'missing')})",
                        "run `mspretrain selftest --json` with the same config on the target device")
    measured = doc.get("config") or {}
    m = cfg.model
    mine = {"dim": m.dim, "n_heads": m.n_heads, "seq_len": cfg.data.seq_len, "dtype": cfg.precision.dtype}
    differ = [f"{k} {measured.get(k)} vs {v}" for k, v in mine.items() if measured.get(k) is not None and measured.get(k) != v]
    if differ:
        raise UserError(f"{source} measured another shape ({', '.join(differ)})",
                        "run the selftest with the config you plan (same model, data.seq_len and precision.dtype)")
    return float(tps)
