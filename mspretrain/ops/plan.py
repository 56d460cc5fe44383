"""`mspretrain plan`: parameters, memory per device, steps, warm-up, lr, time and cost — before launch.

Design choices:
- Pure arithmetic on the config: no MindSpore import, answers in milliseconds, testable by hand.
- Memory per device (bytes) is `memory_model`: the buffers train/step.py allocates, counted from the
  model's real parameter list, owners and buckets (train/layout.py), for the most loaded rank, and
  `peak`, the largest set alive at once, which is what is compared with the usable device memory
  (`device.max_device_memory`; 58 GB on a 910B as in MindSpore Transformers' templates):
    weights          parameters in their storage dtype (2 bytes for fp16/bf16 matrices with
                     precision.param_dtype=compute, else 4)
    half weights     fp16/bf16 compute with fp32 parameters: the cast copies the matmuls read (2 bytes)
    master weights   4 bytes per owned half-precision parameter, and per element of the owned
                     slice of a split parameter (optim.split_mb; fp32 ones too)
    gradients        fp32 accumulation buffers: only with accumulation; owned parameters only
                     with optim.shard_gradients
    micro gradients  one micro-batch's gradients in the parameter dtype (alive at the end of backward)
    Adam moments     8 bytes per owned parameter (a split parameter: per element of the slice)
    activations      per micro-batch of b sequences of length s, per layer (e = 2 bytes for
                     fp16/bf16 compute, 4 for fp32; h = dim, f = ffn_dim, kv = n_kv_heads*head_dim,
                     a = n_heads):  e*s*b*(6h + 2kv + 4f) + attention
                     i.e. Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
                     Transformer Models", eq. 1) redone for Llama: SwiGLU MLP, RMSNorm, no dropout.
                     attention = (4 + e)*a*s^2*b for the math path (fp32 softmax output for its
                     backward plus the probabilities cast back for P@V; one tensor when e = 4), or
                     64*a*s*b with Ascend's FlashAttentionScore (fp32 row max and sum, 8 lanes
                     each). With full recomputation only each layer's input (e*s*b*h) is kept, plus
                     one layer's activations while it is recomputed. Plus fp32 logits and
                     log-probabilities: 8*s*b*V.
    collective buckets  the largest bucket's flat copy and its result; on CPU (world > 1) a measured
                        6.2 x the largest bucket (CPU_BUCKET_FACTOR), with buckets of 32 MB there
                        (optim.bucket_mb = "auto": 256 MB on Ascend, 32 MB on CPU)
    update temporaries  8 bytes x the largest owned parameter or slice (scaled gradient, masked copy)
    HCCL + workspace    Ascend: 1 GiB of kernel workspace and HCCL's communication buffers
                        (HCCL_BUFFSIZE, 200 MB per communicator by default; assumed, not measured).
                        JSON key `framework_reserve` (kept for scripts that read it)
- HCCL_BUFFSIZE (Ascend, devices > 1; JSON `hccl`): the buffer that holds the step's largest
  collective (train/hccl.py `buffsize_mb`), which `launch` exports; not added to the memory above.
    CPU backend         device.target = cpu only: resident memory MindSpore 2.10's CPU backend holds
                        outside the tensors above, from the first call of each compiled graph on
                        (measured, docs/benchmarks/memory.md runs 3 and 4): a per-parameter runtime
                        term fitted on the fp32 run and, with fp16 compute, a per-half-matrix term
                        fitted on the fp16 run (10m -> 120m each; the 60 M midpoint, 256 M and
                        the other modes, 2 workers sharded included, are checked out of sample)
- Host memory per node (`host_bytes`), apart from the device: model initialisation (on Ascend each
  weight is drawn on the host and sent to HBM at once, so one fp32 parameter per rank at a time; on
  CPU the model is the device memory above), async checkpoint snapshots (the host copy of the
  weights, written by rank 0, and of every rank's optimizer-state shard, fp32, alive while the
  writer runs), the loader's index maps (an int64 window permutation of the train split per rank,
  data/loader.py), and the process baseline (MindSpore and Python, measured on CPU).
- On CPU the host is the device: `process_peak` is the whole `mspretrain train` process, the step
  peak plus the baseline, the async snapshot (it overlaps the following steps) and the loader maps.
- Steps, warm-up, lr and the micro-batch split come from `mspretrain/budget.py`, which the trainer
  uses too, so the plan and the run cannot disagree. The budget is --tokens, else the config's
  train.max_steps / max_tokens (what `train` will run), else one pass over the --data dir.
"""
from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

from mspretrain import budget
from mspretrain.config import Config, ModelConfig, resolve_model
from mspretrain.device import ASCEND_910B_USABLE_GB
from mspretrain.errors import UserError
from mspretrain.model.presets import param_count, preset

