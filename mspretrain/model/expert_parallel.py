"""Expert parallel (`parallel.ep`, issue 52.3): the dispatch and combine collectives of an MoE layer
whose experts are split over the ranks of an ep group (model/moe.py `MoE.apply_ep`), and the
record of the cut (`ExpertSplit`) the train step and the checkpoints read.

The form (AllGather + ReduceScatter, on every device). Each rank of the ep group routes its own
tokens (the router is whole and replicated), then:
1. dispatch: the tokens' hidden states and their routing weights, packed (N, D + K), are gathered
   over the ep group (`GatherRows`: every rank now sees the ep group's n*N tokens, in rank order),
   and their expert ids (`GatherIds`, forward only: no gradient);
2. each rank runs its E/ep local experts on the assignments that chose them; the others
   contribute zero (their routing weight is masked to 0);
3. combine: the (n*N, D) partial outputs are summed over the ep group and each rank keeps its own
   N rows (`ScatterRows`, a ReduceScatter).
AllGather's gradient is a ReduceScatter and ReduceScatter's an AllGather (MindSpore 2.10
ops/_grad_experimental/grad_comm_ops.py, get_bprop_all_gather / get_bprop_reduce_scatter), written
out here as each cell's bprop so that both device forms have them: so an expert's weight
gradient sums every ep rank's tokens routed to it, and a token's hidden-state and routing-weight
gradients return to its own rank.

By device: on Ascend the HCCL primitives AllGather and ReduceScatter of the ep group; on CPU,
where MindSpore 2.10's mccl has no ReduceScatter kernel and fails on a second AllGather in one
graph (model/parallel.py, step/zero_setup.py), their AllReduce forms: a gather is the sum of each
rank's rows placed in its own slot of a zero buffer, a reduce-scatter is the sum with this rank's
slot kept (the same numbers: sums with zeros are exact). The CPU form moves ep times the bytes.

Not built: MindSpore 2.10's `ops.AlltoAll` / `AlltoAllV` dispatch (comm_ops.py; MindSpore
Transformers' token dispatcher sends each token only to the ranks of its experts). Here every
rank of the ep group sees every token of the group and computes its local experts on all the
group's assignments with the non-local ones masked (static shapes): the expert FLOPs per rank are
ep times what an AllToAll dispatch would give. Correct on every device, not fast.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mindspore as ms
from mindspore import Tensor, nn, ops


@dataclass(frozen=True)
class ExpertSplit:
    """What `Decoder.apply_ep` made of a whole model: the ep group (model/parallel.py `Group`), the
    whole shapes of the expert stacks it cut and where this rank's piece of each lies
    (model/params.py `ep_piece`: (0, [(start, stop)]) along the experts)."""
    group: Any
    whole_shapes: dict[str, tuple[int, ...]]
    where: dict[str, tuple[int, list[tuple[int, int]]]]


def native(group: Any) -> bool:
    """The HCCL primitives (Ascend) or the AllReduce forms (CPU's mccl), by the group's device."""
    return group.device == "ascend"


def in_slot(x: Tensor, slot: int, size: int) -> Tensor:
    """x (N, ...) in slot `slot` of a zero (size*N, ...) buffer: one rank's share of the CPU forms'
    AllReduce, which sums every rank's share into the gathered rows."""
    parts = [x]
    if slot:
        parts = [ops.zeros((slot * x.shape[0],) + x.shape[1:], x.dtype)] + parts
    if size - slot - 1:
        parts = parts + [ops.zeros(((size - slot - 1) * x.shape[0],) + x.shape[1:], x.dtype)]
    return ops.concat(parts, 0)


class GatherRows(nn.Cell):
    """x (N, ...) on each of the group's n ranks -> (n*N, ...): the ranks' rows in group order.
    Backward: the gradient summed over the group, this rank's N rows kept (a ReduceScatter)."""

    def __init__(self, group: Any) -> None:
        super().__init__()
        self.native = native(group)
        self.size, self.slot = group.size, group.rank
        if self.native:
            self.gather, self.scatter = group.all_gather(), group.reduce_scatter()
        else:
            self.sum, self.back = group.all_reduce(), group.all_reduce()

    def construct(self, x: Tensor) -> Tensor:
        if self.native:
            return self.gather(x)
        return self.sum(in_slot(x, self.slot, self.size))

    def bprop(self, x: Tensor, out: Tensor, dout: Tensor) -> tuple[Tensor]:
        if self.native:
            return (self.scatter(dout),)
        n = x.shape[0]
        return (self.back(dout)[self.slot * n:(self.slot + 1) * n],)


class ScatterRows(nn.Cell):
    """y (n*N, ...) partial on each rank -> (N, ...): the group's sum, this rank's N rows.
    Backward: the gradient of every rank's rows gathered (an AllGather)."""

    def __init__(self, group: Any) -> None:
        super().__init__()
        self.native = native(group)
        self.size, self.slot = group.size, group.rank
        if self.native:
            self.scatter, self.gather = group.reduce_scatter(), group.all_gather()
        else:
            self.sum, self.back = group.all_reduce(), group.all_reduce()

    def construct(self, y: Tensor) -> Tensor:
        if self.native:
            return self.scatter(y)
        n = y.shape[0] // self.size
        return self.sum(y)[self.slot * n:(self.slot + 1) * n]

    def bprop(self, y: Tensor, out: Tensor, dout: Tensor) -> tuple[Tensor]:
        if self.native:
            return (self.gather(dout),)
        return (self.back(in_slot(dout, self.slot, self.size)),)


class GatherIds(nn.Cell):
    """The expert ids (N, K) int32 of the group's tokens, (n*N, K), forward only (no gradient).
    Carried as fp32 (exact below 2^24 experts) so that the CPU form is a sum like the others."""

    def __init__(self, group: Any) -> None:
        super().__init__()
        self.native = native(group)
        self.size, self.slot = group.size, group.rank
        self.op = group.all_gather() if self.native else group.all_reduce()

    def construct(self, idx: Tensor, after: Tensor) -> Tensor:
        x = ops.depend(ops.stop_gradient(idx).astype(ms.float32), after)  # issued after `after` (the rows' gather) on every rank
        if not self.native:
            x = in_slot(x, self.slot, self.size)
        return ops.stop_gradient(self.op(x)).astype(ms.int32)
