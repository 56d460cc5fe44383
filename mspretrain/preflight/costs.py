"""The per-device memory and time model that `plan` (preflight/plan.py) and its layout table
(preflight/layouts.py) share: pure arithmetic on the config and the step's own tables (parallel/layout.py),
no MindSpore import.

- Memory per device (bytes) is `memory_model`: the buffers step/step.py allocates, counted from the
  model's real parameter list, owners and buckets (parallel/layout.py), for the most loaded rank, and
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
    Adam moments     8 bytes per owned parameter (a split parameter: per element of the slice);
                     4 with optim.moment_dtype = "bf16" (2 + 2: step/state_codec.py's bf16
                     Parameters on an NPU; on CPU they stay fp32 Parameters holding bf16 values, so
                     a CPU target counts 8)
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
                     log-probabilities: 8*s*b*V; with optim.loss_chunk_tokens = c (not on a CPU
                     target: `logit_tokens`) 8*c*V and the head's fp32 input 4*s*b*h.
                     An MoE layer (model/moe.py) in place of the dense MLP's 4f: per assignment its
                     rank's experts run (A = ep*s*b*K: under expert parallel's AllGather dispatch,
                     model/expert_parallel.py, every rank runs its experts on the ep group's tokens,
                     the others' assignments masked) the permuted rows and the unpermuted output
                     (2h) and the SwiGLU's gate, up, silu and product (4 x moe_ffn_dim), what their
                     backward reads: e*A*(2h + 4F); the dispatch buffers (packed rows and weights,
                     the combine's input: e*ep*s*b*(2h + K)) and the gathered expert ids (4*ep*s*b*K)
                     with ep > 1; the router's fp32 probabilities (8*s*b*E); a shared expert's SwiGLU.
    expert parallel  parallel.ep: each rank holds E/ep experts of every expert stack, as the step
                     does (step/ep.py); under ZeRO-1 their state stays whole on each rank (owner
                     LOCAL, parallel/layout.py), the other parameters' is sharded over the world.
                     Their gradients leave the world's buckets for one of their own: a flat copy of
                     all of them (and the edp AllReduce's result with more than one rank there).
    collective buckets  the largest bucket's flat copy and its result; on CPU (world > 1) a measured
                        6.2 x the largest bucket (CPU_BUCKET_FACTOR), with buckets of 32 MB there
                        (optim.bucket_mb = "auto": 256 MB on Ascend, 32 MB on CPU)
    update temporaries  8 bytes x the largest owned parameter or slice (scaled gradient, masked copy);
                        with bf16 moments 12 more (the fp32 moments read from bf16 and the update
                        before it is applied: step/update.py `_adamw_rounded`; not measured on a 910B)
    HCCL + workspace    Ascend: 1 GiB of kernel workspace and HCCL's communication buffers
                        (HCCL_BUFFSIZE, 200 MB per communicator by default; assumed, not measured).
                        JSON key `framework_reserve` (kept for scripts that read it)
- HCCL_BUFFSIZE (Ascend, devices > 1; JSON `hccl`): the buffer that holds the step's largest
  collective (parallel/hccl.py `buffsize_mb`), which `launch` exports; not added to the memory above.
    CPU backend         device.target = cpu only: resident memory MindSpore 2.10's CPU backend holds
                        outside the tensors above, from the first call of each compiled graph on
                        (measured, docs/benchmarks/memory.md runs 3 and 4): a per-parameter runtime
                        term fitted on the fp32 run and, with fp16 compute, a per-half-matrix term
                        fitted on the fp16 run (10m -> 120m each; the 60 M midpoint, 256 M and
                        the other modes, 2 workers sharded included, are checked out of sample)
- ZeRO-3's communication time (`zero3_exposed_s`): which gathers and reduce-scatters the compute
  hides, from the order the model's graph gives them (step/zero3.py, model/block.py).
"""
from __future__ import annotations

import math
from typing import Any, Sequence

from mspretrain.config.schema import Config, ModelConfig, resolve_model

GB = 1024**3
# MindSpore Transformers' published llama2_7b pretraining throughput (seq 4096, wikitext-2, 8 devices):
# 4,100 tokens/s/p on Atlas 900 A2 PoDc (910B) — docs/model_cards/llama2.md ("模型性能") of
# mindspore-lab/mindformers; the same table lists 4,160 tokens/s/p for pretrain_llama2_7b_bf16.yaml
# on Atlas 800T A2.
MINDFORMERS_LLAMA2_7B = {
    "tokens_per_s_per_device": 4100.0, "seq_len": 4096, "devices": 8, "hardware": "Atlas 900 A2 PoDc (Ascend 910B)",
    "source": "MindSpore Transformers docs/model_cards/llama2.md, model performance table: llama2_7b pretrain, wiki, seq 4096, 4100 tks/s/p",
}