GB = 1024**3
# MindSpore Transformers' published llama2_7b pretraining throughput (seq 4096, wikitext-2, 8 devices):
# 4,100 tokens/s/p on Atlas 900 A2 PoDc (910B) — docs/model_cards/llama2.md ("模型性能") of
# mindspore-lab/mindformers; the same table lists 4,160 tokens/s/p for pretrain_llama2_7b_bf16.yaml
# on Atlas 800T A2.
MINDFORMERS_LLAMA2_7B = {
    "tokens_per_s_per_device": 4100.0, "seq_len": 4096, "devices": 8, "hardware": "Atlas 900 A2 PoDc (Ascend 910B)",
    "source": "MindSpore Transformers docs/model_cards/llama2.md, model performance table: llama2_7b pretrain, wiki, seq 4096, 4100 tks/s/p",
}
LLAMA2_7B_PARAMS = 6_738_415_616  # HF meta-llama/Llama-2-7b-hf


def _param_count(m: ModelConfig) -> int:
    return int(param_count(m))


def preset_model(name: str) -> ModelConfig:
    return preset(name)


def activation_bytes(m: ModelConfig, seq_len: int, micro_batch: int, dtype: str, recompute: bool,
                     flash: bool = False) -> int:
    """Activation memory of one micro-batch on one device (see the module docstring)."""
    m = resolve_model(m)
    e = 4 if dtype == "fp32" else 2
    s, b, h, f, a = seq_len, micro_batch, m.dim, m.ffn_dim, m.n_heads
    kv = m.n_kv_heads * m.head_size
    attention = 64 * a * s * b if flash else (4 if e == 4 else 4 + e) * a * s * s * b
    per_layer = e * s * b * (6 * h + 2 * kv + 4 * f) + attention
    logits = 8 * s * b * m.vocab_size
    if recompute:
        return m.n_layers * e * s * b * h + per_layer + logits
    return m.n_layers * per_layer + logits


# Inside that pool, kernel workspace and HCCL's own buffers (HCCL_BUFFSIZE, 200 MB per communicator by
# default): an assumption from the documented defaults, not measured (no 910B here).
ASCEND_RESERVE_BYTES = GB

# MindSpore 2.10's CPU backend: what a CPU run holds beyond the tensors of the step (device.target =
# cpu only; docs/benchmarks/memory.md, runs 3 and 4, has the measurements and which numbers were fitted).
# Not a term any more: Select with a broadcast operand. The CPU kernel's Resize builds one index list
#    per input (cond, x, y) of the output's size, 8 bytes an entry, kept in the kernel object for the
#    life of the compiled graph (kernel/cpu/native/select_cpu_kernel.cc, GetBroadCastIndex into
#    index_list1_..3_): 24 bytes per element of every `where` with a 0-d operand over a full tensor.
#    The step had two (the overflow mask of `_finish`, the first-micro-batch overwrite of
#    `accumulate`); it no longer has any (run 3 measured, run 4 confirms), and
#    tests/test_plan_backend.py keeps it that way.
# 1. The rest of the measured per-parameter slope, as a per-parameter constant: the pool's and the
#    kernels' share that no tensor of the plan accounts for (it includes the model's split copies of
#    the fused wqkv / w13 weights, 3.2 bytes/param measured). Fitted on one pair of one mode: the fp32
#    fused step, 10m -> 120m (run 4: measured 24.2 B/param = 18.4 planned tensors + 5.8). Run 3's
#    7.2 was fitted on 10m -> 60m with the step's Select term still in it.
CPU_RUNTIME_BYTES_PER_PARAM = 5.8
# 2. fp16/bf16 compute on CPU, per element of the half-eligible matrices: MindSpore's CPU kernels on
#    fp16 hold fp32 working copies (probes: an fp16 MatMul keeps about an fp32 copy of its weight;
#    an fp16 elementwise op holds ~16 bytes per element beyond its output). Fitted on one pair: the
#    fp16 (+ fp32 masters) fused step, 10m -> 120m, after term 1 (run 4: measured 42.4 B/param =
#    17.4 planned tensors + 5.8 + 0.99 x 19.3).
CPU_HALF_BYTES_PER_PARAM = 19.3
# 3. A bucket crossing ranks (world > 1): on CPU the step's collective transient is this many times
#    the largest bucket's bytes, in place of a flat copy and its result. Measured with
#    benchmarks/bucket_memory_bench.py: the real fused ZeRO-2 step of 2 msrun workers around a model
#    that is only parameters (16 x 16 MB), its first call's growth beyond the same step on one process,
#    divided by the largest bucket: 4.3 x at 256 MB, 4.5 x at 64 MB, 6.2 x at 32 MB (the CPU default;
#    the smallest buckets carry a fixed part too). What it is: on CPU the gather is an AllReduce of a
#    zero-padded flat bucket, so a bucket holds its own part, the padding, the flat copy, the result
#    and the slices cut from it, plus mccl's received chunks. The largest factor is the term
#    (docs/benchmarks/memory.md run 5). Replicated gradients (no sharding; a flat AllReduce and its
#    pieces) get the same factor, unmeasured: their bucket holds the same copies less the padding and
#    the own part, so it should be on the safe side there.
CPU_BUCKET_FACTOR = 6.2


