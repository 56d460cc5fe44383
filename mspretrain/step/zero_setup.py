"""The ZeRO set-up of a train step: who owns which parameter (or slice of one), and the tables of
collectives that move the gradients to their owners and the updated weights back.

Split out of `step/step.py`, which compiles the step from what is built here. The tables are
pure (`parallel/layout.py` plans them); this module turns them into what graph code reads: plain
lists and tuples of ints and MindSpore dtypes (graph code reads no dataclasses, dicts or
generators, so `TrainStep` copies the fields it uses onto itself), plus the collective primitives
of the data-parallel group. Sharding levels (ZeRO-1/2/3, split parameters) are described in
`step/step.py`'s docstring.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mindspore as ms
import numpy as np
from mindspore import Parameter

from mspretrain.model.parallel import Group
from mspretrain.model.params import fp16_wire
from mspretrain.parallel.layout import Layout, bucket_mb_for, cap_elements, plan_layout, readiness, split_elements_for, zero3_layout
from mspretrain.parallel.shard_key import shard_key


@dataclass
class Ownership:
    """The units of optimizer state this rank holds: `own[k]` is a parameter index, whole or (split)
    the slice `bounds[k]` of its flattened elements."""

    names: list[str]  # the trained parameters' names, indexed like the step's `params`
    own: list[int]
    split: list[bool]
    bounds: list[tuple[int, int]]  # [start, stop) of the flattened parameter
    # an fp32 copy of a half-precision parameter, kept in the checkpoint (fp32 ones are the weights)
    has_master: list[bool]
    # a master tensor of its own: a half one, or a split fp32 one (a slice of a Parameter is not a
    # Parameter the update kernel can write); under ZeRO-3 an fp32 slice is its own master
    separate: list[bool]
    zero3: bool

    def key(self, k: int, prefix: str) -> str:
        """State key of owned unit k's `prefix` tensor: the plain name, or the slice's (`shard_key`)."""
        key = f"{prefix}.{self.names[self.own[k]]}"
        return shard_key(key, *self.bounds[k]) if self.split[k] else key

    def flat_value(self, params: tuple[Parameter, ...], k: int) -> np.ndarray:
        """Owned unit k's current values in fp32, shaped like its state (a copy)."""
        value = params[self.own[k]].asnumpy().astype(np.float32)
        if not self.split[k] or self.zero3:  # whole, or (ZeRO-3) the Parameter is the slice
            return value.copy()
        a, b = self.bounds[k]
        return value.reshape(-1)[a:b].copy()


@dataclass
class ZeroSetup:
    """The layout, this rank's ownership and the collective tables of one step (module docstring)."""

    layout: Layout
    owner: list[int]
    ownership: Ownership
    wire: list[Any]  # dtype of each gradient on the wire
    pdtype: list[Any]  # dtype each parameter is stored in
    ar: list[tuple]  # AllReduce buckets: (indices, sizes, wire dtype)
    rs: list[tuple]  # ReduceScatter buckets: (segments, sizes, length, used per rank, wire dtype, split)
    rs_single: list[int]  # parameters too lopsided to bucket: AllReduce, the owner keeps it
    ag: list[tuple]  # AllGather buckets: (segments, sizes, length, used, dtype, position of the split slice in own or -1)
    ag_single: list[int]  # unbucketed parameters: one Broadcast each, from the owner
    schedule: list[tuple[int, int]]  # (kind, index) of every reduction, in gradient-readiness order
    order: list[int]  # the parameter indices `_reduce` produces gradients for, in that order
    norm_order: list[int]  # positions in `order`, in parameter order (the norm's summation order)
    own_pos: list[int]  # position of each owned unit's gradient in `order`
    own_cut: list[tuple[int, int] | None]  # a whole gradient of a split parameter: the owned slice to cut
    order_shape: list[tuple[int, ...]]  # shape of each gradient in `order` (the accumulation buffers)
    order_pos: list[int]  # position of each parameter in `order`, -1 if absent
    # expert parallel: the expert stacks' bucket (indices, sizes, wire dtype), reduced over the
    # expert-data-parallel group instead of the world (schedule kind 3); None without experts cut
    ex: tuple | None = None