def moe_mlp_activation_bytes(m: ModelConfig, tokens: int, e: int, ep: int = 1) -> int:
    """What one MoE layer's MLP keeps for its backward, for `tokens` tokens of one rank (see the
    module docstring's MoE terms): the routed experts' rows, the ep group's dispatch buffers, the
    router's fp32 probabilities and a shared expert's SwiGLU."""
    D, F, K, E = m.dim, m.expert_ffn, m.experts_per_token, m.num_experts
    A = ep * tokens * K  # assignments this rank's local experts run on (every rank sees the ep group's tokens)
    routed = e * A * (2 * D + 4 * F)
    dispatch = e * ep * tokens * (2 * D + K) + 4 * ep * tokens * K if ep > 1 else 0
    return routed + dispatch + 2 * 4 * tokens * E + e * tokens * 4 * m.shared_expert_ffn_dim


def logit_tokens(tokens: int, loss_chunk: int) -> int:
    """Tokens whose fp32 logits (and their gradient) are alive at once: a chunk's with the chunked
    loss (model/loss.py `ChunkedNLL`, each chunk recomputed in the backward), else the micro-batch's.
    Not measured on a 910B. On MindSpore 2.10's CPU backend the chunked step holds more, not less
    (benchmarks/chunked_loss_memory.py: 1.15 x the unchunked step's first-call growth at V 65,536,
    2 x 1,024 tokens, chunk 256; the CPU keeps a graph's intermediates resident), so a CPU target
    plans the whole micro-batch's."""
    return min(loss_chunk, tokens) if loss_chunk > 0 else tokens


def moment_bytes(cfg: Config, target: str) -> int:
    """Bytes of Adam moments per owned element (optim.moment_dtype): fp32 m and v, or bf16 ones,
    which the CPU holds in fp32 Parameters (step/state_codec.py: its Assign has no bf16 kernel)."""
    return 4 if cfg.optim.moment_dtype == "bf16" and target != "cpu" else 8


def update_bytes(cfg: Config) -> int:
    """The update's temporaries per element of the largest owned tensor: the scaled gradient and its
    masked copy; bf16 moments add their fp32 reads and the update (step/update.py `_adamw_rounded`)."""
    return 8 + (12 if cfg.optim.moment_dtype == "bf16" else 0)