def cpu_backend_bytes(sizes: Sequence[int], half_matrix: Sequence[bool], half: bool) -> float:
    """The CPU backend's resident term (device.target = cpu): see the constants above."""
    return (CPU_RUNTIME_BYTES_PER_PARAM * sum(sizes)
            + (CPU_HALF_BYTES_PER_PARAM * sum(n for n, h in zip(sizes, half_matrix) if h) if half else 0.0))


def memory_model(m: ModelConfig, cfg: Config, *, devices: int, micro: int, accum: int, zero: bool, shard_grads: bool,
                 recompute: bool, flash: bool, target: str, shard_params: bool = False) -> tuple[dict[str, float], Any]:
    """Bytes per device by kind, for the most loaded rank, plus `peak`: the largest set alive at once.

    Exactly the buffers train/step.py allocates (tests/test_zero2.py checks them against a real
    TrainStep): parameters in their storage dtype; fp32 masters and Adam moments of the owned
    parameters; fp32 accumulation buffers only with accumulation (for the owned parameters with
    sharded gradients). Transients: one micro-batch's gradients (parameter dtype, all alive at the
    end of the backward pass), the activations, the largest collective bucket (flat copy and result),
    and the update's per-tensor temporaries (scaled gradient and its masked copy, 8 bytes x the
    largest owned parameter). Phases: accumulate = activations + micro-batch gradients (+ the
    reduction with sharded gradients); update = collectives + update temporaries (+ the micro-batch
    gradients without accumulation, where the update runs in the same graph).
    With `train.trainable` naming groups, frozen parameters count as weights only: masters,
    moments, accumulation buffers, micro-batch gradients, buckets and temporaries are those of the
    trained parameters (the step computes no gradient for a frozen one).
    ZeRO-3 (`shard_params`, train/zero3.py): the trained weights, their micro-batch gradients,
    masters (half ones only: an fp32 slice is its own), moments and buffers are rank 0's slices
    (the largest); `gathered_weights` is what the gathers hold during a micro-batch: every trained
    weight whole without recompute (a gathered weight lives until its layer's backward), the
    largest layer's plus the lm_head's with it; the collective buffers are the largest parameter's."""
    from mspretrain.model.groups import trainable_mask
    from mspretrain.model.presets import is_half_eligible, param_shapes
    from mspretrain.train.layout import bucket_mb_for, cap_elements, plan_layout, split_elements_for, zero3_layout

    shapes = param_shapes(m)
    sizes = [math.prod(s) for _, s in shapes]
    half = cfg.precision.dtype in ("fp16", "bf16")
    half_params = half and cfg.precision.param_dtype == "compute"
    is_half = [half_params and is_half_eligible(n) for n, _ in shapes]
    wire16 = [cfg.precision.allreduce_dtype == "fp16" and "lm_head" not in n for n, _ in shapes]
    # train.trainable: the step keeps optimizer state, gradients and buckets for the trained
    # parameters only (T); frozen ones are weights and nothing else. Indices below are into all.
    T = [i for i, k in enumerate(trainable_mask([n for n, _ in shapes], cfg.train.trainable, tied=m.tie_embeddings)) if k]
    cap = cap_elements(bucket_mb_for(cfg.optim.bucket_mb, target))
    zero3 = shard_params and devices > 1
    if zero3:
        layout = zero3_layout([sizes[i] for i in T], [is_half[i] for i in T], [wire16[i] for i in T], devices)
    else:
        layout = plan_layout([sizes[i] for i in T], [is_half[i] for i in T], [wire16[i] for i in T], devices,
                             shard=zero, shard_grads=shard_grads, cap=cap, split=split_elements_for(cfg.optim.split_mb, cap))
    # the heaviest rank's state: (parameter index into all, elements it holds: all, or its slice
    # of a split parameter, whose fp32 master is a tensor of its own even for an fp32 parameter)
    heavy = layout.heaviest_rank() if layout.sharded else 0
    owned = [(T[j], n, layout.is_split(j)) for j, n in zip(layout.owned(heavy), layout.owned_sizes(heavy))] \
        if layout.sharded else [(i, sizes[i], False) for i in T]
    pbytes = [2 if h else 4 for h in is_half]
    held = {i: n for i, n, _ in owned} if zero3 else {}  # ZeRO-3: the elements of each trained weight held
    mem: dict[str, float] = {
        "weights": sum(held.get(i, n) * b for i, (n, b) in enumerate(zip(sizes, pbytes))),
        # fp16/bf16 compute with fp32 parameters: the cast copy of each decoder matrix the matmuls read
        "half_weights": sum(2 * n for (name, _), n in zip(shapes, sizes) if is_half_eligible(name)) if half and not half_params else 0,
        "master_weights": sum(4 * n for i, n, cut in owned if is_half[i] or (cut and not zero3)),
        "gradients": (sum(4 * n for _, n, _ in owned) if layout.shard_grads else sum(4 * sizes[i] for i in T)) if accum > 1 else 0,
        "micro_gradients": sum(held.get(i, sizes[i]) * pbytes[i] for i in T),
        "adam_moments": sum(8 * n for _, n, _ in owned),
        "activations": activation_bytes(m, cfg.data.seq_len, micro, cfg.precision.dtype, recompute, flash),
    }
    mem["gathered_weights"] = gathered_bytes(shapes, sizes, pbytes, T, recompute) if zero3 else 0
    red, gat = layout.largest_bucket_bytes()
    if zero3:  # one collective per parameter: the largest one's gather and its gradient's reduction
        red = gat = max(sizes[i] * pbytes[i] for i in T)
    # a flat copy and the result: AllReduce's result is the whole bucket; ReduceScatter's (Ascend) 1/N
    reduce_t = red + (red / devices if layout.shard_grads and target == "ascend" else red) if devices > 1 else 0
    gather_t = gat + gat / devices if devices > 1 else 0
    if devices > 1 and target == "cpu":  # measured, not derived: see CPU_BUCKET_FACTOR
        reduce_t = gather_t = CPU_BUCKET_FACTOR * max(red, gat)
    mem["collective_buffers"] = max(reduce_t, gather_t)
    mem["update_temporaries"] = 8 * max(n for _, n, _ in owned)
    mem["framework_reserve"] = ASCEND_RESERVE_BYTES if target == "ascend" else 0
    mem["cpu_backend"] = (cpu_backend_bytes(sizes, [is_half_eligible(n) for n, _ in shapes], half)
                          if target == "cpu" else 0)
    persistent = sum(mem[k] for k in ("weights", "half_weights", "master_weights", "gradients", "adam_moments"))
    update = mem["collective_buffers"] + mem["update_temporaries"]
    if accum > 1:
        accumulate = mem["activations"] + mem["micro_gradients"] + (reduce_t if layout.shard_grads else 0)
    else:
        accumulate = mem["activations"] + mem["micro_gradients"] + (reduce_t if zero3 else 0)
        update += mem["micro_gradients"]
    accumulate += mem["gathered_weights"]
    mem["total"] = sum(mem.values())
    # the CPU backend's term is resident from the first call of each graph on: it adds to the peak
    mem["peak"] = persistent + max(accumulate, update) + mem["framework_reserve"] + mem["cpu_backend"]
    return mem, layout


