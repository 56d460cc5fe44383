"""`mspretrain plan`: parameters, memory per device, steps, warm-up, lr, time and cost — before launch.

Design choices:
- Pure arithmetic on the config: no MindSpore import, answers in milliseconds, testable by hand.
- Memory per device (bytes) and the gradient reduction's overlap: preflight/costs.py (`memory_model`,
  `overlap_estimate`), which the layout table (preflight/layouts.py) reads too.
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
from mspretrain.config.schema import Config, ModelConfig, resolve_model
from mspretrain.device import ASCEND_910B_USABLE_GB
from mspretrain.errors import UserError
from mspretrain.model.presets import param_count, param_shapes, preset
from mspretrain.parallel.plan import ParallelPlan
from mspretrain.preflight.costs import (  # noqa: F401  (re-exported: the plan's callers and tests read them here)
    ASCEND_RESERVE_BYTES,
    ASSUMED_BUS_GBPS,
    BACKWARD_SHARE,
    BACKWARD_SHARE_RECOMPUTE,
    CPU_BUCKET_FACTOR,
    CPU_HALF_BYTES_PER_PARAM,
    CPU_RUNTIME_BYTES_PER_PARAM,
    MINDFORMERS_LLAMA2_7B,
    activation_bytes,
    cpu_backend_bytes,
    gathered_bytes,
    memory_model,
    overlap_estimate,
)

GB = 1024**3
LLAMA2_7B_PARAMS = 6_738_415_616  # HF meta-llama/Llama-2-7b-hf


def _param_count(m: ModelConfig) -> int:
    return int(param_count(m))


def preset_model(name: str) -> ModelConfig:
    return preset(name)


# Resident memory of a `mspretrain train` process beside the model's terms: Python, MindSpore's
# libraries and runtime, the tokenizer, TensorBoard, the compiled graphs' fixed parts. Fitted on one
# whole CPU process (benchmarks/memory_bench.py --whole-process 2m,60m: the 1.7 M-parameter run's
# peak RSS, 0.98 GiB, less the plan's other terms, 0.06 GiB) and checked on the other: the 55 M run
# measured 2.76 GiB, planned 2.70 GiB (0.98). Imports and one CPU op alone: 0.41 GiB.
PROCESS_BASELINE_BYTES = 0.92 * GB


def host_memory(m: ModelConfig, cfg: Config, layout: Any, *, devices: int, target: str, tokens: int | None,
                cut: bool = False) -> dict[str, float]:
    """Host bytes per node by kind (see the module docstring); `devices` ranks on the node. `cut`:
    the model is cut on each rank's host (ZeRO-3, tensor or expert parallel: train/build.py `builds_on_host`),
    each weight drawn when the cut reads it (model/decoder.py LazyDraw): one whole fp32 weight per
    rank at a time, as the streamed build."""
    from mspretrain.model.presets import is_half_eligible, param_shapes

    shapes = param_shapes(m)
    sizes = [math.prod(sh) for _, sh in shapes]
    total = sum(sizes)
    trained = trained_elements(m, cfg)
    half = cfg.precision.dtype in ("fp16", "bf16") and cfg.precision.param_dtype == "compute"
    masters = sum(n for (name, _), n in zip(shapes, sizes) if half and is_half_eligible(name))
    out: dict[str, float] = {
        # Ascend: one fp32 parameter per rank on its way to HBM; CPU: the weights are the device's
        # (cut: each weight drawn when the cut reads it, its piece sent on, the whole dropped: the same)
        "model_init": devices * 4 * max(sizes) if target == "ascend" else 0,
        # the saver's host copy: fp32 weights (rank 0) + every rank's moments and masters (fp32)
        "checkpoint_snapshot": (4 * total + 8 * trained + 4 * masters) if cfg.checkpoint.async_save else 0,
        # one int64 per train window per rank (the epoch permutation)
        "loader_maps": devices * 8 * (tokens or 0) // max(cfg.data.seq_len, 1),
        "process_baseline": devices * PROCESS_BASELINE_BYTES,
    }
    out["total"] = sum(out.values())
    return out


def ep_communicators(m: ModelConfig, cfg: Config, layout: Any, *, devices: int, micro: int, per_node: int,
                     target: str) -> list[tuple[str, int, int, int]]:
    """The communicators of an expert-parallel run (parallel/hccl.py `communicators`' form: name,
    largest collective in bytes, its ranks in one server, the servers it spans), from the parallel
    plan's groups (parallel/plan.py: ep groups are consecutive ranks, edp groups strided by ep):
    - the world: the other parameters' buckets (preflight/layouts.py `world_part`);
    - the ep group: per MoE layer the dispatch's AllGather of the packed rows, ep x N x (D + K) in
      the compute dtype, its largest collective (model/expert_parallel.py; the combine's
      ReduceScatter takes ep x N x D); the world's own when ep is the world;
    - the edp group (more than one rank): the experts' gradient bucket's AllReduce."""
    from mspretrain.preflight.layouts import expert_mask, world_part

    ep = cfg.parallel.ep
    edp = devices // ep
    world, experts_bytes = world_part(layout, expert_mask(m, cfg), cfg, target)
    e = 2 if cfg.precision.dtype in ("fp16", "bf16") else 4
    dispatch = ep * micro * cfg.data.seq_len * (m.dim + m.experts_per_token) * e
    nodes = -(-devices // per_node)
    if ep == devices:  # the ep group is the world (plain primitives) and the edp groups are one rank
        return [("world", max(max(world.largest_bucket_bytes()), dispatch), per_node, nodes)]
    ep_nodes = len({r // per_node for r in range(ep)})  # ranks 0..ep-1: the first ep group
    edp_nodes = len({j * ep // per_node for j in range(edp)})  # ranks 0, ep, 2 ep, ...: the first edp group
    return [("world", max(world.largest_bucket_bytes()), per_node, nodes),
            ("ep", dispatch, -(-ep // ep_nodes), ep_nodes),
            ("edp", experts_bytes, -(-edp // edp_nodes), edp_nodes)]


def trained_elements(m: ModelConfig, cfg: Config) -> int:
    """Elements of the trained parameters (train.trainable), whole."""
    from mspretrain.model.groups import trainable_mask

    shapes = param_shapes(m)
    return sum(math.prod(s) for (_, s), k in zip(shapes, trainable_mask([n for n, _ in shapes], cfg.train.trainable,
                                                                          tied=m.tie_embeddings)) if k)


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
    tp = cfg.parallel.tp
    if devices % tp:
        raise UserError(f"parallel.tp = {tp} does not divide --devices {devices}",
                        f"plan a multiple of {tp} devices (devices = tp x data-parallel ranks), or change parallel.tp")
    # the batch is split over the data-parallel ranks: the run's parallel plan (mspretrain/parallel/plan.py),
    # the very one train/build.py builds for these devices
    dp = ParallelPlan.for_config(cfg, world=devices).dp
    # steps, warm-up, lr and the batch split exactly as `train` derives them (memory needs no budget)
    b = budget.derive(cfg, world=dp, data_tokens=manifest_tokens, tokens=tokens)
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
    from mspretrain.preflight.layouts import tp_layout_bytes, tp_local_model, tp_memory

    # under tensor parallel the data-parallel layout is that of one tp rank's pieces over dp ranks
    # (its buckets, traffic and HCCL buffer); the memory is the TP rows' (preflight/layouts.py)
    def memory_of(c: Config) -> tuple[dict[str, float], Any]:
        mem, layout = memory_model(tp_local_model(m, tp), c, devices=dp, micro=micro, accum=accum, zero=zero,
                                   shard_grads=shard_grads, recompute=recompute, flash=flash, target=target, shard_params=shard_params)
        if tp > 1:
            mem, _ = tp_memory(m, c, tp=tp, dp=dp, zero1=zero or shard_grads, micro=micro, accum=accum,
                               recompute=recompute, flash=flash, target=target)
        return mem, layout

    mem, layout = memory_of(cfg)
    # a device size given on the command line wins (it used to be ignored for Ascend configs)
    usable_gb = device_mem_gb or cfg.device.max_device_memory or (
        ASCEND_910B_USABLE_GB if target == "ascend" else round(host_ram_gb() / devices, 1) if target == "cpu" else 64.0)
    calls, wire_bytes = layout.traffic(accum)
    trained = trained_elements(m, cfg)  # whole parameters (under expert parallel the layout holds this rank's experts)
    other = activation_bytes(m, seq, micro, cfg.precision.dtype, not recompute, flash,
                             loss_chunk=cfg.optim.loss_chunk_tokens if target != "cpu" else 0)
    plan: dict[str, Any] = {
        "model": {"dim": m.dim, "n_layers": m.n_layers, "n_heads": m.n_heads, "n_kv_heads": m.n_kv_heads,
                  "ffn_dim": m.ffn_dim, "vocab_size": m.vocab_size, "tie_embeddings": m.tie_embeddings},
        "params": P, "devices": devices, "tp": tp, "dp": dp, "ep": cfg.parallel.ep, "global_batch": gb, "micro_batch": micro, "accumulation": accum,
        "seq_len": seq, "dtype": cfg.precision.dtype, "zero": zero or shard_grads, "shard_gradients": shard_grads and devices > 1,
        "shard_parameters": shard_params and devices > 1,
        "recompute": recompute, "flash_attention": flash,
        "moment_dtype": ("bf16" if target != "cpu" else "bf16 values in fp32") if cfg.optim.moment_dtype == "bf16" else "fp32",
        "tokens": b.tokens, "tokens_source": b.tokens_source, "steps": b.steps, "warmup_steps": b.warmup,
        "warmup_note": b.warmup_note, "lr": b.lr, "lr_note": b.lr_note, "assumed": list(assumed),
        "memory_bytes": mem, "activations_other_bytes": other, "device_mem_gb": usable_gb,
        "collectives_per_step": {"calls": calls, "bytes": wire_bytes},
        "checkpoint_bytes": checkpoint_bytes(P, cfg.precision.dtype if half_params else None, trained=trained),
        "trained_params": trained, "warnings": [],
        "target": target, "target_source": ("device.target" if cfg.device.target != "auto"
                                            else "this machine (device.target = auto)" if target_given(here, cfg) else "assumed"),
    }
    from mspretrain.parallel.hccl import NPUS_PER_SERVER

    per_node = min(devices, nodes_ranks or NPUS_PER_SERVER) if target == "ascend" else devices
    node_count = -(-devices // per_node)
    if target == "ascend" and devices > 1:  # what `launch` exports as HCCL_BUFFSIZE (parallel/hccl.py says why)
        from mspretrain.parallel.hccl import communicators

        # every communicator the run creates, with its largest collective: the world's (ZeRO / DP,
        # or the tp group when it is the world), under tp x dp the tp and the dp groups, under
        # expert parallel the ep and edp groups that are neither the world nor one rank (step/ep.py)
        dp_largest = max(layout.largest_bucket_bytes())
        if cfg.parallel.ep > 1:
            comms = ep_communicators(m, cfg, layout, devices=devices, micro=micro, per_node=per_node, target=target)
        elif tp == 1:
            comms = [("world", dp_largest, per_node, node_count)]
        else:
            tp_largest = tp_layout_bytes(m, cfg, micro)
            comms = [("world", tp_largest if dp == 1 else 0, per_node, node_count)]
            if dp > 1:  # tp groups are consecutive ranks (step/tp.py make_mesh): inside a server
                comms += [("tp", tp_largest, min(tp, per_node), 1), ("dp", dp_largest, max(1, per_node // tp), node_count)]
        hc = communicators(comms)
        plan["hccl"] = {"largest_collective_bytes": max(c["largest_bytes"] for c in hc), "nodes": node_count,
                        "buffsize_mb": hc[0]["buffsize_mb"], "communicators": hc,
                        "hbm_bytes": sum(2 * c["buffsize_mb"] * 2**20 for c in hc)}
    # host memory of one node: its ranks (8 a server on Ascend; all of them on CPU, one host)
    plan["host_ranks"] = per_node
    # the layouts train/build.py `builds_on_host` cuts on the host: ZeRO-3, tensor and expert parallel
    cut = devices > 1 and (shard_params or tp > 1 or cfg.parallel.ep > 1)
    plan["host_bytes"] = host_memory(m, cfg, layout, devices=per_node, target=target, tokens=b.tokens, cut=cut)
    if target == "ascend":
        # start-up on the device: the weights as built there, before any step. A cut model sends only
        # this rank's pieces (train/build.py `builds_on_host`: ZeRO-3 slices, tp pieces, E/ep experts
        # and the rest whole), in fp32: the step rounds its half-precision matrices after it is built
        # (step/step.py); otherwise each weight is streamed to the device whole as it is drawn, the
        # whole fp32 model per rank
        largest = max(math.prod(s) for _, s in param_shapes(m))
        fp32 = cfg if not half_params else replace(cfg, precision=replace(cfg.precision, param_dtype="fp32"))
        built = (mem if fp32 is cfg else memory_of(fp32)[0])["weights"] if cut else 4 * P
        plan["build_bytes"] = {"device": built, "host_per_rank": 4 * largest, "cut": cut}
        if built / GB > usable_gb and cut:
            plan["warnings"].append(f"start-up: this rank's fp32 pieces of the weights ({built / GB:.1f} GB) are more than "
                                    f"{usable_gb:g} GB: cut them over more devices")
        elif built / GB > usable_gb:
            plan["warnings"].append(f"start-up: the fp32 weights ({built / GB:.1f} GB) are built whole on each device before "
                                    f"any cut, more than {usable_gb:g} GB: use optim.shard_parameters=true, parallel.tp"
                                    + (" or parallel.ep" if m.num_experts else "") + ", whose ranks receive only their pieces")
    if target == "cpu":  # the host is the device: the whole process
        h = plan["host_bytes"]
        mem["process_peak"] = (mem["peak"] + h["process_baseline"] + h["checkpoint_snapshot"] + h["loader_maps"]) / devices
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
    from mspretrain.preflight.layouts import MAX_DEVICES

    if 1 < devices <= MAX_DEVICES:  # every layout of these devices, and the cheapest that fits (preflight/layouts.py)
        from mspretrain.preflight.layouts import layout_table

        plan["layouts"] = layout_table(replace(cfg, model=m, train=replace(cfg.train, recompute=recompute)), m, devices=devices,
                                       flash=flash, target=target, usable_gb=usable_gb, bus_gbps=bus_gbps or ASSUMED_BUS_GBPS,
                                       tokens_per_s=tokens_per_s_per_device)
    peak_gb = mem["peak"] / GB
    if peak_gb > usable_gb:
        fixes = [f for f, ok in (("--recompute", not recompute), ("optim.shard_gradients=true", not shard_grads and devices > 1 and accum > 1),
                                 ("--zero", not zero and devices > 1),
                                 ("precision.param_dtype=compute", half and not half_params),
                                 ("a smaller train.micro_batch", micro > 1),
                                 # off the CPU, whose step holds bf16 moments in fp32 and a chunked loss's recomputation
                                 ("optim.moment_dtype=bf16", cfg.optim.moment_dtype == "fp32" and target != "cpu"),
                                 ("optim.loss_chunk_tokens=512", not cfg.optim.loss_chunk_tokens and target != "cpu" and tp == 1
                                  and 8 * seq * micro * m.vocab_size > GB)) if ok]
        table = plan.get("layouts") or {}
        best = table.get("recommended") or table.get("recommended_unmeasured")
        if best:  # the layout its own table recommends, with the settings that select it
            from mspretrain.preflight.layouts import layout_settings

            row = next(r for r in table["rows"] if r["name"] == best)
            which = "recommended" if best == table.get("recommended") else "fastest (memory not yet measured)"
            advice = (f"; the layout table's {which} {best} fits ({row['peak_bytes'] / GB:.1f} GB): "
                      + (" ".join(layout_settings(row)) or "as listed"))
        elif fixes:
            advice = f"; try {', '.join(fixes)} (no layout of the table fits as it stands)" if table else f"; try {', '.join(fixes)}"
        else:
            advice = "; use more devices with model parallelism or a smaller model"
        plan["warnings"].append(f"WILL NOT FIT: peak {peak_gb:.1f} GB per device > {usable_gb:g} GB usable" + advice)
    elif peak_gb > 0.9 * usable_gb:
        plan["warnings"].append(f"tight: peak {peak_gb:.1f} GB of {usable_gb:g} GB usable per device; fragmentation is not in this estimate")
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
        f"x accum {plan['accumulation']} x {plan.get('dp', plan['devices'])}"
        + (f" data-parallel (tensor parallel {plan['tp']})" if plan.get("tp", 1) > 1 else "")
        + (f" data-parallel (expert parallel {plan['ep']})" if plan.get("ep", 1) > 1 else "")
        + f", seq {plan['seq_len']}, {plan['dtype']}"
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
                       ("adam_moments", f"Adam moments ({plan.get('moment_dtype', 'fp32')})"),
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
        ranks = plan.get("host_ranks", plan["devices"])
        lines.append(f"host memory per node ({ranks} rank{'s' if ranks > 1 else ''}):")
        for key, label in (("model_init", "model initialisation"), ("checkpoint_snapshot", "async checkpoint snapshot"),
                           ("loader_maps", "loader index maps"), ("process_baseline", "process baseline")):
            if h[key]:
                lines.append(f"  {label:<28} {_gb(h[key]):>12}")
        lines.append(f"  {'total':<28} {_gb(h['total']):>12}")
    if "build_bytes" in plan:
        bb = plan["build_bytes"]
        lines.append(f"start-up   {_gb(bb['device'])} of weights on each device before the first step"
                     + (" (this rank's pieces: each weight drawn on the host, cut, its piece sent"
                        + ("; under expert parallel its experts, the rest whole)" if plan.get("ep", 1) > 1 else ")") if bb["cut"]
                        else " (each weight streamed whole, fp32)"))
    c = plan["collectives_per_step"]
    if plan["devices"] > 1:
        lines.append(f"collectives {c['calls']:,} per step, {c['bytes'] / GB:,.2f} GB handed to them per step per device")
    if "hccl" in plan:
        hc = plan["hccl"]
        lines.append(f"HCCL_BUFFSIZE {hc['buffsize_mb']} MB: largest collective {hc['largest_collective_bytes'] / 2**20:,.0f} MB "
                     f"on {hc['nodes']} server{'s' if hc['nodes'] > 1 else ''} (`launch` exports it; export it for a raw msrun)")
        comms = hc.get("communicators", [])
        if len(comms) > 1:
            lines.append("  communicators " + ", ".join(f"{c['name']} {c['buffsize_mb']} MB (largest {c['largest_bytes'] / 2**20:,.0f} MB)"
                                                       for c in comms)
                         + f": {hc['hbm_bytes'] / GB:,.2f} GB of HBM outside the pool (2 x the buffer each)")
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
        from mspretrain.preflight.layouts import format_layouts

        lines += format_layouts(plan["layouts"])
    for w in plan["warnings"]:
        lines.append(f"WARNING: {w}")
    return "\n".join(lines)