def activation_bytes(m: ModelConfig, seq_len: int, micro_batch: int, dtype: str, recompute: bool,
                     flash: bool = False, ep: int = 1, loss_chunk: int = 0) -> int:
    """Activation memory of one micro-batch on one device (see the module docstring); an MoE
    layer's MLP is `moe_mlp_activation_bytes` (under expert parallel `ep`) in place of 4f.
    `loss_chunk` (optim.loss_chunk_tokens; pass 0 for a CPU target, see `logit_tokens`): the fp32
    logits of that many tokens at once, plus the head's fp32 input the chunks are recomputed from."""
    m = resolve_model(m)
    e = 4 if dtype == "fp32" else 2
    s, b, h, f, a = seq_len, micro_batch, m.dim, m.ffn_dim, m.n_heads
    kv = m.n_kv_heads * m.head_size
    attention = 64 * a * s * b if flash else (4 if e == 4 else 4 + e) * a * s * s * b
    dense = e * s * b * (6 * h + 2 * kv + 4 * f) + attention
    moe = e * s * b * (6 * h + 2 * kv) + attention + moe_mlp_activation_bytes(m, s * b, e, ep) if m.num_experts else 0
    layers = [moe if m.is_moe_layer(i) else dense for i in range(m.n_layers)]
    logits = 8 * logit_tokens(s * b, loss_chunk) * m.vocab_size + (4 * s * b * h if 0 < loss_chunk < s * b else 0)
    if recompute:
        return m.n_layers * e * s * b * h + max(layers) + logits
    return sum(layers) + logits



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
#    tests/preflight/test_plan_backend.py keeps it that way.
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
                 recompute: bool, flash: bool, target: str, shard_params: bool = False,
                 ep: int | None = None) -> tuple[dict[str, float], Any]:
    """Bytes per device by kind, for the most loaded rank, plus `peak`: the largest set alive at once.

    Exactly the buffers step/step.py allocates (tests/step/test_zero2.py checks them against a real
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
    ZeRO-3 (`shard_params`, step/zero3.py): the trained weights, their micro-batch gradients,
    masters (half ones only: an fp32 slice is its own), moments and buffers are rank 0's slices
    (the largest); `gathered_weights` is what the gathers hold during a micro-batch
    (`gathered_bytes`); the collective buffers are the largest parameter's."""
    from mspretrain.model.groups import trainable_mask
    from mspretrain.model.params import expert_parallel, fp16_wire
    from mspretrain.model.presets import is_half_eligible, param_shapes
    from mspretrain.parallel.layout import bucket_mb_for, cap_elements, plan_layout, split_elements_for, zero3_layout

    shapes = param_shapes(m)
    # expert parallel (parallel.ep): each rank holds E/ep experts of every expert stack
    # (model/moe.py `apply_ep`): the step's sizes are those pieces (step/step.py `full_size`)
    ep = cfg.parallel.ep if ep is None else ep
    expert = [ep > 1 and expert_parallel(n, m) for n, _ in shapes]
    sizes = [math.prod(s) // (ep if x else 1) for (_, s), x in zip(shapes, expert)]
    half = cfg.precision.dtype in ("fp16", "bf16")
    half_params = half and cfg.precision.param_dtype == "compute"
    is_half = [half_params and is_half_eligible(n) for n, _ in shapes]
    wire16 = [cfg.precision.allreduce_dtype == "fp16" and fp16_wire(n) for n, _ in shapes]
    # train.trainable: the step keeps optimizer state, gradients and buckets for the trained
    # parameters only (T); frozen ones are weights and nothing else. Indices below are into all.
    T = [i for i, k in enumerate(trainable_mask([n for n, _ in shapes], cfg.train.trainable, tied=m.tie_embeddings)) if k]
    cap = cap_elements(bucket_mb_for(cfg.optim.bucket_mb, target))
    zero3 = shard_params and devices > 1
    if zero3:
        layout = zero3_layout([sizes[i] for i in T], [is_half[i] for i in T], [wire16[i] for i in T], devices)
    else:
        layout = plan_layout([sizes[i] for i in T], [is_half[i] for i in T], [wire16[i] for i in T], devices,
                             shard=zero, shard_grads=shard_grads, cap=cap, split=split_elements_for(cfg.optim.split_mb, cap),
                             local=[expert[i] for i in T] if ep > 1 else None)
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
        "adam_moments": sum(moment_bytes(cfg, target) * n for _, n, _ in owned),
        "activations": activation_bytes(m, cfg.data.seq_len, micro, cfg.precision.dtype, recompute, flash, ep,
                                        cfg.optim.loss_chunk_tokens if target != "cpu" else 0),
    }
    # the prefetch everywhere but the CPU with recompute (step/zero3.py `prefetches`)
    mem["gathered_weights"] = gathered_bytes(shapes, sizes, pbytes, T, recompute, prefetch=target != "cpu") if zero3 else 0
    red, gat = layout.largest_bucket_bytes()
    # expert parallel: the step takes the expert stacks out of the world's flat buckets into one
    # bucket of their own (step/zero_setup.py `ex`): a flat copy of all this rank's expert
    # gradients and its AllReduce's result over the expert-data-parallel group; with one rank
    # there (ep = devices) nothing is summed and the step takes each gradient as it is, no bucket
    # (step/update.py kind 3, step/ep.py `expert_bucket_bytes`)
    xs = {j for j, i in enumerate(T) if expert[i]}
    wb = lambda j: 2 if layout.wire16[j] else 4  # noqa: E731
    expert_t = 2 * sum(layout.sizes[j] * wb(j) for j in xs) if xs and devices // ep > 1 else 0
    if xs and layout.reduce_flat:
        red = max(sum(n * wb(j) for j, n in zip(b.indices, b.sizes) if j not in xs) for b in layout.reduce_flat)
    if zero3:  # one collective per parameter: the largest one's gather and its gradient's reduction
        red = gat = max(sizes[i] * pbytes[i] for i in T)
    # a flat copy and the result: AllReduce's result is the whole bucket; ReduceScatter's (Ascend) 1/N
    reduce_t = red + (red / devices if layout.shard_grads and target == "ascend" else red) if devices > 1 else 0
    gather_t = gat + gat / devices if devices > 1 else 0
    if devices > 1 and target == "cpu":  # measured, not derived: see CPU_BUCKET_FACTOR
        reduce_t = gather_t = CPU_BUCKET_FACTOR * max(red, gat)
    mem["collective_buffers"] = max(reduce_t, gather_t, expert_t)
    mem["update_temporaries"] = update_bytes(cfg) * max(n for _, n, _ in owned)
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