def gathered_bytes(shapes: list, sizes: list[int], pbytes: list[int], trained: list[int], recompute: bool) -> int:
    """ZeRO-3: bytes of the gathered (whole) weights alive at once during a micro-batch (see
    `memory_model`): all trained ones without recompute; with it the largest decoder layer's plus
    the lm_head's (or the tied embedding's), which the loss's backward holds."""
    whole = {i: sizes[i] * pbytes[i] for i in trained}
    if not recompute:
        return sum(whole.values())
    layers: dict[str, int] = {}
    for i, b in whole.items():
        name = shapes[i][0]
        if name.startswith("layers."):
            key = name.split(".")[1]
            layers[key] = layers.get(key, 0) + b
    head = [b for i, b in whole.items() if shapes[i][0].startswith(("lm_head", "embed"))]
    return max(layers.values(), default=0) + max(head, default=0)


# The bus bandwidth the overlap estimate assumes for HCCL on one 8 x 910B node when no measurement
# is given (`plan --bus-gbps`, or `selftest`'s measured figure): an assumption, not a measurement
# (no 910B here). Bus bandwidth as nccl-tests/hccl_test define it: a ring AllReduce of S bytes over
# N ranks takes 2(N-1)/N * S / busbw, a ReduceScatter or AllGather (N-1)/N * S / busbw.
ASSUMED_BUS_GBPS = 100.0
# Share of a step's compute spent in the backward pass: 2 of the 3 matmul passes (forward 1,
# backward 2), or 3 of 4 with full recomputation (the forward runs again inside the backward).
BACKWARD_SHARE, BACKWARD_SHARE_RECOMPUTE = 2 / 3, 3 / 4


def overlap_estimate(layout: Any, *, backward_s: float, bus_bytes_per_s: float) -> dict[str, Any]:
    """How much of one backward pass's gradient reduction the backward pass can hide.

    The reduction collectives run in readiness order (train/layout.py): bucket k can start when the
    backward pass has produced its gradients (the backward time up to it, taken proportional to the
    parameters before it: matmul FLOPs scale with the parameters) and the link is free. Exposed =
    when the last collective ends minus the end of the backward pass. One backward pass: with
    sharded gradients that is one micro-batch's (the reduction runs per micro-batch)."""
    n = layout.world
    wb = lambda i: 2 if layout.wire16[i] else 4
    items = []  # (readiness, elements of gradients, bytes on the wire, ring factor)
    for b in layout.reduce_flat:
        items.append((min(b.indices), sum(b.sizes), sum(s * wb(i) for i, s in zip(b.indices, b.sizes)), 2 * (n - 1) / n))
    for b in layout.reduce_rank:
        idx = [i for seg in b.segments for i in seg]
        items.append((min(idx), sum(b.used(r) for r in range(n)), b.numel * wb(idx[0]), (n - 1) / n))
    for i in layout.reduce_single:
        items.append((i, layout.sizes[i], layout.sizes[i] * wb(i), 2 * (n - 1) / n))
    items.sort(key=lambda t: -t[0])
    total = sum(layout.sizes) or 1
    done, link_free, buckets = 0.0, 0.0, []
    for _, elems, nbytes, ring in items:
        compute = backward_s * elems / total
        done += compute
        comm = ring * nbytes / bus_bytes_per_s
        link_free = max(done, link_free) + comm
        buckets.append({"compute_s": compute, "comm_s": comm, "bytes": nbytes})
    comm_total = sum(b["comm_s"] for b in buckets)
    exposed = max(0.0, link_free - backward_s) if buckets else 0.0
    return {"buckets": buckets, "backward_s": backward_s, "comm_s": comm_total, "exposed_s": exposed,
            "bus_gbps": bus_bytes_per_s / 1e9}