def plan_zero(params: tuple[Parameter, ...], sizes: list[int], half: set[str], compute_dtype: Any, *, world: int, rank: int,
              device: str, zero3: bool, shard: bool, shard_grads: bool, allreduce_fp16: bool,
              bucket_mb: float | str, split_mb: float | str, expert: list[bool] | None = None) -> ZeroSetup:
    """The step's tables for the trained `params` (whole `sizes`; ZeRO-3 holds slices of them),
    planned before any parameter is rounded to the compute dtype; the `half` ones will be stored
    in `compute_dtype` (None when there are none: a test model may have no dtype). `expert`: per
    parameter, an expert stack cut by expert parallel (no ZeRO then): those leave the world's
    buckets for one bucket of their own, reduced over the expert-data-parallel group."""
    names = [p.name for p in params]
    # fp16 on the wire for every gradient but lm_head's (the field report's exemption; the parameter
    # table's `fp16_wire` column, model/params.py)
    cap = cap_elements(bucket_mb_for(bucket_mb, device))
    wire16 = [allreduce_fp16 and fp16_wire(n) for n in names]
    if zero3:  # every parameter split, no bucket: the gathers and reductions live in the model's graph
        layout = zero3_layout(sizes, [n in half for n in names], wire16, world)
    else:
        layout = plan_layout(sizes, [n in half for n in names], wire16, world, shard=shard, shard_grads=shard_grads, cap=cap,
                             split=split_elements_for(split_mb, cap), local=expert)
    owner = list(layout.owner) if layout.sharded else [rank] * len(params)
    # indices whose state (all of it, or a slice of a split parameter) lives here
    own = layout.owned(rank) if layout.sharded else list(range(len(params)))
    own_split = [layout.is_split(i) for i in own]
    has_master = [names[i] in half for i in own]
    ownership = Ownership(names, own, own_split, [layout.unit(i, rank) for i in own], has_master,
                          [h or (c and not zero3) for h, c in zip(has_master, own_split)], zero3)

    # As plain tuples of ints and dtypes: graph code reads no dataclasses, dicts or generators.
    wire = [ms.float16 if w else ms.float32 for w in layout.wire16]
    pdtype = [p.dtype if p.name not in half else compute_dtype for p in params]
    first = lambda b: next(seg for seg in b.segments if seg)[0]  # noqa: E731
    used = lambda b: tuple(b.used(r) for r in range(world))  # noqa: E731
    ar = [(b.indices, b.sizes, wire[b.indices[0]]) for b in layout.reduce_flat]
    rs = [(b.segments, b.sizes, b.length, used(b), wire[first(b)], b.split) for b in layout.reduce_rank]
    rs_single = list(layout.reduce_single)
    # MindSpore 2.10's CPU AllGather (mccl) fails to launch on fp16 (measured): on CPU half
    # parameters cross as fp32, which fp16 -> fp32 -> fp16 round-trips exactly; HCCL takes fp16.
    gather_dtype = lambda dt: ms.float32 if device != "ascend" and dt in (ms.float16, ms.bfloat16) else dt  # noqa: E731
    # a split bucket's last entry: the position of this rank's slice in `own` (-1: not split)
    ag = [(b.segments, b.sizes, b.length, used(b), gather_dtype(pdtype[first(b)]), own.index(first(b)) if b.split else -1)
          for b in layout.gather_rank]
    # `_reduce` returns the gradients it produces in this order (graph code cannot use dicts):
    # every index (replicated) or the owned ones (sharded), bucket by bucket
    # Every reduction collective in gradient-readiness order (parallel/layout.py `readiness`): the
    # buckets come sorted, and a lopsided singleton takes its place among them. kind 0: an
    # AllReduce bucket, 1: a ReduceScatter bucket, 2: one parameter's AllReduce.
    experts = [i for i, e in enumerate(expert or ()) if e]
    ex = None
    if experts:  # expert parallel: the stacks out of the world's buckets (ZeRO-2: they are in none, `LOCAL`)
        if zero3:
            raise ValueError("expert parallel with sharded parameters (ZeRO-3) is not built")
        ar = [(tuple(i for i in idx if i not in experts), tuple(n for i, n in zip(idx, sz) if i not in experts), w)
              for idx, sz, w in ar]
        ex = (tuple(experts), tuple(sizes[i] for i in experts), wire[experts[0]])
    sched = ([(readiness(b.indices), 0, k) for k, b in enumerate(layout.reduce_flat) if ar[k][0]]
             + ([(readiness(experts), 3, 0)] if experts else [])
             + [(readiness(i for seg in b.segments for i in seg), 1, k) for k, b in enumerate(layout.reduce_rank)]
             + [(i, 2, i) for i in rs_single])
    schedule = [(kind, k) for _, kind, k in sorted(sched, key=lambda t: -t[0])]
    if world == 1 or zero3:
        order = list(range(len(params)))
    else:
        produced = {0: lambda k: list(ar[k][0]), 1: lambda k: list(rs[k][0][rank]),
                    2: lambda i: [i] if owner[i] == rank else [], 3: lambda k: list(experts)}
        order = [i for kind, k in schedule for i in produced[kind](k)]
    # The squared norm sums per-parameter terms in parameter order whatever the bucket order, so
    # the bucketing (and the world size) does not change its rounding.
    norm_order = sorted(range(len(order)), key=lambda k: order[k])
    # where `_reduce` leaves a split parameter's gradient whole (replicated: ZeRO-1), the update
    # cuts the owned slice from it; with ZeRO-2 it arrives as the slice
    own_cut = [ab if cut and not layout.shard_grads else None for ab, cut in zip(ownership.bounds, own_split)]
    # shape of each gradient `_reduce` produces (the accumulation buffers): a slice is 1-D
    unit_len = lambda i: (lambda a, b: b - a)(*layout.unit(i, rank))  # noqa: E731
    order_shape = [(unit_len(i),) if layout.shard_grads and layout.is_split(i) else params[i].shape for i in order]
    return ZeroSetup(layout=layout, owner=owner, ownership=ownership, wire=wire, pdtype=pdtype, ar=ar, rs=rs,
                     rs_single=rs_single, ag=ag, ag_single=list(layout.gather_single), schedule=schedule, order=order,
                     norm_order=norm_order, own_pos=[order.index(i) for i in own], own_cut=own_cut, order_shape=order_shape,
                     order_pos=[order.index(i) if i in order else -1 for i in range(len(params))], ex=ex)


