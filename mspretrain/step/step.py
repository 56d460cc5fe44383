"""The numerics of one optimizer step, compiled: forward, loss, accumulation, loss scale,
reduction over ranks, clipping, AdamW. Nothing here knows about data files, logging or checkpoints.
Who owns what and the collectives' tables are planned in `step/zero_setup.py`; the optimizer
state (moments, masters, step counter) and its checkpoint names live in `step/state_codec.py`;
the loss it differentiates is `step/objective.py`'s, and the graph code of the reduction, the
update and the gather `step/update.py`'s. The layout of the ranks (the data-parallel world and
rank, the ZeRO level) is the run's parallel plan (mspretrain/parallel/plan.py, `self.plan`), and
under tensor parallel what the cut made of the model (model/parallel.py `TPSplit`) is handed in.

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

Sharding over data-parallel ranks (parallel/layout.py has the tables):
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
  r owns slice r of its flattened elements (parallel/layout.py `slice_bounds`), keeps 1-D moments and
  an fp32 master of that slice (for an fp32 parameter too: the kernel updates a Parameter in place,
  and the slice is not one), updates it, and the gather writes the whole tensor on every rank.
  Its gradient crosses ranks as its own bucket (ZeRO-2: reduce-scattered straight into the
  slices) or is all-reduced whole and sliced (ZeRO-1). Each element's update is the same AdamW
  arithmetic whichever rank does it, so the numbers are those of the whole tensor.
- `shard_params` (ZeRO-3, implies `shard_grads`; step/zero3.py): the model itself holds rank r's
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
equal those of fp32 parameters bit for bit (tests/step/test_memory_options.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from mspretrain.config.schema import OptimConfig
from mspretrain.model.decoder import Decoder
from mspretrain.model.groups import trainable_mask
from mspretrain.model.parallel import Group, PartialSum, TPSplit
from mspretrain.model.params import decays
from mspretrain.parallel.layout import assign_owners
from mspretrain.parallel.plan import ParallelPlan
from mspretrain.parallel.shard_key import parse_shard_key as parse_key
from mspretrain.parallel.shard_key import shard_key as slice_key
from mspretrain.step.objective import make_objective
from mspretrain.step.state_codec import OptimizerState
from mspretrain.step.update import StepUpdate
from mspretrain.step.zero_setup import make_collectives, plan_zero

# assign_owners, parse_key and slice_key: the names tests and step/tp.py have imported from here
__all__ = ["TrainStep", "StepResult", "decay_mask", "assign_owners", "parse_key", "slice_key"]


def decay_mask(names: list[str], decay_embeddings: bool) -> list[bool]:
    """No weight decay on norms and biases; on embeddings only when asked (model/params.py's `decay` column)."""
    return [decays(n, decay_embeddings) for n in names]


@dataclass
class StepResult:
    loss: float  # mean token NLL over the global batch (z-loss excluded)
    grad_norm: float  # global norm of the unscaled gradients, before clipping
    finite: bool  # False: overflow, the update was skipped
    # this rank's rows, in micro-batch order: summed token NLL of each sample (per-source loss,
    # spike forensics); a (B,) vector per micro-batch, read back with the loss
    row_nll: np.ndarray | None = None
    # MoE (issue 52.6): expert-load metrics of this rank's tokens of the step (model/moe.py `load_metrics`)
    moe: dict[str, float] | None = None


class TrainStep(StepUpdate):
    """Holds the optimizer state and the compiled step functions for one model."""

    def __init__(self, model: nn.Cell, optim: OptimConfig, *, global_tokens: int, world: int = 1,
                 rank: int = 0, jit: bool = True, allreduce_fp16: bool = False, shard: bool = False,
                 shard_grads: bool = False, half_params: list[str] | None = None,
                 bucket_mb: float | str = "auto", device: str = "cpu", accumulation: int | None = None,
                 jit_level: str = "O0", trainable: list[str] | tuple[str, ...] | None = None,
                 split_mb: float | str = "auto", shard_params: bool = False, comm: Any = None,
                 plan: ParallelPlan | None = None, tp: TPSplit | None = None, ep: Any = None, edp: Any = None) -> None:
        """half_params: names of parameters to store in the model's compute dtype from now on;
        their fp32 values become master copies held with the optimizer state (by their owner).
        bucket_mb: cap of one collective's flat buffer (0 = one collective per parameter; "auto": by
        device, parallel/layout.py `bucket_mb_for`).
        accumulation: micro-batches per step, when known (> 1 allocates the buffers now).
        jit_level: MindSpore's graph optimisation level for the compiled functions (device.jit_level).
        trainable: parameter groups to train (train.trainable); None or ["all"]: every parameter.
        split_mb: with sharding, parameters of at least this many MB (4 bytes an element) are cut
        into a slice per rank ("auto": the bucket cap; 0: never; parallel/layout.py `split_elements_for`).
        shard_params: ZeRO-3 (implies shard_grads): the model's trained parameters become this rank's
        slices, gathered where they are used and reduce-scattered in the backward (step/zero3.py).
        comm: the data-parallel group (model/parallel.py `Group`) when it is not the world (tensor
        parallel, step/tp.py).
        plan: the run's parallel plan (mspretrain/parallel/plan.py, built by train/build.py): the
        data-parallel world, rank and ZeRO level then come from it, not from `world`, `rank` and
        the shard flags; without one the step makes the plan those arguments describe (`self.plan`).
        tp: what `Decoder.apply_tp` made of the model (model/parallel.py `TPSplit`), under tensor parallel.
        ep, edp: under expert parallel, what `Decoder.apply_ep` made of the model
        (model/expert_parallel.py `ExpertSplit`, its `group` the ep group) and the expert-data-parallel
        group (model/parallel.py `Group`; step/ep.py passes both)."""
        if plan is None:  # the data-parallel plan these arguments describe (tensor parallel: step/tp.py passes its own)
            plan = ParallelPlan(world=world, rank=rank, zero=3 if shard_params else 2 if shard_grads else 1 if shard else 0)
        else:  # the step runs over the dp group: its world and rank are the plan's data-parallel ones
            world, rank = plan.dp, plan.dp_rank
            shard, shard_grads, shard_params = plan.zero >= 1, plan.zero >= 2, plan.zero == 3
        self.plan = plan
        self.model = model
        # a Decoder (model/decoder.py) declares its tying and its config; a toy model (the tests') has neither
        decoder = model if isinstance(model, Decoder) else None
        every = tuple(model.trainable_params())
        keep = trainable_mask([p.name for p in every], trainable, tied=decoder is not None and decoder.tied)
        # ZeRO-3: the trained parameters are cut into slices now, before any table below is built
        self.zero3 = plan.zero3  # shard_params over more than one data-parallel rank
        full_size = {p.name: int(np.prod(p.shape)) for p in every}
        if self.zero3:
            from mspretrain.step.zero3 import shard_model, sharded_names

            names = [p.name for p, k in zip(every, keep) if k]
            # no reference to the whole weights while they are cut: drawn lazily on an NPU
            # (model/decoder.py LazyDraw), each is then read, cut and dropped, one at a time
            every = ()
            shard_model(model, sharded_names(model, names, world), world, rank, device)
            for p in model.get_parameters():  # frozen weights the cut did not read: drawn now, whole
                if p.has_init:
                    p.init_data()
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
        # ---- who owns what, and the collectives' tables (step/zero_setup.py); graph code reads
        # plain lists, so the fields it uses are copied onto the step
        z = self.zero_setup = plan_zero(self.params, self.sizes, half, model.dtype if half else None, world=world, rank=rank, device=device,
                                        zero3=self.zero3, shard=shard, shard_grads=shard_grads, allreduce_fp16=allreduce_fp16,
                                        bucket_mb=bucket_mb, split_mb=split_mb,
                                        expert=[n in ep.whole_shapes for n in self.names] if ep is not None else None)
        self.layout, self.owner, o = z.layout, z.owner, z.ownership
        self.shard_grads, self.sharded = self.layout.shard_grads, self.layout.sharded
        self.own, self._own_split, self._own_bounds = o.own, o.split, o.bounds
        self._own_has_master, self._own_separate = o.has_master, o.separate
        # ---- the optimizer state (step/state_codec.py): masters are taken before the rounding below
        self.state = OptimizerState(self.params, self.frozen, o, optim.moment_dtype, device)
        self._moments_rounded, self._moment_dtype = self.state.rounded, self.state.moment_dtype
        self.own_masters, self.exp_avg, self.exp_avg_sq = self.state.masters, self.state.exp_avg, self.state.exp_avg_sq
        self.opt_step = self.state.opt_step
        for p in self.params + self.frozen:
            if p.name in half:
                p.set_dtype(model.dtype)
        self.loss_accum = Parameter(Tensor(0.0, ms.float32), name="loss_accum", requires_grad=False)
        self.accum: ms.ParameterTuple | None = None  # fp32, for the parameters whose gradients this rank sums
        self._full_state: Callable[[], dict[str, np.ndarray]] | None = None  # ZeRO-3: the compiled gather of the whole weights
        self.wire, self._pdtype = z.wire, z.pdtype
        self._ar, self._rs, self._rs_single, self._ag, self._ag_single = z.ar, z.rs, z.rs_single, z.ag, z.ag_single
        self._schedule, self._order, self._norm_order = z.schedule, z.order, z.norm_order
        # Tensor parallel (model/parallel.py): the squared norm is summed over the tp group, where a
        # replicated parameter (a norm weight, the same gradient on every tp rank) counts 1/tp times.
        self.tp = tp.group if tp is not None else None
        split = tp.whole_shapes if tp is not None else {}
        self._sq_weight = [1.0 / self.tp.size if self.tp is not None and self.names[i] not in split else 1.0 for i in self._order]
        self.tp_sum = self.tp.all_reduce() if self.tp is not None else None
        # Expert parallel: the expert stacks' gradients are reduced over the expert-data-parallel
        # group (`edp_sum`, none with one rank there), their squares summed over the ep group (`ep_sum`)
        self._ex = z.ex
        self._expert_at = [ep is not None and self.names[i] in ep.whole_shapes for i in self._order]
        # ZeRO-2 (sharded gradients): the norm's squares are summed over the world, each rank's owned
        # part, and the expert part of edp rank 0 of each ep group only (the edp ranks hold the same
        # experts' gradients whole: each expert once); else the replicated part plus the ep group's sum
        self.ep_sum = ep.group.all_reduce() if ep is not None and not self.shard_grads else None
        self.edp_sum = edp.all_reduce() if ep is not None and edp is not None and edp.size > 1 else None
        self._expert_sq = ep is not None and (not self.shard_grads or edp is None or edp.rank == 0)
        partial = [i for i, n in enumerate(self.names) if tp is not None and n in tp.partial]
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
        # tests/step/test_collective_sequence.py compiles the Ascend path for each rank (ZeRO-2 at worlds
        # 2 and 8, ZeRO-1 at 4, ZeRO-3 at 2 and 4 and on an MoE at 2, tensor parallel at 2 and 4,
        # expert parallel at 2, 4 and 8 with ZeRO 0-2) and compares their ordered collectives.
        self._chain = device != "ascend"
        self._own_pos, self._own_cut = z.own_pos, z.own_cut
        self._order_shape, self._order_pos = z.order_shape, z.order_pos
        comms = make_collectives(z, comm, world=world, rank=rank, device=device)
        self.allreduce, self._reduce_scatters, self._allgathers, self._bcast = (
            comms.allreduce, comms.reduce_scatters, comms.allgathers, comms.bcast)
        self._adamw = ops.AdamWeightDecay()
        self._jit = (lambda fn: ms.jit(fn, jit_level=jit_level)) if jit else None

        # the loss of a micro-batch (step/objective.py); tensor parallel: over this rank's vocabulary columns
        objective = make_objective(model, optim, global_tokens=self.global_tokens, device=device,
                                   cfg=decoder.cfg if decoder is not None else None,
                                   tp_loss=decoder.tp_loss if tp is not None and decoder is not None else None,
                                   stats_group=(comm or Group(tuple(range(world)), rank, device=device)) if world > 1 else None)
        self._plain_sums = objective.plain_sums
        self.moe_layers, self.moe_k = objective.moe_layers, objective.moe_k
        self._moe_rows, self._bias_rate = objective.moe_rows, objective.bias_rate
        # The biases move by the step's counts: with data parallel (any ZeRO) the routing stats the
        # step returns are the world's sums (step/objective.py), the same on every rank, so every
        # rank moves its whole copy of the biases as one process would. Under expert parallel or
        # tensor parallel (config/schema.py `check_moe` refuses both with the bias) they are not.
        if self._bias_rate > 0 and (ep is not None or tp is not None):
            from mspretrain.errors import UserError

            raise UserError("model.router_bias_update_rate is not supported with expert or tensor parallel yet",
                            "train with parallel.ep=1 and parallel.tp=1, or set model.router_bias_update_rate = 0")
        moe_stats = objective.moe_stats
        self._grad_fn = ms.value_and_grad(objective.fn, None, self.params, has_aux=True)

        def fused(tokens, positions, segments, scale, lr, inv_scale):
            (_, nll_sum, rows), grads = self._grad_fn(tokens, positions, segments, scale)
            reduced, last = self._reduce(list(grads))
            loss_sum = nll_sum if self.allreduce is None else self.allreduce(ops.depend(nll_sum, last))
            loss_sum, finite, norm = self._finish(reduced, loss_sum, lr, inv_scale)
            return loss_sum, finite, norm, rows

        def fused_moe(tokens, positions, segments, scale, lr, inv_scale):  # `fused` and the routing stats
            (_, nll_sum, rows, per), grads = self._grad_fn(tokens, positions, segments, scale)
            reduced, last = self._reduce(list(grads))
            loss_sum = nll_sum if self.allreduce is None else self.allreduce(ops.depend(nll_sum, last))
            loss_sum, finite, norm = self._finish(reduced, loss_sum, lr, inv_scale)
            return loss_sum, finite, norm, (rows, per)

        if moe_stats:
            fused = fused_moe
        self._fused: Callable[..., Any] = self._jit(fused) if self._jit else fused
        self._accumulate: Callable[..., Any] | None = None
        self._apply: Callable[..., Any] | None = None
        self._moe_stats = moe_stats
        if accumulation is not None and accumulation > 1:
            self._ensure_accum()

    def _ensure_accum(self) -> None:
        if self.accum is not None:
            return
        # in `self._order`: the order `_reduce` produces and `_finish` reads
        self.accum = ms.ParameterTuple([Parameter(ops.zeros(shape, ms.float32), f"accum.{self.names[i]}", False)
                                        for i, shape in zip(self._order, self._order_shape)])  # positional: see step/state_codec.py

        # The first micro-batch of a step overwrites the buffers instead of adding to them, so
        # `apply` never zeroes them: a zeroing assign there is ordered before the reads of the same
        # buffers (measured: grad norm 0), and copying them first is the full-size transient this
        # step avoids. `where`, not a multiply by 0: an overflowed step leaves inf in the buffers.
        moe_stats = self._moe_stats

        def add(grads, nll_sum, first):  # one micro-batch's gradients and NLL into the buffers
            if self.shard_grads:  # reduce every micro-batch; keep only the owned sums
                grads, last = self._reduce(list(grads))
                nll_sum = ops.depend(nll_sum, last)  # keeps every collective in every rank's graph
            else:
                grads = [grads[i].astype(ms.float32) for i in self._order]
            for acc, g in zip(self.accum, grads):
                # a full-size condition: Select with a 0-d operand holds 24 B per element (see _finish)
                ops.assign(acc, ops.where(ops.broadcast_to(first, acc.shape), g, acc + g))
            ops.assign(self.loss_accum, ops.where(first, nll_sum, self.loss_accum + nll_sum))
            return nll_sum

        def accumulate(tokens, positions, segments, scale, first):
            (_, nll_sum, rows), grads = self._grad_fn(tokens, positions, segments, scale)
            return add(grads, nll_sum, first), rows

        def accumulate_moe(tokens, positions, segments, scale, first):  # and the routing stats
            (_, nll_sum, rows, per), grads = self._grad_fn(tokens, positions, segments, scale)
            return add(grads, nll_sum, first), (rows, per)

        if moe_stats:
            accumulate = accumulate_moe

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
        moe = None
        if self._moe_stats:  # (rows, per-layer routing stats) per micro-batch, read back with the rows
            from mspretrain.model.moe import load_metrics

            per = sum(p.asnumpy().astype(np.float64) for _, p in row_parts)
            row_parts = [r for r, _ in row_parts]
            moe = load_metrics(per, self.moe_layers, self.moe_k, self._moe_rows)
            if self._bias_rate > 0 and bool(finite.asnumpy()):  # aux-loss-free balancing (model/moe.py); a skipped step moves nothing
                from mspretrain.model.moe import update_expert_bias

                update_expert_bias(self.model, self.moe_layers, per[:, 1], self._bias_rate)
        return StepResult(loss=float(loss_sum.asnumpy()) / self.global_tokens,
                          grad_norm=float(norm.asnumpy()), finite=bool(finite.asnumpy()),
                          row_nll=np.concatenate([r.asnumpy() for r in row_parts]), moe=moe)

    # ----------------------------------------------------------------- weights
    def full_weights(self) -> dict[str, np.ndarray]:
        """Every parameter whole by name (what a checkpoint's model file holds), fp16 ones as fp16,
        the rest fp32: the model's own under ZeRO-0/1/2; gathered under ZeRO-3, a collective that
        every rank must call (step/zero3.py `full_state`)."""
        from mspretrain.model.decoder import state_numpy

        if not self.zero3:
            return state_numpy(self.model, keep_fp16=True)
        from mspretrain.step.zero3 import full_state

        if self._full_state is None:
            self._full_state = full_state(self.model, jit=self._jit is not None)
        return {k: v.copy() for k, v in self._full_state().items()}

    def weights_digest(self) -> str:
        """sha256 of every parameter whole, by name in name order (the bytes `full_weights` gives),
        read one parameter at a time: under ZeRO-3 each gathered alone (step/zero3.py
        `one_at_a_time`), never the whole model at once. A collective under ZeRO-3: every rank calls it."""
        import hashlib

        if self.zero3:
            from mspretrain.step.zero3 import one_at_a_time

            items = one_at_a_time(self.model, self.world, self.rank, self.device, jit=self._jit is not None)()
        else:
            items = iter(sorted(self.full_weights().items()))
        h = hashlib.sha256()
        for name, arr in items:
            h.update(name.encode())
            h.update(np.ascontiguousarray(arr).tobytes())
        return h.hexdigest()

    def load_weights(self, tensors: dict[str, np.ndarray]) -> None:
        """Whole tensors (a checkpoint's model file, written by any layout) into the model: whole,
        or under ZeRO-3 this rank's slices of them."""
        from mspretrain.model.decoder import load_numpy

        if not self.zero3:
            load_numpy(self.model, tensors)
            return
        from mspretrain.step.zero3 import load_full_state

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
        """Collective calls and bytes handed to them per step (parallel/layout.py `Layout.traffic`)."""
        calls, nbytes = self.layout.traffic(accumulation)
        return {"calls": calls, "bytes": nbytes}

    # ----------------------------------------------------------------- state (step/state_codec.py)
    def _kinds(self, i: int) -> tuple[str, ...]:
        return self.state.kinds(i)

    def state_keys(self, owned_only: bool = False) -> set[str]:
        """Tensor names of the optimizer state: all of it (logical names), or the part this rank
        holds (as it writes them: a split parameter's slices by `shard_key`)."""
        return self.state.keys(owned_only)

    def optimizer_state(self) -> dict[str, np.ndarray]:
        """This rank's part of the state (all of it unless sharded); views of live memory on CPU."""
        return self.state.tensors()

    def keys_to_read(self, available: set[str]) -> set[str]:
        """The stored keys this rank's part is assembled from (slices overlapping its own included)."""
        return self.state.keys_to_read(available)

    def load_optimizer_state(self, tensors: dict[str, np.ndarray], available: set[str] | None = None) -> None:
        """Load this rank's part from `tensors` (stored keys: whole tensors and/or slices), checked
        against the whole model's keys in `available`."""
        self.state.load(tensors, available)