# Resident memory of a `mspretrain train` process beside the model's terms: Python, MindSpore's
# libraries and runtime, the tokenizer, TensorBoard, the compiled graphs' fixed parts. Fitted on one
# whole CPU process (benchmarks/memory_bench.py --whole-process 2m,60m: the 1.7 M-parameter run's
# peak RSS, 0.98 GiB, less the plan's other terms, 0.06 GiB) and checked on the other: the 55 M run
# measured 2.76 GiB, planned 2.70 GiB (0.98). Imports and one CPU op alone: 0.41 GiB.
PROCESS_BASELINE_BYTES = 0.92 * GB


def host_memory(m: ModelConfig, cfg: Config, layout: Any, *, devices: int, target: str, tokens: int | None) -> dict[str, float]:
    """Host bytes per node by kind (see the module docstring); `devices` ranks on the node."""
    from mspretrain.model.presets import is_half_eligible, param_shapes

    shapes = param_shapes(m)
    sizes = [math.prod(sh) for _, sh in shapes]
    total = sum(sizes)
    trained = sum(layout.sizes)
    half = cfg.precision.dtype in ("fp16", "bf16") and cfg.precision.param_dtype == "compute"
    masters = sum(n for (name, _), n in zip(shapes, sizes) if half and is_half_eligible(name))
    out: dict[str, float] = {
        # Ascend: one fp32 parameter per rank on its way to HBM; CPU: the weights are the device's
        "model_init": devices * 4 * max(sizes) if target == "ascend" else 0,
        # the saver's host copy: fp32 weights (rank 0) + every rank's moments and masters (fp32)
        "checkpoint_snapshot": (4 * total + 8 * trained + 4 * masters) if cfg.checkpoint.async_save else 0,
        # one int64 per train window per rank (the epoch permutation)
        "loader_maps": devices * 8 * (tokens or 0) // max(cfg.data.seq_len, 1),
        "process_baseline": devices * PROCESS_BASELINE_BYTES,
    }
    out["total"] = sum(out.values())
    return out


def checkpoint_bytes(params: int, half_params: str | None = None, trained: int | None = None) -> int:
    """One checkpoint on disk: fp32 weights + fp32 Adam m and v (safetensors), JSON negligible.
    With parameters stored in fp16 the weights file holds them as fp16 and the optimizer state
    adds the fp32 masters (14 bytes); bf16 weights are written as fp32 (numpy has no bf16): 16.
    trained: parameters with optimizer state (train.trainable), default all of them."""
    trained = params if trained is None else trained
    weights = {None: 4, "fp16": 2, "bf16": 4}[half_params]
    return weights * params + 8 * trained + (4 * trained if half_params else 0)


def _sharding(plan: dict) -> str:
    if plan.get("shard_parameters"):
        return ", weight, optimizer and gradient sharding (ZeRO-3)"
    return ", optimizer and gradient sharding" if plan["shard_gradients"] else ", optimizer sharding"


def host_ram_gb() -> float:
    """This machine's physical memory in GB. On CPU the host is the device, and the ranks of a
    launch on this machine share it: each rank's peak is compared with its share."""
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GB


def target_given(target: str | None, cfg: Config) -> bool:
    return cfg.device.target == "auto" and target is not None


