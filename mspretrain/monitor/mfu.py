"""Model FLOPs per token, device peaks, and the throughput figures logged with every run.

Design choices:
- FLOPs per token follow PaLM (Chowdhery et al. 2022, appendix B):

      flops_per_token = 6 * N + 12 * L * d * T

  N counts the parameters that take part in a matrix multiply: every attention and MLP
  projection of the L layers plus the output projection (lm_head, d x V). The input embedding is
  a gather and RMSNorm is elementwise, so neither is counted; with tied embeddings the output
  projection is still a matmul and is still counted. 6 = 2 FLOPs per multiply-add x (1 forward +
  2 backward). 12 * L * d * T is the attention score and value matmuls (QK^T and PV, forward and
  backward) for a sequence of T tokens, d = n_heads * head_dim; like PaLM it is not halved for the
  causal mask, so MFU stays comparable with published numbers. Recomputation is *not* counted:
  this is model FLOPs utilisation, not hardware FLOPs utilisation.
- Mixture of experts: N counts the parameters a token goes through (`active_matrices`): an MoE
  layer's router and K of its E experts (of width `moe_ffn_dim`, plus a Qwen2-MoE shared
  expert), not all E and not a dense `ffn_dim` MLP; so MFU and plan use active parameters.
- Frozen parameters (`train.trainable`, e.g. stage 1 of continued pretraining): a frozen matrix
  needs no gradient of its own, so its 2 FLOPs per multiply-add of the weight gradient go:

      flops_per_token = 4 * N + 2 * N_trained + 12 * L * d * T

  (forward 2N, backward with respect to the activations 2N, with respect to the weights
  2 N_trained). The activation gradients are counted through every layer, which the stage-1
  recipe needs (the embeddings at the bottom are trained); with only the top groups trained it
  is an upper bound.
- Peaks: a small table of dense (non-sparse) vendor figures per dtype, overridable with
  `device.peak_tflops`. CPUs have no table entry: their fp32 peak is measured at start with a
  numpy (BLAS) sgemm, which is what a well-tuned fp32 matmul reaches on this host — a practical
  ceiling rather than a datasheet number. The measurement takes the best of repeated 1024 x 1024
  sgemms over one second, so one quiet moment suffices; on a shared, busy host it can still come
  out below what the training step later reaches. It is taken once per host and set of usable
  cores and kept in the cache dir (`cpu_peak_tflops.json` in `$MSPRETRAIN_CACHE` or
  ~/.cache/mspretrain; delete it to measure again): a second of CPU at the start of every
  process cost every rank of every run that second again, for the same number (~1 s of each
  test suite subprocess's ~15). MFU never exceeds 100 %: a rate above the peak
  raises the peak to that rate (`observed_peak`; the meter keeps the raised peak for the rest of
  the run and logs it as `peak_tflops`). Pin `device.peak_tflops` when comparing runs.
"""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Sequence

from mspretrain.config.schema import ModelConfig, resolve_model
from mspretrain.errors import UserError
from mspretrain.fsutil import atomic_write, default_cache_dir, read_json_file

# Dense peak TFLOPS per device and compute dtype. None = no reliable published figure.
# Ascend 910B: vendor and cloud listings give 280-376 TFLOPS fp16 depending on the SKU
# (910B4 ... 910B1); 313 is the figure usually quoted for the 910B2/B3 in 8-card Atlas 800T A2
# servers. We found no published fp32 peak for the 910B (fp32 matmuls run on the cube in HF32 or
# on the vector unit): set device.peak_tflops for fp32 runs on Ascend.
# NVIDIA (datasheets, SXM, dense): A100 312 bf16/fp16, 19.5 fp32 (156 TF32);
# H100 SXM 989 bf16/fp16, 67 fp32 (495 TF32).
PEAK_TFLOPS: dict[str, dict[str, float | None]] = {
    "ascend910b": {"fp16": 313.0, "bf16": 313.0, "fp32": None},
    "a100": {"fp16": 312.0, "bf16": 312.0, "fp32": 19.5},
    "h100": {"fp16": 989.0, "bf16": 989.0, "fp32": 67.0},
}
_TARGET_ALIASES = {"ascend": "ascend910b", "910b": "ascend910b", "npu": "ascend910b"}

