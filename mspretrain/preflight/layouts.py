"""`plan`'s layout table: each way of spreading one config over N devices, with its per-device memory
and step time, and the cheapest layout that fits.

Layouts (for 2 to `MAX_DEVICES` devices): plain data parallel (DP), ZeRO-1, ZeRO-2 and ZeRO-3
over all N devices (what `train` runs: optim.shard_optimizer / shard_gradients / shard_parameters);
tensor parallel t x data parallel N/t for t = 2, 4, 8 (t dividing N), plain and with ZeRO-1 over
the data-parallel group (`train` runs them: parallel.tp, step/tp.py); for a mixture of experts,
expert parallel ep x expert-data-parallel N/ep for every ep > 1 dividing the experts and N, plain
and with ZeRO-1 or ZeRO-2 over the other parameters (parallel.ep, step/ep.py; ZeRO-2 shards their
accumulation buffers, which only matters with gradient accumulation). The Adam moments' dtype is
the config's (optim.moment_dtype: `plan ... optim.moment_dtype=bf16` asks "what if"). The TP rows' memory is
Megatron's accounting, not yet checked against a TP step's measured buffers, so the recommendation
is taken among the measured layouts and a faster TP layout that fits is named beside it.

Memory:
- DP and ZeRO rows: `preflight/costs.memory_model`, the buffers step/step.py allocates (checked against
  real TrainSteps in tests/step/test_zero2.py and tests/step/test_zero3.py).
- TP rows: Megatron's accounting (Shoeybi et al. 2019, "Megatron-LM"; Korthikanti et al. 2022 for
  the activations), in `memory_model`'s terms and phases: column-parallel (wqkv, its q/k/v bias,
  w13) and row-parallel (wo, w2) weights, their gradients, fp32 masters and Adam moments are split
  by t; the embedding and lm_head by the vocabulary (a vocabulary-parallel loss, so the fp32 logits
  are split too); RMSNorm and QK-norm weights replicated. Activations per layer
  e*s*b*(4h + (2h + 2kv + 4f)/t) + attention/t: the attention and MLP inner tensors (q, k, v, the
  attention output, the scores, the MLP's four f-wide tensors) are split, the residual stream and
  the two norms' inputs and outputs (4h) replicated (no sequence parallel). ZeRO-1 divides the
  moments and masters by the data-parallel size too. t must divide the query heads, the KV heads
  (GQA heads are not replicated), ffn_dim and the vocabulary; other t are not listed.
Step time = compute + the communication that is not hidden, at the plan's bus bandwidth (`--bus-gbps`,
else `ASSUMED_BUS_GBPS`); ring costs: AllReduce 2(n-1)/n x bytes, AllGather / ReduceScatter (n-1)/n.
- Compute: the step's tokens x PaLM's FLOPs per token (monitor/mfu.py) / (N x the FLOP/s one device
  achieves), x 4/3 with recompute (the forward runs twice). The achieved FLOP/s: --tokens-per-s for
  this model, else MindSpore Transformers' published llama2_7b rate on 910B (4,100 tokens/s/device
  at seq 4096) x its FLOPs per token: the same MFU assumed for every model and layout, so the
  times compare layouts, they do not promise a wall clock.
- DP, ZeRO-1/2: the gradient reduction as the plan's overlap estimate (`overlap_estimate`: hidden
  behind the backward pass as far as the buckets allow); ZeRO-1/2 also the parameter AllGather
  after the update (exposed).
- ZeRO-3: per micro-batch an AllGather of every trained weight forward, a ReduceScatter of every
  gradient backward, and with recompute the recomputation's AllGather again; exposed as far as the
  compute does not hide them (`preflight/costs.zero3_exposed_s`): with the prefetch (model/block.py)
  the next layer's gathers run during a layer's forward and a layer's reduce-scatters during the
  previous layer's backward, so the first layer's gathers, the last reduce-scatters and the
  recomputation's gathers are what stays exposed (the CPU with recompute has no prefetch: all).
- EP: the experts' FLOPs counted ep times (each rank runs its experts on the whole ep group's
  assignments, the others' masked: `expert_flops_share`); the other parameters' gradient reduction
  over the world as DP / ZeRO-1 (`world_part`), the experts' bucket AllReduced over the edp group
  (exposed), and the dispatch and combine collectives of every MoE layer (`ep_comm_s`, exposed).
  Memory: `memory_model` with `ep` (the EP step's buffers: tests/preflight/test_plan_moe.py).
- TP: per layer and micro-batch 2 AllReduces forward and 2 backward of b*s*h elements in the
  compute dtype over the t ranks (Megatron paper, section 3), 2 more with recompute, exposed (they
  sit between the matmuls); plus the data-parallel gradient AllReduce of 1/t of the gradients over
  N/t ranks, hidden behind the backward pass up to its length (max(0, comm - backward): cruder
  than the buckets' estimate), once per step with accumulation; ZeRO-1 adds its AllGather.
A layout runs without recompute if that fits, else with it; the recommended layout is the shortest
step of those that fit whose memory model was measured (then the least memory); a faster TP
layout that fits is named beside it.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from mspretrain import budget
from mspretrain.config.schema import Config, ModelConfig
from mspretrain.errors import UserError

GB = 1024**3
TP_SIZES = (2, 4, 8)
# Tabulated up to this many devices: each row builds the step's owner tables (parallel/layout.py), whose
# cost grows with the world (about 5 s a row at 4,096 devices); a node to a few nodes is the question.
MAX_DEVICES = 64


def achieved_flops(m: ModelConfig, seq: int, tokens_per_s: float | None) -> tuple[float, str]:
    """FLOP/s one device achieves (see the module docstring) and where the figure comes from."""
    from mspretrain.model.presets import llama2_7b
    from mspretrain.monitor.mfu import flops_per_token
    from mspretrain.preflight.costs import MINDFORMERS_LLAMA2_7B

    if tokens_per_s:
        return tokens_per_s * flops_per_token(m, seq), "the given tokens/s"
    ref = MINDFORMERS_LLAMA2_7B
    return (ref["tokens_per_s_per_device"] * flops_per_token(llama2_7b(), int(ref["seq_len"])),
            "MindSpore Transformers' llama2_7b FLOP/s on 910B, assumed for this model")


def _ring(op: str, n: int) -> float:
    return 2 * (n - 1) / n if op == "AllReduce" else (n - 1) / n


def tp_memory(m: ModelConfig, cfg: Config, *, tp: int, dp: int, zero1: bool, micro: int, accum: int,
              recompute: bool, flash: bool, target: str) -> tuple[dict[str, float], int]:
    """Bytes per device of tensor parallel `tp` x data parallel `dp` (the module docstring), in
    `memory_model`'s keys, with `peak`; and the trained elements one device holds (its gradients)."""
    from mspretrain.model.groups import trainable_mask
    from mspretrain.model.params import tp_split
    from mspretrain.model.presets import is_half_eligible, param_shapes
    from mspretrain.parallel.layout import bucket_mb_for
    from mspretrain.preflight.costs import ASCEND_RESERVE_BYTES, moment_bytes, update_bytes

    shapes = param_shapes(m)
    trained = trainable_mask([n for n, _ in shapes], cfg.train.trainable, tied=m.tie_embeddings)
    half = cfg.precision.dtype in ("fp16", "bf16")
    half_params = half and cfg.precision.param_dtype == "compute"
    e = 2 if half else 4
    # elements on one device: the replicated (and partial) roles whole, the others split by tp (ceil:
    # padding), as model/params.py's role column says
    local = [(name, -(-math.prod(s) // tp) if tp_split(name) else math.prod(s)) for name, s in shapes]
    pbytes = {name: 2 if half_params and is_half_eligible(name) else 4 for name, _ in shapes}
    share = dp if zero1 else 1  # ZeRO-1: moments and masters over the data-parallel group too
    tr = [(name, n) for (name, n), k in zip(local, trained) if k]
    s, b, h, f, a = cfg.data.seq_len, micro, m.dim, m.ffn_dim, m.n_heads
    kv = m.n_kv_heads * m.head_size
    q = m.n_heads * m.head_size
    attention = 64 * a * s * b if flash else (4 if e == 4 else 4 + e) * a * s * s * b
    per_layer = e * s * b * (4 * h + (2 * q + 2 * kv + 4 * f) / tp) + attention / tp
    logits = 8 * s * b * m.vocab_size / tp
    acts = (m.n_layers * e * s * b * h + per_layer if recompute else m.n_layers * per_layer) + logits
    bucket = bucket_mb_for(cfg.optim.bucket_mb, target) * 2**20  # a bucket's bytes
    mem: dict[str, float] = {
        "weights": sum(n * pbytes[name] for name, n in local),
        "half_weights": sum(2 * n for name, n in local if is_half_eligible(name)) if half and not half_params else 0,
        "master_weights": sum(4 * n for name, n in tr if pbytes[name] == 2) / share,
        "gradients": sum(4 * n for _, n in tr) if accum > 1 else 0,
        "micro_gradients": sum(n * pbytes[name] for name, n in tr),
        "adam_moments": sum(moment_bytes(cfg, target) * n for _, n in tr) / share,
        "activations": acts,
        "gathered_weights": 0,
        # the data-parallel bucket (flat copy and result) or the TP AllReduce of one b*s*h activation
        "collective_buffers": max(2 * min(bucket, max(4 * n for _, n in tr)) if dp > 1 else 0, 2 * e * s * b * h),
        "update_temporaries": update_bytes(cfg) * max(n for _, n in tr),
        "framework_reserve": ASCEND_RESERVE_BYTES if target == "ascend" else 0,
        "cpu_backend": 0,
    }
    persistent = sum(mem[k] for k in ("weights", "half_weights", "master_weights", "gradients", "adam_moments"))
    accumulate = mem["activations"] + mem["micro_gradients"]
    update = mem["collective_buffers"] + mem["update_temporaries"] + (mem["micro_gradients"] if accum == 1 else 0)
    mem["total"] = sum(mem.values())
    mem["peak"] = persistent + max(accumulate, update) + mem["framework_reserve"]
    return mem, sum(n for _, n in tr)


def tp_layout_bytes(m: ModelConfig, cfg: Config, micro: int) -> int:
    """The largest collective of a tp group: the all-reduce of one (micro, seq, dim) activation in
    the compute dtype (model/parallel.py ReduceFromTP / CopyToTP); the loss's are (micro, seq) fp32."""
    e = 2 if cfg.precision.dtype in ("fp16", "bf16") else 4
    return e * micro * cfg.data.seq_len * m.dim


def tp_local_model(m: ModelConfig, tp: int) -> ModelConfig:
    """The shape of one tp rank's piece (model/parallel.py `split_model`): its parameters are the
    pieces of the whole model's (the heads, ffn units and vocabulary over tp; the norms whole)."""
    if tp == 1:
        return m
    return replace(m, n_heads=m.n_heads // tp, n_kv_heads=m.n_kv_heads // tp, ffn_dim=m.ffn_dim // tp,
                   vocab_size=m.vocab_size // tp, head_dim=m.head_size)


def layout_settings(row: dict[str, Any]) -> list[str]:
    """The config overrides that make `train` run the layout of a table row."""
    out = [f"parallel.tp={row['tp']}"] if row["tp"] > 1 else []
    out += [f"parallel.ep={row['ep']}"] if row.get("ep", 1) > 1 else []
    out += [key + "=true" for key, z in (("optim.shard_optimizer", 1), ("optim.shard_gradients", 2),
                                         ("optim.shard_parameters", 3)) if row["zero"] >= z]
    return out + (["train.recompute=true"] if row.get("recompute") else [])


def layout_config(cfg: Config, row: dict[str, Any]) -> Config:
    """`cfg` set to run the layout of a table row (what `layout_settings` says)."""
    z = row["zero"]
    return replace(cfg, parallel=replace(cfg.parallel, tp=row["tp"], ep=row.get("ep", 1)),
                   optim=replace(cfg.optim, shard_optimizer=z >= 1, shard_gradients=z >= 2, shard_parameters=z == 3),
                   train=replace(cfg.train, recompute=bool(row.get("recompute", cfg.train.recompute))))


def train_refusal(cfg: Config, m: ModelConfig, row: dict[str, Any]) -> str | None:
    """Why `train` would refuse the layout of `row` for `cfg` (its own checks: config.check_parallel,
    model/parallel.py `check_tp`, the batch split over the data-parallel ranks, step/zero3.py
    `sharded_names`, config.check_moe: an MoE model on whole replicas only, for now), or None. A
    layout it refuses is never in the table."""
    from dataclasses import replace

    from mspretrain.config.schema import check_moe, check_parallel
    from mspretrain.model.groups import trainable_mask
    from mspretrain.model.presets import param_shapes
    from mspretrain.parallel.layout import zero3_refusal
    from mspretrain.parallel.plan import tp_refusal

    c = layout_config(cfg, row)
    try:
        check_parallel(c)
        check_moe(replace(c, model=m))
        budget.micro_batches(c, row["dp"])
    except UserError as exc:
        return exc.cause
    refused = tp_refusal(m.n_heads, m.n_kv_heads, m.ffn_dim, m.vocab_size, row["tp"])
    world = row["tp"] * row["dp"]
    if refused is None and row["zero"] == 3 and world > 1:
        shapes = param_shapes(m)
        trained = trainable_mask([n for n, _ in shapes], cfg.train.trainable, tied=m.tie_embeddings)
        refused = zero3_refusal({n: math.prod(s) for (n, s), k in zip(shapes, trained) if k}, world)
    return refused[0] if refused else None


def _row(name: str, tp: int, dp: int, zero: int, unmeasured: bool, ep: int = 1) -> dict[str, Any]:
    return {"name": name, "tp": tp, "dp": dp, "zero": zero, "unmeasured": unmeasured, "ep": ep}


def ep_sizes(m: ModelConfig, devices: int) -> list[int]:
    """The expert-parallel sizes of the table: ep > 1 dividing the experts and the (data-parallel) devices."""
    return [ep for ep in range(2, devices + 1) if m.num_experts and m.num_experts % ep == 0 and devices % ep == 0]


def ep_comm_s(m: ModelConfig, cfg: Config, *, ep: int, micro: int, accum: int, recompute: bool, target: str,
              bus_bytes_per_s: float) -> float:
    """Seconds of the dispatch and combine collectives of one step under expert parallel `ep`
    (model/expert_parallel.py, per MoE layer and micro-batch of N tokens a rank): forward the
    AllGather of the packed rows (N, D + K) and of the expert ids (N, K) int32 and the combine's
    ReduceScatter of (ep*N, D); backward a ReduceScatter of the rows' gradient and an AllGather of
    the combine's; with recompute the forward's again. Each moves (ep-1)/ep of its ep*N-row
    buffer; exposed (the experts wait for the dispatch, the next layer for the combine). The
    CPU forms (AllReduce of zero-padded buffers) move ep times the bytes."""
    e = 2 if cfg.precision.dtype in ("fp16", "bf16") else 4
    N, D, K = micro * cfg.data.seq_len, m.dim, m.experts_per_token
    layers = sum(m.is_moe_layer(i) for i in range(m.n_layers))
    forward = (ep - 1) * N * ((D + K) * e + 4 * K + D * e)
    backward = (ep - 1) * N * ((D + K) * e + D * e)
    return accum * layers * (forward * (2 if recompute else 1) + backward) * (ep if target == "cpu" else 1) / bus_bytes_per_s


def expert_mask(m: ModelConfig, cfg: Config) -> list[bool]:
    """Per trained parameter (the layout's order): an expert stack (model/params.py `expert_parallel`)."""
    from mspretrain.model.groups import trainable_mask
    from mspretrain.model.params import expert_parallel
    from mspretrain.model.presets import param_shapes

    names = [n for n, _ in param_shapes(m)]
    trained = trainable_mask(names, cfg.train.trainable, tied=m.tie_embeddings)
    return [expert_parallel(n, m) for n, k in zip(names, trained) if k]


def world_part(layout: Any, experts: list[bool], cfg: Config, target: str) -> tuple[Any, int]:
    """Under expert parallel: the data-parallel world's layout of the other parameters (what
    `overlap_estimate` and ZeRO-1's gather time), and the bytes of the experts' own bucket."""
    from mspretrain.parallel.layout import bucket_mb_for, cap_elements, plan_layout, split_elements_for

    keep = [j for j, x in enumerate(experts) if not x]
    cap = cap_elements(bucket_mb_for(cfg.optim.bucket_mb, target))
    part = plan_layout([layout.sizes[j] for j in keep], [layout.half[j] for j in keep], [layout.wire16[j] for j in keep],
                       layout.world, shard=layout.sharded, shard_grads=layout.shard_grads, cap=cap,
                       split=split_elements_for(cfg.optim.split_mb, cap))
    return part, sum(n * (2 if w else 4) for n, w, x in zip(layout.sizes, layout.wire16, experts) if x)


def expert_flops_share(m: ModelConfig, seq: int, trainable: Any = None) -> float:
    """The routed experts' share of the FLOPs per token (monitor/mfu.py's count: K of E experts)."""
    from mspretrain.model.params import expert_parallel
    from mspretrain.model.presets import param_shapes
    from mspretrain.monitor.mfu import flops_per_token

    routed = sum(math.prod(s[1:]) for n, s in param_shapes(m) if expert_parallel(n, m)) * m.experts_per_token
    return 6.0 * routed / flops_per_token(m, seq, trainable) if routed else 0.0


def layout_table(cfg: Config, m: ModelConfig, *, devices: int, flash: bool, target: str, usable_gb: float,
                 bus_gbps: float, tokens_per_s: float | None) -> dict[str, Any]:
    """Every layout's row (memory, time, whether it fits) and the recommended one (its name or None)."""
    from mspretrain.preflight.costs import BACKWARD_SHARE, BACKWARD_SHARE_RECOMPUTE, memory_model, overlap_estimate, zero3_exposed_s, zero3_units_of

    flops, rate_source = achieved_flops(m, cfg.data.seq_len, tokens_per_s)
    from mspretrain.monitor.mfu import flops_per_token

    step_flops = budget.tokens_per_step(cfg) * flops_per_token(m, cfg.data.seq_len, cfg.train.trainable)
    # the chunked loss (optim.loss_chunk_tokens) runs the head's matmul again in the backward: 2*D*V a token
    head_factor = 1 + (2 * m.dim * m.vocab_size / flops_per_token(m, cfg.data.seq_len, cfg.train.trainable)
                       if cfg.optim.loss_chunk_tokens else 0)
    bw = bus_gbps * 1e9
    e = 2 if cfg.precision.dtype in ("fp16", "bf16") else 4
    candidates = [_row("DP", 1, devices, 0, False), _row("ZeRO-1", 1, devices, 1, False), _row("ZeRO-2", 1, devices, 2, False),
                  _row("ZeRO-3", 1, devices, 3, False)]
    for ep in ep_sizes(m, devices):  # expert parallel (parallel.ep): ep groups x expert-data-parallel groups
        name = f"EP{ep}" + (f" x EDP{devices // ep}" if devices > ep else "")
        candidates += [_row(name, 1, devices, 0, False, ep), _row(f"{name} ZeRO-1", 1, devices, 1, False, ep),
                       _row(f"{name} ZeRO-2", 1, devices, 2, False, ep)]
    for t in TP_SIZES:
        if t <= devices and devices % t == 0:
            candidates += [_row(f"TP{t} x DP{devices // t}", t, devices // t, 0, True),
                           _row(f"TP{t} x DP{devices // t} ZeRO-1", t, devices // t, 1, True)]
    rows = []
    for row in candidates:
        if row["zero"] == 1 and row["dp"] == 1:
            rows.append({**row, "skipped": "one data-parallel rank: nothing to shard"})
            continue
        if why := train_refusal(cfg, m, row):  # `train` would refuse it: never recommended
            rows.append({**row, "skipped": why})
            continue
        micro, accum = budget.micro_batches(cfg, row["dp"])
        ep = row["ep"]
        # the AllGather form of the dispatch: each rank runs its experts on the whole ep group's
        # assignments (the others' masked), ep times an AllToAll's expert FLOPs (model/expert_parallel.py)
        ep_factor = 1 + (ep - 1) * expert_flops_share(m, cfg.data.seq_len, cfg.train.trainable)
        for recompute in ((False, True) if not cfg.train.recompute else (True,)):
            compute_s = step_flops / (devices * flops) * (4 / 3 if recompute else 1) * ep_factor * head_factor
            backward_s = compute_s * (BACKWARD_SHARE_RECOMPUTE if recompute else BACKWARD_SHARE) / accum
            if row["tp"] == 1:
                z = row["zero"]
                mem, layout = memory_model(m, cfg, devices=devices, micro=micro, accum=accum, zero=z >= 1, shard_grads=z >= 2,
                                           recompute=recompute, flash=flash, target=target, shard_params=z == 3, ep=ep)
                experts_bytes = 0
                if ep > 1:  # the world's buckets without the expert stacks; theirs is reduced over the edp group
                    layout, experts_bytes = world_part(layout, expert_mask(m, cfg), cfg, target)
                pbytes = sum(n * (2 if layout.half[i] else 4) for i, n in enumerate(layout.sizes))
                if z == 3:  # what the compute does not hide of the gathers and reduce-scatters (costs.py)
                    comm = accum * zero3_exposed_s(zero3_units_of(m, cfg), devices=devices, bus_bytes_per_s=bw,
                                                   forward_s=compute_s / accum - backward_s, backward_s=backward_s,
                                                   recompute=recompute, prefetch=target != "cpu")
                else:
                    est = overlap_estimate(layout, backward_s=backward_s, bus_bytes_per_s=bw)
                    comm = (est["comm_s"] if accum > 1 and not layout.shard_grads
                            else est["exposed_s"] * (accum if layout.shard_grads else 1))
                    comm += _ring("AllGather", devices) * pbytes / bw if z >= 1 else 0
                if ep > 1:  # the experts' bucket over the edp group after the backward pass, and the dispatch
                    edp = devices // ep
                    comm += _ring("AllReduce", edp) * experts_bytes / bw if edp > 1 else 0.0
                    comm += ep_comm_s(m, cfg, ep=ep, micro=micro, accum=accum, recompute=recompute, target=target,
                                      bus_bytes_per_s=bw)
            else:
                t, d = row["tp"], row["dp"]
                mem, grads = tp_memory(m, cfg, tp=t, dp=d, zero1=row["zero"] == 1, micro=micro, accum=accum,
                                       recompute=recompute, flash=flash, target=target)
                act = (6 if recompute else 4) * m.n_layers * accum * _ring("AllReduce", t) * e * cfg.data.seq_len * micro * m.dim / bw
                wire = 2 if cfg.precision.allreduce_dtype == "fp16" else 4
                dpc = _ring("AllReduce", d) * wire * grads / bw if d > 1 else 0.0
                comm = act + (dpc if accum > 1 else max(0.0, dpc - backward_s))
                comm += _ring("AllGather", d) * mem["weights"] / bw if row["zero"] == 1 and d > 1 else 0
            peak = mem["peak"]
            fits = peak / GB <= usable_gb
            if fits or recompute:  # the first that fits, else the last (with recompute)
                rows.append({**row, "recompute": recompute, "micro_batch": micro, "accumulation": accum, "peak_bytes": peak,
                             "memory_bytes": mem, "compute_s": compute_s, "comm_s": comm, "step_s": compute_s + comm, "fits": fits})
                break
    cheapest = lambda rs: min(rs, key=lambda r: (r["step_s"], r["peak_bytes"]))["name"] if rs else None
    fitting = [r for r in rows if r.get("fits")]
    best = cheapest([r for r in fitting if not r["unmeasured"]])  # a memory model checked against a measurement
    overall = cheapest(fitting)
    return {"rows": rows, "recommended": best, "recommended_unmeasured": overall if overall != best else None,
            "rate_source": rate_source, "bus_gbps": bus_gbps, "usable_gb": usable_gb}


def format_layouts(table: dict[str, Any]) -> list[str]:
    """The table as `plan` prints it."""
    lines = [f"layouts    per device, {table['usable_gb']:g} GB usable; step time at {table['bus_gbps']:g} GB/s bus bandwidth "
             f"and {table['rate_source']}:",
             f"  {'layout':<22} {'recompute':>9} {'micro x acc':>11} {'mem GB':>8} {'compute s':>9} {'comm s':>8} {'step s':>8}  fits"]
    for r in table["rows"]:
        if "skipped" in r:
            lines.append(f"  {r['name']:<22} not possible: {r['skipped']}")
            continue
        mark = " <- recommended" if r["name"] == table["recommended"] else ""
        lines.append(f"  {r['name']:<22} {'yes' if r['recompute'] else 'no':>9} {r['micro_batch']:>5} x {r['accumulation']:<3}"
                     f" {r['peak_bytes'] / GB:>8.1f} {r['compute_s']:>9.2f} {r['comm_s']:>8.2f} {r['step_s']:>8.2f}  "
                     f"{'yes' if r['fits'] else 'NO'}{' (TP: its memory not yet measured)' if r['unmeasured'] else ''}{mark}")
    if table["recommended"] is None:
        lines.append("  no layout with a measured memory model fits: more devices, a smaller micro-batch, or a smaller model")
    else:
        lines.append(f"  recommended: {table['recommended']} (the shortest step of those that fit, memory measured)")
    if table["recommended_unmeasured"]:
        lines.append(f"  faster, memory not yet measured: {table['recommended_unmeasured']} (tensor parallel, parallel.tp)")
    return lines