def make_plan(cfg: Config, *, devices: int, tokens: int | None, data_dir: Path | None,
              tokens_per_s_per_device: float | None, device_mem_gb: float | None = None,
              zero: bool = False, recompute: bool = False, flash: bool | None = None,
              assumed: Sequence[str] = (), bus_gbps: float | None = None, target: str | None = None,
              nodes_ranks: int | None = None) -> dict:
    """The plan as a dict (bytes, steps, hours); `format_plan` prints it.

    zero / recompute: also taken from the config (optim.shard_optimizer, train.recompute), so a
    plan of a config shows what that config will run; the flags ask "what if".
    flash: whether attention runs as Ascend's fused kernel; default: fp16/bf16 on a non-CPU target.
    tokens: a token budget instead of the config's (without either, one pass over `data_dir`; with
    none at all the plan has memory but no steps, warm-up or time). assumed: values the caller
    chose for the user, printed with the plan. bus_gbps: HCCL bus bandwidth for the overlap
    estimate (measured by `selftest`; default ASSUMED_BUS_GBPS, said to be assumed).
    target: the device to plan for when the config says `auto` (`plan` passes this machine's);
    None: Ascend when flash attention is assumed, else the config's value.
    nodes_ranks: ranks per server for the HCCL buffer (`launch` passes --nproc); None: 8 (Atlas 800T A2).
    """
    zero = zero or cfg.optim.shard_optimizer
    recompute = recompute or cfg.train.recompute
    if devices < 1:
        raise UserError(f"--devices {devices} must be at least 1", "give the number of devices, e.g. --devices 8")
    if bus_gbps is not None and not bus_gbps > 0:  # NaN too
        raise UserError(f"--bus-gbps {bus_gbps} must be a positive number of GB/s", "e.g. --bus-gbps 100, or `selftest`'s measured figure")
    m = cfg.model
    manifest_tokens = None
    if data_dir is not None:
        from mspretrain.data.manifest import read_manifest

        manifest = read_manifest(data_dir, required={"tokens": dict, "vocab_size": int})
        manifest_tokens = int(manifest["tokens"]["train"])
        if not m.vocab_size:
            m = replace(m, vocab_size=int(manifest["vocab_size"]))
    if not m.vocab_size:
        raise UserError("model.vocab_size is 0 (taken from the data dir at train time)", "pass --data DIR or set model.vocab_size=N")
    m = resolve_model(m)
    seq, gb = cfg.data.seq_len, cfg.train.global_batch
    # steps, warm-up, lr and the batch split exactly as `train` derives them (memory needs no budget)
    b = budget.derive(cfg, world=devices, data_tokens=manifest_tokens, tokens=tokens)
    micro, accum = b.micro_batch, b.accumulation

    P = _param_count(m)
    half = cfg.precision.dtype in ("fp16", "bf16")
    here = target  # the machine's own target (device.target = auto, one device), or None
    planned_for = cfg.device.target if cfg.device.target != "auto" else (target or "auto")
    if flash is None:
        flash = half and planned_for not in ("cpu",)
    half_params = half and cfg.precision.param_dtype == "compute"
    shard_params = cfg.optim.shard_parameters
    shard_grads = cfg.optim.shard_gradients or shard_params
    target = "ascend" if (planned_for == "ascend" or flash) else planned_for
    mem, layout = memory_model(m, cfg, devices=devices, micro=micro, accum=accum, zero=zero, shard_grads=shard_grads,
                               recompute=recompute, flash=flash, target=target, shard_params=shard_params)
    # a device size given on the command line wins (it used to be ignored for Ascend configs)
    usable_gb = device_mem_gb or cfg.device.max_device_memory or (
        ASCEND_910B_USABLE_GB if target == "ascend" else round(host_ram_gb() / devices, 1) if target == "cpu" else 64.0)
    calls, wire_bytes = layout.traffic(accum)
    trained = sum(layout.sizes)  # the layout is built over the trained parameters only
    other = activation_bytes(m, seq, micro, cfg.precision.dtype, not recompute, flash)
    plan: dict[str, Any] = {
        "model": {"dim": m.dim, "n_layers": m.n_layers, "n_heads": m.n_heads, "n_kv_heads": m.n_kv_heads,
                  "ffn_dim": m.ffn_dim, "vocab_size": m.vocab_size, "tie_embeddings": m.tie_embeddings},
        "params": P, "devices": devices, "global_batch": gb, "micro_batch": micro, "accumulation": accum,
        "seq_len": seq, "dtype": cfg.precision.dtype, "zero": zero or shard_grads, "shard_gradients": shard_grads and devices > 1,
        "shard_parameters": shard_params and devices > 1,
        "recompute": recompute, "flash_attention": flash,
        "tokens": b.tokens, "tokens_source": b.tokens_source, "steps": b.steps, "warmup_steps": b.warmup,
        "warmup_note": b.warmup_note, "lr": b.lr, "lr_note": b.lr_note, "assumed": list(assumed),
        "memory_bytes": mem, "activations_other_bytes": other, "device_mem_gb": usable_gb,
        "collectives_per_step": {"calls": calls, "bytes": wire_bytes},
        "checkpoint_bytes": checkpoint_bytes(P, cfg.precision.dtype if half_params else None, trained=trained),
        "trained_params": trained, "warnings": [],
        "target": target, "target_source": ("device.target" if cfg.device.target != "auto"
                                            else "this machine (device.target = auto)" if target_given(here, cfg) else "assumed"),
    }
    if target == "ascend" and devices > 1:  # what `launch` exports as HCCL_BUFFSIZE (train/hccl.py says why)
        from mspretrain.train.hccl import NPUS_PER_SERVER, buffsize_mb

        largest = max(layout.largest_bucket_bytes())
        per_node = min(devices, nodes_ranks or NPUS_PER_SERVER)
        node_count = -(-devices // per_node)
        plan["hccl"] = {"largest_collective_bytes": largest, "nodes": node_count,
                        "buffsize_mb": buffsize_mb(largest, per_node, node_count)}
    plan["host_bytes"] = host_memory(m, cfg, layout, devices=devices, target=target, tokens=b.tokens)
    if target == "cpu":  # the host is the device: the whole process
        h = plan["host_bytes"]
        mem["process_peak"] = (mem["peak"] + h["process_baseline"] + h["checkpoint_snapshot"] + h["loader_maps"]) / devices
    peak_gb = mem["peak"] / GB
    if peak_gb > usable_gb:
        fixes = [f for f, ok in (("--recompute", not recompute), ("optim.shard_gradients=true", not shard_grads and devices > 1 and accum > 1),
                                 ("--zero", not zero and devices > 1),
                                 ("precision.param_dtype=compute", half and not half_params),
                                 ("a smaller train.micro_batch", micro > 1)) if ok]
        plan["warnings"].append(f"WILL NOT FIT: peak {peak_gb:.1f} GB per device > {usable_gb:g} GB usable"
                                + (f"; try {', '.join(fixes)}" if fixes else "; use more devices with model parallelism or a smaller model"))
    elif peak_gb > 0.9 * usable_gb:
        plan["warnings"].append(f"tight: peak {peak_gb:.1f} GB of {usable_gb:g} GB usable per device; fragmentation is not in this estimate")
    if tokens_per_s_per_device and b.tokens:
        hours = b.tokens / (tokens_per_s_per_device * devices) / 3600
        plan["time"] = {"tokens_per_s_per_device": tokens_per_s_per_device, "hours": hours, "device_hours": hours * devices}
        if cfg.cost.price_per_device_hour:
            plan["time"]["cost"] = hours * devices * cfg.cost.price_per_device_hour
    rate = tokens_per_s_per_device or (MINDFORMERS_LLAMA2_7B["tokens_per_s_per_device"]
                                       if abs(P - LLAMA2_7B_PARAMS) / LLAMA2_7B_PARAMS < 0.01 else None)
    if devices > 1 and rate:
        step_s = gb * seq / devices / rate
        share = BACKWARD_SHARE_RECOMPUTE if recompute else BACKWARD_SHARE
        est = overlap_estimate(layout, backward_s=step_s * share / accum, bus_bytes_per_s=(bus_gbps or ASSUMED_BUS_GBPS) * 1e9)
        # replicated gradients with accumulation are reduced once, after the last micro-batch
        # (TrainStep.apply): nothing hides that reduction
        if accum > 1 and not layout.shard_grads:
            est["exposed_s"] = est["comm_s"]
        est["per_step"] = accum if layout.shard_grads else 1
        est["bus_source"] = "given" if bus_gbps else "assumed"
        est["rate_source"] = "given" if tokens_per_s_per_device else "MindSpore Transformers' llama2_7b reference"
        plan["overlap"] = est
    from mspretrain.ops.layouts import MAX_DEVICES

    if 1 < devices <= MAX_DEVICES:  # every layout of these devices, and the cheapest that fits (ops/layouts.py)
        from mspretrain.ops.layouts import layout_table

        plan["layouts"] = layout_table(replace(cfg, model=m, train=replace(cfg.train, recompute=recompute)), m, devices=devices,
                                       flash=flash, target=target, usable_gb=usable_gb, bus_gbps=bus_gbps or ASSUMED_BUS_GBPS,
                                       tokens_per_s=tokens_per_s_per_device)
    if abs(P - LLAMA2_7B_PARAMS) / LLAMA2_7B_PARAMS < 0.01:
        ref: dict[str, Any] = dict(MINDFORMERS_LLAMA2_7B)
        if b.tokens:
            ref["hours_at_reference"] = b.tokens / (ref["tokens_per_s_per_device"] * devices) / 3600
        if tokens_per_s_per_device:
            ref["ratio"] = tokens_per_s_per_device / ref["tokens_per_s_per_device"]
        plan["reference"] = ref
    return plan


def _gb(x: float) -> str:
    return f"{x / GB:,.2f} GB"


def format_plan(plan: dict) -> str:
    m, mem = plan["model"], plan["memory_bytes"]
    lines = [
        f"model      dim {m['dim']}, {m['n_layers']} layers, {m['n_heads']} heads (kv {m['n_kv_heads']}), "
        f"ffn {m['ffn_dim']}, vocab {m['vocab_size']:,}",
        f"target     {plan.get('target', '?')} ({plan.get('target_source', '')})",
        f"params     {plan['params']:,} ({plan['params'] / 1e9:.2f} B)"
        + (f", {plan['trained_params']:,} trained (train.trainable; the rest frozen: weights only)"
           if plan.get("trained_params", plan["params"]) < plan["params"] else ""),
        f"layout     {plan['devices']} devices, global batch {plan['global_batch']} = micro {plan['micro_batch']} "
        f"x accum {plan['accumulation']} x {plan['devices']}, seq {plan['seq_len']}, {plan['dtype']}"
        + (_sharding(plan) if plan["zero"] else "")
        + (", recompute" if plan["recompute"] else "")
        + (", flash attention" if plan["flash_attention"] else ""),
    ]
    if plan.get("assumed"):
        lines.append(f"assumed    {', '.join(plan['assumed'])}")
    if plan["steps"]:
        lines += [f"tokens     {plan['tokens']:,} (from {plan['tokens_source']})",
                  f"steps      {plan['steps']:,}",
                  f"warm-up    {plan['warmup_steps']:,} steps ({plan['warmup_note']})"]
    else:
        lines.append("tokens     — (no budget: --tokens N, --data DIR or train.max_steps / max_tokens give steps, warm-up and time)")
    lines += [f"lr         {plan['lr']:.3g} ({plan['lr_note']})", "memory per device:"]
    half_params = mem["master_weights"] > 0
    for key, label in (("weights", "weights (fp16/bf16 matrices)" if half_params else "weights (fp32)"),
                       ("half_weights", "half-precision weight copies"), ("master_weights", "fp32 master weights"),
                       ("gradients", "accumulation buffers (fp32)"),
                       ("micro_gradients", "micro-batch gradients" + (" (half)" if half_params else "")),
                       ("adam_moments", "Adam moments (fp32)"),
                       ("activations", "activations" + (" (recompute)" if plan["recompute"] else "")),
                       ("gathered_weights", "gathered weights (ZeRO-3)"),
                       ("collective_buffers", "collective buckets"), ("update_temporaries", "update temporaries"),
                       ("framework_reserve", "HCCL buffers + workspace"),
                       ("cpu_backend", "CPU backend term (measured)")):
        if mem[key]:
            lines.append(f"  {label:<28} {_gb(mem[key]):>12}")
    lines.append(f"  {'peak (largest set alive)':<28} {_gb(mem['peak']):>12}   of {plan['device_mem_gb']:g} GB usable")
    if "process_peak" in mem:
        lines.append(f"  {'whole process (peak RSS)':<28} {_gb(mem['process_peak']):>12}   per rank: the step peak, the baseline, "
                     "the checkpoint snapshot and the loader maps")
    if "host_bytes" in plan:
        h = plan["host_bytes"]
        lines.append(f"host memory per node ({plan['devices']} rank{'s' if plan['devices'] > 1 else ''}):")
        for key, label in (("model_init", "model initialisation"), ("checkpoint_snapshot", "async checkpoint snapshot"),
                           ("loader_maps", "loader index maps"), ("process_baseline", "process baseline")):
            if h[key]:
                lines.append(f"  {label:<28} {_gb(h[key]):>12}")
        lines.append(f"  {'total':<28} {_gb(h['total']):>12}")
    c = plan["collectives_per_step"]
    if plan["devices"] > 1:
        lines.append(f"collectives {c['calls']:,} per step, {c['bytes'] / GB:,.2f} GB handed to them per step per device")
    if "hccl" in plan:
        hc = plan["hccl"]
        lines.append(f"HCCL_BUFFSIZE {hc['buffsize_mb']} MB: largest collective {hc['largest_collective_bytes'] / 2**20:,.0f} MB "
                     f"on {hc['nodes']} server{'s' if hc['nodes'] > 1 else ''} (`launch` exports it; export it for a raw msrun)")
    if "overlap" in plan:
        o = plan["overlap"]
        per = f" per micro-batch (x{o['per_step']} a step)" if o["per_step"] > 1 else " per step"
        lines.append(f"overlap    gradient reduction {o['comm_s'] * 1e3:,.0f} ms at {o['bus_gbps']:g} GB/s bus bandwidth ({o['bus_source']}) "
                     f"in {len(o['buckets'])} buckets vs backward {o['backward_s'] * 1e3:,.0f} ms{per} "
                     f"(at {o['rate_source']} tokens/s): exposed {o['exposed_s'] * 1e3:,.0f} ms")
    alt = "without" if plan["recompute"] else "with"
    lines.append(f"  (activations {alt} recompute: {_gb(plan['activations_other_bytes'])})")
    lines.append(f"checkpoint {_gb(plan['checkpoint_bytes'])} on disk each")
    if "time" in plan:
        tm = plan["time"]
        lines.append(f"time       {tm['hours']:,.1f} h ({tm['hours'] / 24:,.1f} days) at {tm['tokens_per_s_per_device']:,.0f} tokens/s/device, "
                     f"{tm['device_hours']:,.0f} device-hours" + (f", cost {tm['cost']:,.2f}" if "cost" in tm else ""))
    elif plan["steps"]:
        lines.append("time       — (give --tokens-per-s, measured from a short run: `mspretrain report` shows it)")
    else:
        lines.append("time       — (needs a token budget and --tokens-per-s)")
    if "reference" in plan:
        r = plan["reference"]
        lines.append(f"reference  MindSpore Transformers llama2_7b pretraining: {r['tokens_per_s_per_device']:,.0f} tokens/s/device "
                     f"(seq {r['seq_len']}, {r['devices']} x {r['hardware']})"
                     + (f" -> {r['hours_at_reference']:,.1f} h for this budget" if "hours_at_reference" in r else "")
                     + (f"; your figure is {r['ratio']:.2f}x of it" if "ratio" in r else ""))
        lines.append(f"           source: {r['source']}")
    if "layouts" in plan:
        from mspretrain.ops.layouts import format_layouts

        lines += format_layouts(plan["layouts"])
    for w in plan["warnings"]:
        lines.append(f"WARNING: {w}")
    return "\n".join(lines)