_cpu_peak_cache: dict[float, float] = {}


def active_matrices(cfg: ModelConfig) -> list[tuple[str, float]]:
    """(name, parameters a token multiplies by) for every matmul weight but the input embedding.

    A dense matrix counts whole. A mixture-of-experts layer's stacked experts (model/moe.py,
    `mlp.w13.weight` (E, 2F, D) and `mlp.w2.weight` (E, D, F): the only 3-D weights) count K/E of
    their size, the K routed experts of width `moe_ffn_dim` a token goes through, not all E; its
    router (E, D) and a Qwen2-MoE shared expert and gate every token runs count whole. So MFU and
    plan count active parameters (Qwen3-30B-A3B: ~3.3 B of 30.5 B, tests/monitor/test_moe_ops.py)."""
    from mspretrain.model.params import matmul_sizes

    m = resolve_model(cfg)
    if not m.vocab_size:
        raise UserError("model.vocab_size is unknown, so FLOPs per token cannot be computed",
                        "set model.vocab_size or resolve the model against the data dir first")
    return matmul_sizes(m)  # the `matmul` and `experts` columns of model/params.py's table


def matmul_params(cfg: ModelConfig) -> int:
    """Parameters that are matmul weights a token goes through: q, k, v, o and the MLP's (for an MoE
    layer the router and K experts', `active_matrices`) per layer, plus lm_head (counted once
    whether tied or not: the embedding lookup is a gather, not a matmul). Read off the parameter
    table (model/params.py, its `matmul` column): every matrix but the input embedding. A family's
    extra tensors (Qwen2's q/k/v biases, Qwen3's QK-norm weights) are vectors, elementwise, not
    matmul FLOPs (under 0.01 % of a 7B's)."""
    return int(round(sum(size for _, size in active_matrices(cfg))))


def trained_matmul_params(cfg: ModelConfig, trainable: Sequence[str] | None) -> int:
    """The part of `matmul_params` that is trained under `train.trainable` (None or ["all"]: all)."""
    from mspretrain.model.groups import ALL, check_trainable, param_groups

    if trainable is None or list(trainable) == [ALL]:
        return matmul_params(cfg)
    check_trainable(trainable)
    m = resolve_model(cfg)
    # a tied embedding is the lm_head's matrix and is trained when either group is (model/groups.py)
    return int(round(sum(size for name, size in active_matrices(cfg)
                         if param_groups(name, bool(m.tie_embeddings)) & set(trainable))))


def flops_per_token(cfg: ModelConfig, seq_len: int, trainable: Sequence[str] | None = None) -> float:
    """Training FLOPs per token: 6 * N_matmul + 12 * n_layers * dim * seq_len (PaLM, appendix B);
    with frozen groups (`trainable`, train.trainable) 4 * N_matmul + 2 * N_trained + the attention.
    The attention term's width is n_heads * head_dim (= dim unless head_dim is explicit, Qwen3)."""
    return (4.0 * matmul_params(cfg) + 2.0 * trained_matmul_params(cfg, trainable)
            + 12.0 * cfg.n_layers * cfg.n_heads * cfg.head_size * seq_len)


