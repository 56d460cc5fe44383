"""The numerics of one optimizer step, compiled: forward, loss, accumulation, loss scale,
reduction over ranks, clipping, AdamW. Nothing here knows about data files, logging or checkpoints.

Two ways through a step, chosen by the number of micro-batches a rank runs per step:
- one micro-batch (no accumulation): ONE compiled graph `fused(tokens, positions, segments,
  scale, lr, inv_scale)` — forward, summed token NLL (fp32 log-softmax) times
  `scale / global_tokens`, backward, reduction over ranks, update. No accumulation buffers exist.
- k > 1 micro-batches: `accumulate(...)` per micro-batch adds the gradients into fp32 buffers,
  then `apply(lr, inv_scale)` reduces, updates and zeroes them. The buffers are allocated on first
  use (or up front with `accumulation > 1`), so a run without accumulation never holds them.
The order is the field report's: scale → accumulate → unscale → clip → step. The scale is a host
value fixed for the whole window. Loss = sum of token NLL over the global batch ÷ target tokens of
the global batch, so batch size and accumulation do not change it.

No full-size transients (issue 16): gradients are reduced in buckets and written back in place
(accumulation buffers) or replace the micro-batch gradients (fused path); the overflow check and
the squared norm are per-tensor scalars taken in the *scaled* domain — with scale >= 1 a scaled
gradient is finite exactly when the unscaled one is, and a sum of squares that overflows fp32
(a true gradient above ~1e19 / scale) is treated as an overflow, which is what it is for training —
and the unscale and the clip factor are one multiply inside the update of each parameter.

An overflowed step changes no weight and no moment and does not advance the AdamW step counter:
the update kernel then runs as an exact no-op (no Python `if` on a device tensor, and no graph
`if` either: see `_finish`). The host reads
the loss, the finite flag and the norm once per step, after the step: 0.35 ms a step, and the whole
host share of a demo-config step is 0.18 % (docs/benchmarks.md, "Host share of a step"), so the
read is not deferred to overlap the next step.

AdamW is MindSpore's fused `AdamWeightDecay` kernel (one kernel per parameter instead of ~12
elementwise ops; 3x faster on CPU, measured) with PyTorch's semantics restored: the kernel has no
bias correction, so it gets lr·sqrt(bc2)/bc1 as its learning rate, eps·sqrt(bc2) as its epsilon
and wd·bc1/sqrt(bc2) as its decay, which is algebraically torch.optim.AdamW (bias-corrected
moments, eps outside the sqrt, decoupled decay p *= 1 - lr·wd); tests check it against torch.

Sharding over data-parallel ranks (train/layout.py has the tables):
- `shard` (ZeRO-1): every parameter has one owner rank; a rank keeps Adam moments (and fp32
  masters) only for what it owns and updates only those; gradients are reduced in full.
- `shard_grads` (ZeRO-2, implies `shard`): additionally a rank keeps accumulation buffers only
  for what it owns, and each micro-batch's gradients are reduce-scattered into them. On Ascend
  that is `ops.ReduceScatter` (HCCL); MindSpore 2.10's CPU collectives (mccl) have no
  ReduceScatter kernel, so on CPU it is an AllReduce of the same bucket and the rank's own slice
  (the same numbers; only the Ascend path differs, in that one call).
- After the update, owners' parameters reach every rank through bucketed AllGathers (a
  parameter that cannot share a bucket without heavy padding gets its own Broadcast).
- A large parameter (`split_mb`; by default one of at least a bucket cap) is not owned whole: rank
  r owns slice r of its flattened elements (train/layout.py `slice_bounds`), keeps 1-D moments and
  an fp32 master of that slice (for an fp32 parameter too: the kernel updates a Parameter in place,
  and the slice is not one), updates it, and the gather writes the whole tensor on every rank.
  Its gradient crosses ranks as its own bucket (ZeRO-2: reduce-scattered straight into the
  slices) or is all-reduced whole and sliced (ZeRO-1). Each element's update is the same AdamW
  arithmetic whichever rank does it, so the numbers are those of the whole tensor.
- `shard_params` (ZeRO-3, implies `shard_grads`; train/zero3.py): the model itself holds rank r's
  slice of every trained parameter (the split parameters' slices), gathers each where it is used
  and reduce-scatters its gradient in the backward pass, both inside the model's graph. Here every
  parameter is then a split one whose gradient arrives as the slice: no bucket, no reduction and
  no gather after the update (`zero3_layout`); the slice Parameter is its own fp32 master.
The grad norm is the same on every rank (owners' partial sums of squares are all-reduced), so
clipping and the overflow decision agree everywhere, and an owner computes exactly what an
unsharded rank would.

Frozen parameters (`trainable`, the config's `train.trainable` groups, model/groups.py): the step
sees only the trained parameters. Gradients are taken for those alone, and every table above
(owners, buckets, masters, moments, accumulation buffers, the optimizer state's keys) is built
from them, so a frozen parameter costs its weights and nothing else, never changes, and is never
reduced or gathered. The grad norm and clipping are over the trained parameters, as in PyTorch
where frozen tensors have no `.grad`. A frozen parameter in `half_params` is stored rounded to the
compute dtype (what the forward pass reads anyway) and needs no master.

Half-precision parameters (`precision.param_dtype = "compute"`, `half_params` here): the decoder's
matrices are stored in the compute dtype and an fp32 master copy of each lives with the optimizer
state, on its owner rank; AdamW updates the master and writes the rounded value into the
parameter. The forward pass reads exactly the rounded weights it would cast at use, so losses
equal those of fp32 parameters bit for bit (tests/test_memory_options.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from mspretrain.checkpoint.model_shards import parse_key  # the stored keys' one parser (weights and optimizer state)
from mspretrain.config import OptimConfig
from mspretrain.model.groups import trainable_mask
from mspretrain.model.llama import use_fused_kernels
from mspretrain.model.parallel import Group, PartialSum
from mspretrain.train.layout import assign_owners, bucket_mb_for, cap_elements, plan_layout, readiness, split_elements_for, zero3_layout

__all__ = ["TrainStep", "StepResult", "decay_mask", "assign_owners"]


def decay_mask(names: list[str], decay_embeddings: bool) -> list[bool]:
    """No weight decay on norms and biases; on embeddings only when asked."""
    out = []
    for n in names:
        if "norm" in n or n.endswith("bias"):
            out.append(False)
        elif "embed" in n:
            out.append(decay_embeddings)
        else:
            out.append(True)
    return out


@dataclass
class StepResult:
    loss: float  # mean token NLL over the global batch (z-loss excluded)
    grad_norm: float  # global norm of the unscaled gradients, before clipping
    finite: bool  # False: overflow, the update was skipped
    # this rank's rows, in micro-batch order: summed token NLL of each sample (per-source loss,
    # spike forensics); a (B,) vector per micro-batch, read back with the loss
    row_nll: np.ndarray | None = None


def _flat(parts: list[Tensor]) -> Tensor:
    return parts[0] if len(parts) == 1 else ops.concat(parts)


def _pieces(flat: Tensor, sizes: tuple[int, ...]) -> tuple[Tensor, ...]:
    return (flat,) if len(sizes) == 1 else ops.split(flat, list(sizes))


def slice_key(key: str, start: int, stop: int) -> str:
    """Checkpoint name of a slice's state: `exp_avg.lm_head.weight@0:68108288` holds elements
    [start, stop) of the flattened state `exp_avg.lm_head.weight` (1-D). Whole tensors keep
    their plain names, so a checkpoint without split parameters is written as before."""
    return f"{key}@{start}:{stop}"


class TrainStep:
    """Holds the optimizer state and the compiled step functions for one model."""

    def __init__(self, model: nn.Cell, optim: OptimConfig, *, global_tokens: int, world: int = 1,
                 rank: int = 0, jit: bool = True, allreduce_fp16: bool = False, shard: bool = False,
                 shard_grads: bool = False, half_params: list[str] | None = None,
                 bucket_mb: float | str = "auto", device: str = "cpu", accumulation: int | None = None,
                 jit_level: str = "O0", trainable: list[str] | tuple[str, ...] | None = None,
                 split_mb: float | str = "auto", shard_params: bool = False, comm: Any = None) -> None:
        """half_params: names of parameters to store in the model's compute dtype from now on;
        their fp32 values become master copies held with the optimizer state (by their owner).
        bucket_mb: cap of one collective's flat buffer (0 = one collective per parameter; "auto": by
        device, train/layout.py `bucket_mb_for`).
        accumulation: micro-batches per step, when known (> 1 allocates the buffers now).
        jit_level: MindSpore's graph optimisation level for the compiled functions (device.jit_level).
        trainable: parameter groups to train (train.trainable); None or ["all"]: every parameter.
        split_mb: with sharding, parameters of at least this many MB (4 bytes an element) are cut
        into a slice per rank ("auto": the bucket cap; 0: never; train/layout.py `split_elements_for`).
        shard_params: ZeRO-3 (implies shard_grads): the model's trained parameters become this rank's
        slices, gathered where they are used and reduce-scattered in the backward (train/zero3.py).
        comm: the data-parallel group (model/parallel.py `Group`) when it is not the world (tensor
        parallel, train/tp.py); a model cut by model/parallel.py `split_model` carries its tp group."""
        from mspretrain.model.loss import token_nll

        self.model = model
        every = tuple(model.trainable_params())
        keep = trainable_mask([p.name for p in every], trainable, tied=bool(getattr(model, "tied", False)))
        # ZeRO-3: the trained parameters are cut into slices now, before any table below is built
        self.zero3 = shard_params and world > 1
        full_size = {p.name: int(np.prod(p.shape)) for p in every}
        if self.zero3:
            from mspretrain.train.zero3 import shard_model, sharded_names

            shard_model(model, sharded_names(model, [p.name for p, k in zip(every, keep) if k], world), world, rank, device)
            every = tuple(model.trainable_params())
        self.params = tuple(p for p, k in zip(every, keep) if k)  # the trained ones: all tables below index these
        self.frozen = tuple(p for p, k in zip(every, keep) if not k)
        self.names = [p.name for p in self.params]
        self.world, self.rank, self.device = world, rank, device
        self.global_tokens = float(global_tokens)
        self.beta1, self.beta2, self.eps = float(optim.beta1), float(optim.beta2), float(optim.eps)
        self.clip = float(optim.grad_clip)
        self.wd = [float(optim.weight_decay) if d else 0.0 for d in decay_mask(self.names, optim.decay_embeddings)]
        half = set(half_params or ())
        self.sizes = [full_size[n] for n in self.names]  # whole parameters' (ZeRO-3 holds slices of them)
        # fp16 on the wire for every gradient but lm_head's (the field report's exemption)
        cap = cap_elements(bucket_mb_for(bucket_mb, device))
        wire16 = [allreduce_fp16 and "lm_head" not in n for n in self.names]
        if self.zero3:  # every parameter split, no bucket: the gathers and reductions live in the model's graph
            self.layout = zero3_layout(self.sizes, [n in half for n in self.names], wire16, world)
        else:
            self.layout = plan_layout(self.sizes, [n in half for n in self.names], wire16, world,
                                      shard=shard, shard_grads=shard_grads, cap=cap, split=split_elements_for(split_mb, cap))
        self.shard_grads, self.sharded = self.layout.shard_grads, self.layout.sharded
        self.owner = list(self.layout.owner) if self.sharded else [rank] * len(self.params)
        # indices whose state (all of it, or a slice of a split parameter) lives here
        self.own = self.layout.owned(rank) if self.sharded else list(range(len(self.params)))
        self._own_split = [self.layout.is_split(i) for i in self.own]
        self._own_bounds = [self.layout.unit(i, rank) for i in self.own]  # [start, stop) of the flattened parameter
        # Master weights: an fp32 copy for each owned parameter stored in half precision, taken
        # before the parameter is rounded; fp32 parameters are their own masters, unless split
        # (a slice of a Parameter is not a Parameter the update kernel can write).
        self._own_has_master = [self.names[i] in half for i in self.own]  # in the checkpoint (fp32 ones are the weights)
        # a tensor of its own (ZeRO-3: an fp32 slice is its own master, the Parameter is the slice)
        self._own_separate = [h or (c and not self.zero3) for h, c in zip(self._own_has_master, self._own_split)]
        # Every state Parameter below gets a temporary and positional arguments: MindSpore 2.10's
        # Parameter.__new__ wraps its input only at refcount 4 and otherwise rebuilds it from
        # `asnumpy()` (model/llama.py `_normal` says why), which would bring each zeroed moment
        # and accumulator of an NPU back through host memory (tests/test_startup.py).
        self.own_masters = ms.ParameterTuple([
            Parameter(Tensor(self._flat_value(k)), self._key(k, "master"), False) if sep else self.params[i]
            for k, (i, sep) in enumerate(zip(self.own, self._own_separate))])
        for p in self.params + self.frozen:
            if p.name in half:
                p.set_dtype(model.dtype)
        # a slice's state is 1-D, a whole parameter's has its shape
        shape = lambda k: (self._own_bounds[k][1] - self._own_bounds[k][0],) if self._own_split[k] else self.params[self.own[k]].shape
        zeros = lambda k, prefix: Parameter(ops.zeros(shape(k), ms.float32), self._key(k, prefix), False)
        self.exp_avg = ms.ParameterTuple([zeros(k, "exp_avg") for k in range(len(self.own))])
        self.exp_avg_sq = ms.ParameterTuple([zeros(k, "exp_avg_sq") for k in range(len(self.own))])
        self.opt_step = Parameter(Tensor(0, ms.int32), name="opt_step", requires_grad=False)
        self.loss_accum = Parameter(Tensor(0.0, ms.float32), name="loss_accum", requires_grad=False)
        self.accum: ms.ParameterTuple | None = None  # fp32, for the parameters whose gradients this rank sums
        self._full_state: Callable[[], dict[str, np.ndarray]] | None = None  # ZeRO-3: the compiled gather of the whole weights

        # ---- collectives and their packing (pure tables: train/layout.py)
        # As plain tuples of ints and dtypes: graph code reads no dataclasses, dicts or generators.
        self.wire = [ms.float16 if w else ms.float32 for w in self.layout.wire16]
        pdtype = [p.dtype if p.name not in half else model.dtype for p in self.params]
        first = lambda b: next(seg for seg in b.segments if seg)[0]
        used = lambda b: tuple(b.used(r) for r in range(world))
        self._ar = [(b.indices, b.sizes, self.wire[b.indices[0]]) for b in self.layout.reduce_flat]
        self._rs = [(b.segments, b.sizes, b.length, used(b), self.wire[first(b)], b.split) for b in self.layout.reduce_rank]
        self._rs_single = list(self.layout.reduce_single)
        # MindSpore 2.10's CPU AllGather (mccl) fails to launch on fp16 (measured): on CPU half
        # parameters cross as fp32, which fp16 -> fp32 -> fp16 round-trips exactly; HCCL takes fp16.
        gather_dtype = lambda dt: ms.float32 if device != "ascend" and dt in (ms.float16, ms.bfloat16) else dt
        # a split bucket's last entry: the position of this rank's slice in `self.own` (-1: not split)
        self._ag = [(b.segments, b.sizes, b.length, used(b), gather_dtype(pdtype[first(b)]), self.own.index(first(b)) if b.split else -1)
                    for b in self.layout.gather_rank]
        self._pdtype = pdtype
        self._ag_single = list(self.layout.gather_single)
        # `_reduce` returns the gradients it produces in this order (graph code cannot use dicts):
        # every index (replicated) or the owned ones (sharded), bucket by bucket
        # Every reduction collective in gradient-readiness order (train/layout.py `readiness`): the
        # buckets come sorted, and a lopsided singleton takes its place among them. kind 0: an
        # AllReduce bucket, 1: a ReduceScatter bucket, 2: one parameter's AllReduce.
        sched = ([(readiness(b.indices), 0, k) for k, b in enumerate(self.layout.reduce_flat)]
                 + [(readiness(i for seg in b.segments for i in seg), 1, k) for k, b in enumerate(self.layout.reduce_rank)]
                 + [(i, 2, i) for i in self._rs_single])
        self._schedule = [(kind, k) for _, kind, k in sorted(sched, key=lambda t: -t[0])]
        if world == 1 or self.zero3:
            self._order = list(range(len(self.params)))
        else:
            produced = {0: lambda k: list(self._ar[k][0]), 1: lambda k: list(self._rs[k][0][rank]),
                        2: lambda i: [i] if self.owner[i] == rank else []}
            self._order = [i for kind, k in self._schedule for i in produced[kind](k)]
        # The squared norm sums per-parameter terms in parameter order whatever the bucket order, so
        # the bucketing (and the world size) does not change its rounding.
        self._norm_order = sorted(range(len(self._order)), key=lambda k: self._order[k])
        # Tensor parallel (model/parallel.py): the squared norm is summed over the tp group, where a
        # replicated parameter (a norm weight, the same gradient on every tp rank) counts 1/tp times.
        self.tp = getattr(model, "tp", None)
        split = getattr(model, "tp_shapes", {})
        self._sq_weight = [1.0 / self.tp.size if self.tp is not None and self.names[i] not in split else 1.0 for i in self._order]
        self.tp_sum = self.tp.all_reduce() if self.tp is not None else None
        partial = [i for i, n in enumerate(self.names) if n in getattr(model, "tp_partial", ())]
        self._tp_partial = PartialSum(partial, [self.params[i].shape for i in partial], self.tp) if partial else None
        # Chaining every collective after the previous one: MindSpore's CPU runtime launches ready
        # kernels as they come (actor dataflow), so without it two ranks may issue independent
        # collectives in different orders, and mccl pairs one rank's bucket with another's (measured).
        # On Ascend the collectives run in the compiled graph's execution order, which MindSpore's own
        # data-parallel reducer relies on (nn/wrap/grad_reducer.py, DistributedGradReducer.construct
        # maps independent AllReduces, with no depend between them); there a chain would only make
        # the next bucket's copy, on the compute stream, wait for the previous collective: a stall of
        # the backward pass. What that reducer does not face, and ZeRO does: a rank that does not use
        # a collective's result (a bucket another rank owns). `no_eliminate` (ops/operations/
        # comm_ops.py, AllReduce / ReduceScatter / AllGather __init__) does not keep such a node: the
        # frontend pass `jit_opt_a` drops it from that rank's graph alone (measured in 2.10's IR at
        # world 4: 13 AllReduces traced, 5 kept on rank 0), and the ranks' sequences no longer pair
        # up (an HCCL hang, or the wrong sums where sizes match). `_reduce` therefore returns a
        # result that depends on every collective it issued, in schedule order, whichever it uses:
        # tests/test_collective_sequence.py compiles the Ascend path for each rank of worlds 2, 4
        # and 8 and compares their ordered collectives.
        self._chain = device != "ascend"
        self._own_pos = [self._order.index(i) for i in self.own]
        # where `_reduce` leaves a split parameter's gradient whole (replicated: ZeRO-1), the update
        # cuts the owned slice from it; with ZeRO-2 it arrives as the slice
        self._own_cut = [ab if cut and not self.shard_grads else None for ab, cut in zip(self._own_bounds, self._own_split)]
        # shape of each gradient `_reduce` produces (the accumulation buffers): a slice is 1-D
        unit_len = lambda i: (lambda a, b: b - a)(*self.layout.unit(i, rank))
        self._order_shape = [(unit_len(i),) if self.shard_grads and self.layout.is_split(i) else self.params[i].shape
                             for i in self._order]
        self._order_pos = [self._order.index(i) if i in self._order else -1 for i in range(len(self.params))]
        c = comm if comm is not None else Group(tuple(range(world)), rank, device=device)  # the world: the plain primitives
        self.allreduce = c.all_reduce() if world > 1 else None
        # MindSpore 2.10: ReduceScatter has HCCL (Ascend) and NCCL kernels, none for CPU (mccl).
        # (one instance per bucket, like the AllGathers below: shapes differ between buckets)
        self._reduce_scatters = [c.reduce_scatter() for _ in self._rs] if device == "ascend" else []
        # AllGather on Ascend (HCCL), one per bucket. On CPU (mccl) a second AllGather in one graph
        # fails ("Memcpy error, dest size is 256, src size is 65536" in RingAllGather, measured with
        # one primitive per bucket too), so there each rank all-reduces the bucket with its own
        # segment in place and zeros elsewhere: the same numbers, selected by device.
        self._allgathers = [c.all_gather() for _ in self._ag] if device == "ascend" else []
        # one Broadcast per unbucketed parameter, from its owner (a multi-tensor Broadcast mixes up
        # tensors of different shapes on CPU: wrong-rank assigns in graph mode, memcpy overlap errors eagerly)
        self._bcast = [c.broadcast(self.owner[i]) for i in self._ag_single]
        self._adamw = ops.AdamWeightDecay()
        self._jit = (lambda fn: ms.jit(fn, jit_level=jit_level)) if jit else None

        # Ascend: plain reductions instead of the CPU's GEMM forms (model/llama.py `use_fused_kernels`)
        plain = self._plain_sums = use_fused_kernels(device)
        inv_tokens = 1.0 / self.global_tokens
        z = float(optim.z_loss)
        tp_loss = getattr(model, "tp_loss", None)

        def objective(tokens: Tensor, positions: Tensor | None, segments: Tensor | None, scale: Tensor):
            inputs, targets = tokens[:, :-1], tokens[:, 1:]  # (B, T) each
            logits = model(inputs, positions, segments)  # (B, T, V) fp32
            # (B, T) fp32 each; tensor parallel: from the local vocabulary columns (model/parallel.py)
            nll, lse = token_nll(logits, targets, plain_sum=plain) if tp_loss is None else tp_loss(logits, targets)
            nll_sum = nll.sum()
            obj = nll_sum
            if z > 0:
                obj = obj + z * (lse * lse).sum()
            return obj * (scale * inv_tokens), nll_sum, nll.sum(-1)

        self._grad_fn = ms.value_and_grad(objective, None, self.params, has_aux=True)

        def fused(tokens, positions, segments, scale, lr, inv_scale):
            (_, nll_sum, rows), grads = self._grad_fn(tokens, positions, segments, scale)
            reduced, last = self._reduce(list(grads))
            loss_sum = nll_sum if self.allreduce is None else self.allreduce(ops.depend(nll_sum, last))
            loss_sum, finite, norm = self._finish(reduced, loss_sum, lr, inv_scale)
            return loss_sum, finite, norm, rows

        self._fused: Callable[..., Any] = self._jit(fused) if self._jit else fused
        self._accumulate: Callable[..., Any] | None = None
        self._apply: Callable[..., Any] | None = None
        if accumulation is not None and accumulation > 1:
            self._ensure_accum()

    def _key(self, k: int, prefix: str) -> str:
        """State key of owned unit k's `prefix` tensor: the plain name, or the slice's (`slice_key`)."""
        key = f"{prefix}.{self.names[self.own[k]]}"
        return slice_key(key, *self._own_bounds[k]) if self._own_split[k] else key

    def _flat_value(self, k: int) -> np.ndarray:
        """Owned unit k's current values in fp32, shaped like its state (a copy)."""
        value = self.params[self.own[k]].asnumpy().astype(np.float32)
        if not self._own_split[k] or self.zero3:  # whole, or (ZeRO-3) the Parameter is the slice
            return value.copy()
        a, b = self._own_bounds[k]
        return value.reshape(-1)[a:b].copy()

    # ----------------------------------------------------------------- graph pieces
    def _reduce(self, grads: list[Tensor], in_order: bool = False) -> tuple[list[Tensor], Tensor | None]:
        """Sum the (scaled) gradients over ranks, bucket by bucket. `grads` is indexed like the
        parameters, or (in_order) like `self._order`. Returns fp32 tensors in `self._order`: all
        of them, or with sharded gradients only this rank's own. Also returns the last collective's
        result. The collectives run in `self._schedule`'s order, the order in which the backward
        pass completes their buckets, so the first starts while the backward pass still runs. On
        CPU each bucket's flat copy is made after the previous collective's result (`self._chain`):
        all ranks then issue them in one order, and one bucket is alive at a time. The returned last
        result depends on every collective issued here (kept in every rank's graph, in one order)."""
        if in_order:  # replicated buffers already in bucket order: a permutation of all indices
            grads = [grads[self._order_pos[i]] for i in range(len(self.params))]
        if self._tp_partial is not None:  # tensor parallel: the QK-norm gradients summed over tp first
            grads = list(self._tp_partial(tuple(grads)))
        if self.world == 1:
            return [g.astype(ms.float32) for g in grads], None
        if self.zero3:  # reduce-scattered in the backward pass already (train/zero3.py, ShardedGather.bprop)
            out = [g.astype(ms.float32) for g in grads]
            return out, ops.depend(out[0], tuple(out))  # what follows (the loss AllReduce) waits for all of them
        out: list[Tensor] = []
        # tensor parallel on CPU: the first reduction after the whole backward pass, whose tp
        # all-reduces (model/parallel.py) every rank must issue before it, in one order
        prev: Tensor | None = ops.depend(grads[0], tuple(grads)) if self._chain and self.tp is not None else None
        issued: list[Tensor] = []  # every collective's result, used here or not
        for kind, k in self._schedule:
            if kind == 0:  # replicated gradients: AllReduce
                indices, sizes, wire = self._ar[k]
                flat = _flat([grads[i].reshape(-1).astype(wire) for i in indices])
                if self._chain and prev is not None:
                    flat = ops.depend(flat, prev)
                red = self.allreduce(flat)
                prev = red
                issued.append(red)
                for i, piece in zip(indices, _pieces(red, sizes)):
                    out.append(piece.reshape(self.params[i].shape).astype(ms.float32))
            elif kind == 1:  # sharded gradients: each rank ends with its own segment
                segments, sizes, length, used, wire, split = self._rs[k]
                if split:  # the segments are the slices: the flattened gradient is the bucket, padded at its end
                    parts = [grads[segments[0][0]].reshape(-1).astype(wire)]
                    if length * self.world > sum(used):
                        parts.append(ops.zeros((length * self.world - sum(used),), wire))
                else:
                    parts = []
                    for r in range(self.world):
                        parts += [grads[i].reshape(-1).astype(wire) for i in segments[r]]
                        if length > used[r]:
                            parts.append(ops.zeros((length - used[r],), wire))
                flat = _flat(parts)
                if self._chain and prev is not None:
                    flat = ops.depend(flat, prev)
                start = self.rank * length
                mine = self._reduce_scatters[k](flat) if self._reduce_scatters else self.allreduce(flat)[start:start + length]
                prev = mine
                issued.append(mine)
                if segments[self.rank]:
                    own = mine if used[self.rank] == length else mine[:used[self.rank]]
                    if split:  # this rank's slice, 1-D like its moments
                        out.append(own.astype(ms.float32))
                    else:
                        for i, piece in zip(segments[self.rank], _pieces(own, sizes[self.rank])):
                            out.append(piece.reshape(self.params[i].shape).astype(ms.float32))
            else:  # too lopsided to bucket: AllReduce, the owner keeps it
                g = grads[k].astype(self.wire[k])
                if self._chain and prev is not None:
                    g = ops.depend(g, prev)
                red = self.allreduce(g)
                prev = red
                issued.append(red)
                if self.owner[k] == self.rank:
                    out.append(red.astype(ms.float32))
        # every collective's result, in schedule order, behind the one returned: a rank keeps the
        # collectives it does not read (see `_chain` in __init__) and reaches them in one order
        return out, ops.depend(prev, tuple(issued))

    def _finish(self, grads: list[Tensor], loss_sum: Tensor, lr: Tensor, inv_scale: Tensor):
        """Norm, overflow check, update of the owned parameters, then every rank gets every owner's
        parameters. `grads`: reduced, still scaled, fp32, in `self._order`."""
        # sum of squares in the scaled domain, as a dot product: no squared copy of the gradient
        # (on MindSpore's CPU backend every full-size graph intermediate stays resident)
        if self._plain_sums:  # Ascend: a reduction, not a (1, n) x (n, 1) matmul on the matrix unit
            terms = [ops.square(grads[k]).sum() for k in self._norm_order]
        else:
            terms = [ops.matmul(grads[k].reshape(1, -1), grads[k].reshape(-1, 1)).reshape(()) for k in self._norm_order]
        sq = ops.stack([s if self._sq_weight[k] == 1.0 else s * self._sq_weight[k] for s, k in zip(terms, self._norm_order)]).sum()
        if self.shard_grads and self.allreduce is not None:
            sq = self.allreduce(ops.depend(sq, loss_sum))  # the owners' partial sums: the same global norm on every rank
        if self.tp is not None:  # tensor parallel: the pieces' sums over the tp group
            sq = self.tp_sum(ops.depend(sq, loss_sum))
        finite = ops.isfinite(sq)
        norm = ops.sqrt(sq) * inv_scale
        # Branch-free skip: on overflow the kernel runs as an exact no-op (beta1 = beta2 = 1,
        # lr = decay = 0, gradient 0), instead of sitting under a graph `if finite:`. Inside such a
        # branch MindSpore 2.10 reads Parameters (the accumulation buffers) stale from the second
        # step on (measured: moments off by 2e-5 after two steps); and `where` keeps inf/NaN out.
        gscale = inv_scale
        if self.clip > 0:
            gscale = inv_scale * ops.minimum(ops.ones((), ms.float32), self.clip / (norm + 1e-6))
        step = self.opt_step + finite.astype(ms.int32)
        ops.assign(self.opt_step, step)
        t = ops.maximum(step, 1).astype(ms.float32)
        bc1 = 1.0 - ops.pow(self.beta1, t)
        root_bc2 = ops.sqrt(1.0 - ops.pow(self.beta2, t))
        zero, one = ops.zeros((), ms.float32), ops.ones((), ms.float32)
        # torch's AdamW in the bias-free kernel: lr·sqrt(bc2)/bc1, eps·sqrt(bc2), wd·bc1/sqrt(bc2)
        lr_t = ops.where(finite, lr * root_bc2 / bc1, zero)
        b1 = ops.where(finite, self.beta1 * one, one)
        b2 = ops.where(finite, self.beta2 * one, one)
        eps_t = self.eps * root_bc2
        wd_factor = ops.where(finite, bc1 / root_bc2, zero)
        # The gradient of a skipped step is 0 (an exact no-op update), without a `where` over the
        # full tensor: MindSpore 2.10's CPU Select with a 0-d operand keeps three index lists of the
        # output's size (24 B per element) for the graph's lifetime (select_cpu_kernel.cc,
        # GetBroadCastIndex; docs/benchmarks/memory.md run 3: -23.5 B/param). A scale of 0 zeroes
        # finite values; nan_to_num turns the inf * 0 = NaN of an overflowed gradient into 0.
        gscale = ops.where(finite, gscale, zero)
        for k, i in enumerate(self.own):
            master = self.own_masters[k]
            g = grads[self._own_pos[k]]
            if self._own_cut[k] is not None:  # a whole (replicated) gradient of a split parameter: this rank's slice
                g = g.reshape(-1)[self._own_cut[k][0]:self._own_cut[k][1]]
            g = ops.nan_to_num(g * gscale, 0.0, 0.0, 0.0)
            wd = self.wd[i] * wd_factor if self.wd[i] else 0.0
            self._adamw(master, self.exp_avg[k], self.exp_avg_sq[k], lr_t, b1, b2, eps_t, wd, g)
            if self._own_has_master[k] and (self.zero3 or not self._own_split[k]):  # a split one reaches its parameter in `_gather`
                ops.assign(self.params[i], master.astype(self.params[i].dtype))
        # the returned loss depends on the last collective: a collective whose result a rank does
        # not use would otherwise be pruned from that rank's graph only, and the ranks' sequences
        # of collectives would no longer pair up (measured: a hang-free mismatch error in mccl)
        loss_sum = ops.depend(loss_sum, self._gather(ops.depend(ops.depend(loss_sum, finite), sq)))
        return loss_sum, finite, norm

    def _gather(self, after: Tensor) -> Tensor:
        """Owners' parameters to every rank: bucketed AllGather, Broadcast for the rest."""
        prev = after
        for k, (segments, sizes, length, used, dtype, own_k) in enumerate(self._ag):
            split = own_k >= 0
            # `p * 1`, a computed tensor, not the Parameter: a Parameter handed straight to a
            # collective is read before the update's assign (measured on CPU), a computed one after.
            if split:  # this rank's updated slice, rounded to the parameter's dtype as a whole one is
                i = segments[0][0]
                parts = [(self.own_masters[own_k] * 1).astype(self._pdtype[i]).astype(dtype)]
            else:
                parts = [(self.params[i] * 1).reshape(-1).astype(dtype) for i in segments[self.rank]]
            if length > used[self.rank]:
                parts.append(ops.zeros((length - used[self.rank],), dtype))
            if self._allgathers:
                full = self._allgathers[k](ops.depend(_flat(parts), prev))
            else:
                before, after_ = self.rank * length, (self.world - 1 - self.rank) * length
                parts = ([ops.zeros((before,), dtype)] if before else []) + parts + ([ops.zeros((after_,), dtype)] if after_ else [])
                full = self.allreduce(ops.depend(_flat(parts), prev))
            prev = full
            if split:  # N segments of `length`: the flattened parameter, then the padding
                i = segments[0][0]
                n = self.sizes[i]
                value = full if n == length * self.world else full[:n]
                ops.assign(self.params[i], value.reshape(self.params[i].shape).astype(self.params[i].dtype))
            else:
                for r in range(self.world):
                    if r != self.rank and segments[r]:
                        start = r * length
                        for i, piece in zip(segments[r], _pieces(full[start:start + used[r]], sizes[r])):
                            ops.assign(self.params[i], piece.reshape(self.params[i].shape).astype(self.params[i].dtype))
        for i, bcast in zip(self._ag_single, self._bcast):
            out = bcast((ops.depend(self.params[i] * 1, prev),))[0]
            if self.owner[i] != self.rank:
                ops.assign(self.params[i], out)
            prev = out
        return prev

    def _ensure_accum(self) -> None:
        if self.accum is not None:
            return
        # in `self._order`: the order `_reduce` produces and `_finish` reads
        self.accum = ms.ParameterTuple([Parameter(ops.zeros(shape, ms.float32), f"accum.{self.names[i]}", False)
                                        for i, shape in zip(self._order, self._order_shape)])  # positional: see __init__

        # The first micro-batch of a step overwrites the buffers instead of adding to them, so
        # `apply` never zeroes them: a zeroing assign there is ordered before the reads of the same
        # buffers (measured: grad norm 0), and copying them first is the full-size transient this
        # step avoids. `where`, not a multiply by 0: an overflowed step leaves inf in the buffers.
        def accumulate(tokens, positions, segments, scale, first):
            (_, nll_sum, rows), grads = self._grad_fn(tokens, positions, segments, scale)
            if self.shard_grads:  # reduce every micro-batch; keep only the owned sums
                grads, last = self._reduce(list(grads))
                nll_sum = ops.depend(nll_sum, last)  # keeps every collective in every rank's graph
            else:
                grads = [grads[i].astype(ms.float32) for i in self._order]
            for acc, g in zip(self.accum, grads):
                # a full-size condition: Select with a 0-d operand holds 24 B per element (see _finish)
                ops.assign(acc, ops.where(ops.broadcast_to(first, acc.shape), g, acc + g))
            ops.assign(self.loss_accum, ops.where(first, nll_sum, self.loss_accum + nll_sum))
            return nll_sum, rows

        def apply(lr, inv_scale):
            loss_sum = self.loss_accum * 1.0
            if not self.shard_grads and (self.world > 1 or self._tp_partial is not None):  # reduce the buffers in place
                reduced, last = self._reduce(list(self.accum), in_order=True)
                for acc, g in zip(self.accum, reduced):
                    ops.assign(acc, g)
                if self.allreduce is not None:
                    loss_sum = self.allreduce(ops.depend(loss_sum, last))
            grads = list(self.accum)
            if self.shard_grads:
                loss_sum = self.allreduce(loss_sum)
            return self._finish(grads, loss_sum, lr, inv_scale)

        self._accumulate = self._jit(accumulate) if self._jit else accumulate
        self._apply = self._jit(apply) if self._jit else apply

    # ----------------------------------------------------------------- running
    def run(self, micro_batches: list[tuple[np.ndarray, np.ndarray | None, np.ndarray | None]],
            lr: float, scale: float) -> StepResult:
        """One optimizer step over this rank's micro-batches (tokens (B, T+1), positions, segments)."""
        scale_t = Tensor(scale, ms.float32)
        lr_t, inv_t = Tensor(lr, ms.float32), Tensor(1.0 / scale, ms.float32)
        as_t = lambda a: None if a is None else Tensor(a)
        if len(micro_batches) == 1 and self.accum is None:
            tokens, positions, segments = micro_batches[0]
            loss_sum, finite, norm, rows = self._fused(Tensor(tokens), as_t(positions), as_t(segments), scale_t, lr_t, inv_t)
            row_parts = [rows]
        else:
            self._ensure_accum()
            row_parts = []
            for k, (tokens, positions, segments) in enumerate(micro_batches):
                _, rows = self._accumulate(Tensor(tokens), as_t(positions), as_t(segments), scale_t, Tensor(k == 0))
                row_parts.append(rows)
            loss_sum, finite, norm = self._apply(lr_t, inv_t)
        return StepResult(loss=float(loss_sum.asnumpy()) / self.global_tokens,
                          grad_norm=float(norm.asnumpy()), finite=bool(finite.asnumpy()),
                          row_nll=np.concatenate([r.asnumpy() for r in row_parts]))

    # ----------------------------------------------------------------- weights
    def full_weights(self) -> dict[str, np.ndarray]:
        """Every parameter whole by name (what a checkpoint's model file holds), fp16 ones as fp16,
        the rest fp32: the model's own under ZeRO-0/1/2; gathered under ZeRO-3, a collective that
        every rank must call (train/zero3.py `full_state`)."""
        from mspretrain.model.llama import state_numpy

        if not self.zero3:
            return state_numpy(self.model, keep_fp16=True)
        from mspretrain.train.zero3 import full_state

        if self._full_state is None:
            self._full_state = full_state(self.model, jit=self._jit is not None)
        return {k: v.copy() for k, v in self._full_state().items()}

    def load_weights(self, tensors: dict[str, np.ndarray]) -> None:
        """Whole tensors (a checkpoint's model file, written by any layout) into the model: whole,
        or under ZeRO-3 this rank's slices of them."""
        from mspretrain.model.llama import load_numpy

        if not self.zero3:
            load_numpy(self.model, tensors)
            return
        from mspretrain.train.zero3 import load_full_state

        load_full_state(self.model, tensors, self.world, self.rank)

    # ----------------------------------------------------------------- memory
    def buffer_bytes(self) -> dict[str, int]:
        """Bytes of the tensors this step keeps alive between steps, by kind (what `plan` models)."""
        nbytes = lambda ps: sum(int(np.prod(p.shape)) * (2 if p.dtype in (ms.float16, ms.bfloat16) else 4) for p in ps)
        return {"weights": nbytes(self.params + self.frozen),
                "master_weights": nbytes([m for m, sep in zip(self.own_masters, self._own_separate) if sep]),
                "adam_moments": nbytes(self.exp_avg) + nbytes(self.exp_avg_sq),
                "gradients": nbytes(self.accum) if self.accum is not None else 0}

    def owned_elements(self) -> int:
        """Parameter elements whose optimizer state this rank holds (slices of split ones included)."""
        return sum(b - a for a, b in self._own_bounds)

    def collectives(self, accumulation: int = 1) -> dict[str, int]:
        """Collective calls and bytes handed to them per step (train/layout.py `Layout.traffic`)."""
        calls, nbytes = self.layout.traffic(accumulation)
        return {"calls": calls, "bytes": nbytes}

    # ----------------------------------------------------------------- state
    # A split parameter's state is stored per slice (`slice_key`); a rank reading it back (any world
    # size: another one cuts other slices, or none) assembles its own part from whichever stored
    # slices overlap it (`load_optimizer_state`). The logical keys (the names without `@...`) are
    # those of an unsplit run, and the checks of a checkpoint against the model use them.
    def _kinds(self, i: int) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq", "master") if self.params[i].dtype != ms.float32 else ("exp_avg", "exp_avg_sq")

    def state_keys(self, owned_only: bool = False) -> set[str]:
        """Tensor names of the optimizer state: all of it (logical names), or the part this rank
        holds (as it writes them: a split parameter's slices by `slice_key`)."""
        if owned_only:
            return {"opt_step"} | {self._key(k, kind) for k, i in enumerate(self.own) for kind in self._kinds(i)}
        return {"opt_step"} | {f"{kind}.{self.names[i]}" for i in range(len(self.names)) for kind in self._kinds(i)}

    def optimizer_state(self) -> dict[str, np.ndarray]:
        """This rank's part of the state (all of it unless sharded); views of live memory on CPU."""
        out: dict[str, np.ndarray] = {"opt_step": np.asarray(self.opt_step.asnumpy(), dtype=np.int64)}
        for k, (m, v, master, has_master) in enumerate(zip(self.exp_avg, self.exp_avg_sq, self.own_masters, self._own_has_master)):
            out[self._key(k, "exp_avg")] = m.asnumpy()
            out[self._key(k, "exp_avg_sq")] = v.asnumpy()
            if has_master:
                out[self._key(k, "master")] = master.asnumpy()
        return out

    def keys_to_read(self, available: set[str]) -> set[str]:
        """The stored keys this rank's part is assembled from: its own names, or any stored slice
        (or whole tensor) overlapping one of its units."""
        want: dict[str, tuple[int, int]] = {"opt_step": (0, 1)}
        for k, i in enumerate(self.own):
            for kind in self._kinds(i):
                want[f"{kind}.{self.names[i]}"] = self._own_bounds[k]
        out = set()
        for key in available:
            name, rng = parse_key(key)
            if name in want and (rng is None or (rng[0] < want[name][1] and want[name][0] < rng[1])):
                out.add(key)
        return out

    def _assemble(self, tensors: dict[str, np.ndarray], name: str, k: int) -> np.ndarray:
        """Owned unit k's part of logical tensor `name`, from the stored whole tensor or the stored
        slices in `tensors`, shaped like this rank's state tensor (1-D for a slice)."""
        from mspretrain.errors import UserError

        i, (a, b) = self.own[k], self._own_bounds[k]
        if name in tensors:  # written whole (by an unsplit run)
            flat = np.asarray(tensors[name], dtype=np.float32).reshape(-1)[a:b]
        else:
            flat, covered = np.empty(b - a, np.float32), 0
            for key, value in tensors.items():
                kname, rng = parse_key(key)
                lo, hi = (max(a, rng[0]), min(b, rng[1])) if kname == name and rng is not None else (0, 0)
                if lo < hi:
                    flat[lo - a:hi - a] = np.asarray(value, dtype=np.float32).reshape(-1)[lo - rng[0]:hi - rng[0]]
                    covered += hi - lo
            if covered != b - a:  # the writers' slices tile each tensor: a gap is a missing or foreign shard
                raise UserError(f"the checkpoint's slices of {name} cover {covered:,} of its elements [{a:,}, {b:,})",
                                "resume from another checkpoint (`mspretrain checkpoints RUN` lists them)")
        return flat.copy() if self._own_split[k] else flat.reshape(self.params[i].shape).copy()

    def load_optimizer_state(self, tensors: dict[str, np.ndarray], available: set[str] | None = None) -> None:
        """Load this rank's part from `tensors` (stored keys: whole tensors and/or slices).
        `available`: every key the checkpoint holds (all shards), checked against the whole model
        so a checkpoint of another model is refused even when the part this rank reads happens to match."""
        from mspretrain.errors import UserError

        have = {parse_key(k)[0] for k in (set(tensors) if available is None else available)}
        full = self.state_keys()
        missing, unexpected = full - have, have - full
        if missing or unexpected:
            if all(k.startswith("master.") for k in missing | unexpected):
                raise UserError("precision.param_dtype differs from the run that wrote the checkpoint (fp32 master copies "
                                + ("missing)" if missing else "unexpected)"), "resume with the precision.param_dtype of the checkpoint's config.toml")
            param_of = lambda keys: {k.split(".", 1)[1] for k in keys if "." in k}  # exp_avg.NAME -> NAME
            lacking, extra = param_of(missing), param_of(unexpected)
            if "opt_step" in have and lacking | extra and lacking | extra <= {p.name for p in self.params + self.frozen}:
                # the same model with other parameters trained (train.trainable changed)
                what = [f"no optimizer state for {len(lacking)} of the {len(self.names)} parameters trained now"] if lacking else []
                what += [f"optimizer state for {len(extra)} parameters frozen now"] if extra else []
                raise UserError(f"train.trainable differs from the run that wrote the checkpoint: it has {' and '.join(what)}",
                                "resume with the train.trainable of the checkpoint's config.toml, "
                                "or start a new run from its weights with --init-from")
            raise UserError(f"optimizer state does not match the model (missing {sorted(missing)[:3]}, "
                            f"unexpected {sorted(unexpected)[:3]})",
                            "resume with the model config the checkpoint was written with")
        self.opt_step.set_data(Tensor(int(np.asarray(tensors["opt_step"]).reshape(-1)[0]), ms.int32))
        for k, (i, m, v, master) in enumerate(zip(self.own, self.exp_avg, self.exp_avg_sq, self.own_masters)):
            m.set_data(Tensor(self._assemble(tensors, f"exp_avg.{self.names[i]}", k)))
            v.set_data(Tensor(self._assemble(tensors, f"exp_avg_sq.{self.names[i]}", k)))
            if self._own_has_master[k]:
                master.set_data(Tensor(self._assemble(tensors, f"master.{self.names[i]}", k)))
            elif self._own_separate[k]:  # an fp32 split parameter: its master is the slice of the weights just loaded
                master.set_data(Tensor(self._flat_value(k)))