@dataclass
class Collectives:
    """The data-parallel group's primitives one step issues (None / empty where unused)."""

    allreduce: Any
    reduce_scatters: list[Any]
    allgathers: list[Any]
    bcast: list[Any]


def make_collectives(z: ZeroSetup, comm: Any, *, world: int, rank: int, device: str) -> Collectives:
    """One primitive per bucket (shapes differ between buckets), on `comm` or the whole world."""
    c = comm if comm is not None else Group(tuple(range(world)), rank, device=device)  # the world: the plain primitives
    return Collectives(
        allreduce=c.all_reduce() if world > 1 else None,
        # MindSpore 2.10: ReduceScatter has HCCL (Ascend) and NCCL kernels, none for CPU (mccl).
        reduce_scatters=[c.reduce_scatter() for _ in z.rs] if device == "ascend" else [],
        # AllGather on Ascend (HCCL), one per bucket. On CPU (mccl) a second AllGather in one graph
        # fails ("Memcpy error, dest size is 256, src size is 65536" in RingAllGather, measured with
        # one primitive per bucket too), so there each rank all-reduces the bucket with its own
        # segment in place and zeros elsewhere: the same numbers, selected by device.
        allgathers=[c.all_gather() for _ in z.ag] if device == "ascend" else [],
        # one Broadcast per unbucketed parameter, from its owner (a multi-tensor Broadcast mixes up
        # tensors of different shapes on CPU: wrong-rank assigns in graph mode, memcpy overlap errors eagerly)
        bcast=[c.broadcast(z.owner[i]) for i in z.ag_single])