def measure_cpu_peak_tflops(seconds: float = 1.0) -> float:
    """fp32 matmul rate of this host in TFLOPS, measured with numpy (the BLAS numpy links).

    Best rate over repeated 1024x1024 sgemms for about `seconds`; cached per process.
    """
    if seconds in _cpu_peak_cache:
        return _cpu_peak_cache[seconds]
    import numpy as np

    rng = np.random.default_rng(0)
    n = 1024
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    a @ b  # warm the BLAS threads
    best = 0.0
    deadline = time.perf_counter() + seconds
    while True:
        t0 = time.perf_counter()
        for _ in range(4):
            a @ b
        dt = time.perf_counter() - t0
        best = max(best, 4 * 2 * n**3 / dt)
        if time.perf_counter() >= deadline:
            break
    _cpu_peak_cache[seconds] = best / 1e12
    return _cpu_peak_cache[seconds]


def _host_key() -> str:
    """What the measured peak depends on: the CPU model and the cores this process may use."""
    model = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0
    return f"{model or 'unknown cpu'} x {cores}"


def cpu_peak_tflops(cache_dir: Path | None = None) -> float:
    """`measure_cpu_peak_tflops()` once per host and set of usable cores, kept in
    `cache_dir/cpu_peak_tflops.json` (default: the cache dir). An unreadable or damaged cache
    means measuring; an unwritable one, measuring every time: MFU never stops a run."""
    path = (cache_dir or default_cache_dir()) / "cpu_peak_tflops.json"
    key = _host_key()
    try:  # a regular file of at most 1 MB (a FIFO there hung every run's start, a link to /dev/zero filled memory)
        known = read_json_file(path, "cached CPU peak", cap=1 << 20) if os.path.lexists(path) else {}
        value = float(known[key]) if isinstance(known, dict) and key in known else 0.0
    except (UserError, ValueError, TypeError, OverflowError):
        known, value = {}, 0.0
    if math.isfinite(value) and value > 0:
        return value
    value = measure_cpu_peak_tflops()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        table = {**(known if isinstance(known, dict) else {}), key: value}
        atomic_write(path, json.dumps(table, indent=1, sort_keys=True) + "\n", fsync=False)  # a cache: rebuilt if lost
    except OSError:
        pass
    return value


def device_peak_tflops(target: str, dtype: str, override: float = 0.0) -> float:
    """Per-device peak for MFU: the override if set, a measurement on CPU (once per host,
    `cpu_peak_tflops`), else the table (0 = unknown)."""
    if override > 0:
        return float(override)
    key = target.lower()
    if key == "cpu":
        return cpu_peak_tflops()
    key = _TARGET_ALIASES.get(key, key)
    value = PEAK_TFLOPS.get(key, {}).get(dtype)
    return float(value) if value else 0.0


def observed_peak(peak_tflops: float, *, tokens: int, seconds: float, flops_per_token: float, devices: int) -> float:
    """The peak to use after a window that reached `tokens` in `seconds`: the given one, or the
    rate actually reached per device when it is higher (a measured CPU peak that came out low).
    0 (unknown) stays 0."""
    if peak_tflops <= 0 or seconds <= 0:
        return peak_tflops
    return max(peak_tflops, tokens / seconds * flops_per_token / devices / 1e12)


def throughput_metrics(*, tokens: int, samples: int, seconds: float, flops_per_token: float,
                       peak_tflops: float, devices: int, real_tokens: int | None = None,
                       price_per_device_hour: float = 0.0) -> dict[str, float]:
    """The field report's yardsticks over one measurement window (all devices together).

    tokens/samples are what the whole job consumed in `seconds`; real_tokens excludes padding;
    MFU is omitted when the peak is unknown, cost when no price is configured.
    """
    if seconds <= 0 or tokens <= 0:
        return {}
    tps = tokens / seconds
    out = {"tokens_per_s": tps, "samples_per_s": samples / seconds,
           "tokens_per_device_hour": tps * 3600.0 / devices}
    if peak_tflops > 0:
        out["mfu"] = min(1.0, tps * flops_per_token / (devices * peak_tflops * 1e12))
    if real_tokens is not None:
        out["real_token_share"] = real_tokens / tokens
    if price_per_device_hour > 0:
        out["cost_per_btok"] = price_per_device_hour / out["tokens_per_device_hour"] * 1e9
    return out