def gathered_bytes(shapes: list, sizes: list[int], pbytes: list[int], trained: list[int], recompute: bool,
                   prefetch: bool = True) -> int:
    """ZeRO-3: bytes of the gathered (whole) weights alive at once during a micro-batch (see
    `memory_model`): all trained ones without recompute (a gathered weight lives until its layer's
    backward). With recompute a layer's weights live during its forward and again during its
    recomputation and backward; the prefetch (model/block.py) gathers the next unit (layer, or the
    head: lm_head or the tied embedding) while a layer computes, so two units at once: the largest
    layer's plus the larger of the largest layer's and the head's. Without the prefetch (the CPU
    with recompute, step/zero3.py) the largest layer's plus the head's, which the loss's backward holds."""
    whole = {i: sizes[i] * pbytes[i] for i in trained}
    if not recompute:
        return sum(whole.values())
    layers: dict[str, int] = {}
    for i, b in whole.items():
        name = shapes[i][0]
        if name.startswith("layers."):
            key = name.split(".")[1]
            layers[key] = layers.get(key, 0) + b
    layer = max(layers.values(), default=0)
    head = max([b for i, b in whole.items() if shapes[i][0].startswith(("lm_head", "embed"))], default=0)
    return layer + (max(layer, head) if prefetch else head)


def zero3_units(shapes: list, pbytes: list[int], trained: list[bool], tied: bool) -> list[int]:
    """ZeRO-3's gathers as the model chains them (model/decoder.py, model/block.py), in bytes of the
    storage dtype: [embedding, layer 0, ..., layer L-1, head (final norm, lm_head or the tied
    embedding again)]; trained parameters only (the others are not sharded)."""
    embed, head, layers = 0, 0, {}
    for (name, shape), b, t in zip(shapes, pbytes, trained):
        n = math.prod(shape) * b if t else 0
        if name.startswith("layers."):
            key = int(name.split(".")[1])
            layers[key] = layers.get(key, 0) + n
        elif name.startswith("embed"):
            embed += n
            head += n if tied else 0
        else:  # norm, lm_head
            head += n
    return [embed] + [layers[k] for k in sorted(layers)] + [head]


def zero3_units_of(m: ModelConfig, cfg: Config) -> list[int]:
    """`zero3_units` of a model and config (train.trainable, precision.param_dtype)."""
    from mspretrain.model.groups import trainable_mask
    from mspretrain.model.presets import is_half_eligible, param_shapes

    shapes = param_shapes(m)
    half = cfg.precision.dtype in ("fp16", "bf16") and cfg.precision.param_dtype == "compute"
    trained = trainable_mask([n for n, _ in shapes], cfg.train.trainable, tied=m.tie_embeddings)
    return zero3_units(shapes, [2 if half and is_half_eligible(n) else 4 for n, _ in shapes], list(trained), m.tie_embeddings)


def zero3_exposed_s(units: list[int], *, devices: int, bus_bytes_per_s: float, forward_s: float, backward_s: float,
                    recompute: bool, prefetch: bool) -> float:
    """Seconds of one micro-batch's ZeRO-3 collectives that no compute hides; `units` from
    `zero3_units`, forward_s / backward_s the micro-batch's compute (the backward with the
    recomputation), spread evenly over the layers. A gather or reduce-scatter moves (N-1)/N of its
    unit over the bus. As the compiled graph orders them (tests/step/test_zero3.py reads it):
    - forward, prefetch: the embedding's and layer 0's gathers are exposed; layer k+1's run while
      layer k computes, the head's while the last layer does, so each is exposed by what exceeds one
      layer's forward. Without the prefetch every gather is exposed.
    - backward: layer k's reduce-scatters run while layer k-1's backward computes (no compute waits
      for them: their order is carried by the weights' gradients, step/zero3.py), the head's while
      the last layer's does; layer 0's and the embedding's are exposed at the end.
    - recompute: the backward's re-gathers of a layer wait for the layer's backward to begin
      (MindSpore's recompute inserts them before their first backward user: not measured on a
      910B here), so they are taken as exposed, every layer's."""
    ring = (devices - 1) / devices
    t = [ring * b / bus_bytes_per_s for b in units]
    embed, layers, head = t[0], t[1:-1], t[-1]
    if not layers:
        return sum(t) * (2 + recompute)
    f, b = forward_s / len(layers), backward_s / len(layers)
    if prefetch:
        forward = embed + layers[0] + sum(max(0.0, g - f) for g in layers[1:]) + max(0.0, head - f)
        backward = embed + layers[0] + sum(max(0.0, r - b) for r in layers[1:]) + max(0.0, head - b)
    else:  # chained on the activations: a gather waits for its layer's input, the backward for each reduce-scatter
        forward = backward = sum(t)
    return forward + backward + (sum(layers) if recompute else 0.0)


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

    The reduction collectives run in readiness order (parallel/layout.py): bucket k can start when the
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
