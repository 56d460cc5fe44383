"""Expert parallel (`parallel.ep`, issue 52.3): the dispatch and combine collectives of an MoE layer
whose experts are split over the ranks of an ep group (model/moe.py `MoE.apply_ep`), and the
record of the cut (`ExpertSplit`) the train step and the checkpoints read. Each rank of the ep
group routes its own tokens (the router is whole and replicated); two forms, chosen by device.

The AllToAll form (Ascend: `AllToAllRows`, `AllToAllIds`, `send_slots`; MoE.a2a_send / a2a_local /
a2a_receive). The send buffer has one slot of N rows per ep rank (N: this rank's tokens):
1. dispatch: slot r holds, in token order and first, the tokens with at least one of their K
   experts on rank r (a token once per rank, however many of its experts are there), each row its
   hidden state and its K routing weights (N, D + K), the rest of the slot zero rows; the ids of
   the rows' experts (whole-model ids, -1 on an empty row) go alongside. One AlltoAll (HCCL, dim 0:
   slot r to rank r) exchanges the rows, another the ids (forward only);
2. each rank runs its E/ep local experts on the assignments of the received rows that chose them
   (another rank's expert or an empty row weighs 0: `MoE.local_outputs`) and sums each row's;
3. combine: the reverse AlltoAll returns every row to its sender, which sums each token's rows
   from the ranks it was sent to.
The backward of an AlltoAll over dim 0 is the same exchange (MindSpore 2.10
ops/_grad_experimental/grad_comm_ops.py `get_bprop_all_to_all`), written out as each cell's bprop:
an expert's weight gradient sums the tokens every rank sent it, and a token's hidden-state and
routing-weight gradients return to its own rank.

Why static slots of N rows: the step is one compiled graph of static shapes, and routing is
dropless (no capacity with expert parallel), so a slot must hold the worst case, every token
choosing rank r: N rows. The bytes exchanged are then the gather form's (n*N rows of D + K
each way), and the experts run on n*N rows' assignments masked, as there: the same FLOPs. What an
AllToAll saves needs slots sized by the actual counts: MindSpore Transformers'
`MoEAlltoAllTokenDispatcher` (mindformers/parallel_core/training_graph/transformer/moe/
token_dispatcher.py: an AlltoAll of the per-expert counts, the splits copied to the host, AlltoAllV
of the permuted rows with `block_size` = hidden size, dynamic shapes) or a capacity that drops
tokens (modules/transformer/moe.py). This layout is the one AlltoAllV would send a prefix of (the
valid rows come first in each slot); not built: dynamic shapes in the step's graph, and
GroupedMatmul requires its group_list to cover every row (gen_ops_def.py `grouped_matmul`: "The
last number in group_list needs to be equal to the 0th dimension"), so empty rows cannot be
skipped in static shapes either. Only a 910B runs it: on CPU its exchanges are simulated
(tests/model/test_moe_ep.py, against the whole MoE, outputs and gradients) and its compiled
collectives checked on every rank (tests/step/test_collective_sequence.py, the EP cases).

The gather form (CPU, and the reference): the tokens' rows (N, D + K) gathered over the ep group
(`GatherRows`: every rank sees the group's n*N tokens, in rank order) with their expert ids
(`GatherIds`), each rank's experts run on all of them masked, the (n*N, D) partial outputs summed
over the group with this rank's N rows kept (`ScatterRows`). AllGather's gradient is a
ReduceScatter and ReduceScatter's an AllGather (grad_comm_ops.py, get_bprop_all_gather /
get_bprop_reduce_scatter), written out as each cell's bprop. MindSpore 2.10's mccl (CPU) has no
AlltoAll or AlltoAllV kernel (measured, 2 msrun ranks, a jit graph: "Unsupported op [AlltoAll] on
CPU"), no ReduceScatter, and fails on a second AllGather in one graph (model/parallel.py,
step/zero_setup.py), so on CPU these run as AllReduce sums: a gather is the sum of each rank's
rows placed in its own slot of a zero buffer, a reduce-scatter the sum with this rank's slot kept
(the same numbers: sums with zeros are exact; ep times the bytes). The cells keep HCCL's
AllGather / ReduceScatter forms (`native`) for the tests that check them.
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


# ----------------------------------------------------------------------------- the AllToAll form (Ascend)

def all_to_all(group: Any) -> Any:
    """HCCL's AlltoAll over `group` on dim 0: block r of this rank's (n*M, ...) buffer goes to group
    member r, the received blocks are concatenated in member order (MindSpore 2.10
    ops/operations/comm_ops.py `AlltoAll`, "Supported Platforms: Ascend")."""
    kw = {"group": group.name} if group.name else {}
    return ops.AlltoAll(group.size, 0, 0, **kw)


def send_slots(idx: Tensor, local_experts: int, ranks: int) -> tuple[Tensor, Tensor]:
    """The AllToAll form's layout of this rank's tokens (module docstring): idx (N, K) int32 whole-model
    expert ids, each rank holding `local_experts` adjacent experts -> (src (n*N,) int32: the token in
    each row of the send buffer, N for an empty row; dest (N, n) int32: each token's row in the send
    buffer's slot of rank r, n*N where it sends nothing to r). Slot r (rows r*N..(r+1)*N) holds the
    tokens with at least one expert on rank r, in token order, first; a token appears once per rank
    whatever the number of its experts there."""
    N, K = idx.shape
    n = ranks
    owner = ops.stop_gradient(idx) // local_experts  # (N, K) the rank of each choice's expert
    hit = ops.one_hot(owner.reshape(N * K), n, Tensor(1, ms.int32), Tensor(0, ms.int32)).reshape(N, K, n).sum(1)
    sent = (hit > 0).astype(ms.int32)  # (N, n) token sends to rank r
    pos = ops.cumsum(sent, 0) - 1  # its place in slot r
    base = ops.arange(0, n * N, N, dtype=ms.int32).reshape(1, n)
    dest = ops.select(sent > 0, base + pos, ops.fill(ms.int32, (N, n), n * N))  # n*N: not sent
    token = ops.broadcast_to(ops.arange(1, N + 1, dtype=ms.int32).reshape(N, 1), (N, n))
    # rows nobody fills keep 0 -> N; the not-sent entries all land on row n*N, cut off
    src = ops.scatter_nd(dest.reshape(N * n, 1), token.reshape(N * n), (n * N + 1,))[:n * N] - 1
    src = ops.select(src < 0, ops.fill(ms.int32, (n * N,), N), src)
    return ops.stop_gradient(src), ops.stop_gradient(dest)


class AllToAllRows(nn.Cell):
    """The exchange of the AllToAll form: (n*M, ...) -> (n*M, ...), block r to group member r.
    Backward: the reverse exchange, which for split and concat on the same dim is the same AlltoAll
    (MindSpore 2.10 ops/_grad_experimental/grad_comm_ops.py `get_bprop_all_to_all`:
    AlltoAll(split_count, concat_dim, split_dim)), written out as the other cells' bprops are."""

    def __init__(self, group: Any) -> None:
        super().__init__()
        self.size = group.size
        self.op, self.back = all_to_all(group), all_to_all(group)

    def construct(self, x: Tensor) -> Tensor:
        return self.op(x)

    def bprop(self, x: Tensor, out: Tensor, dout: Tensor) -> tuple[Tensor]:
        return (self.back(dout),)


class AllToAllIds(nn.Cell):
    """The expert ids (n*M, K) int32 of the send buffer's rows exchanged as AllToAllRows' rows, forward
    only; fp32 on the wire (exact below 2^24) like GatherIds, an empty row's ids -1."""

    def __init__(self, group: Any) -> None:
        super().__init__()
        self.size = group.size
        self.op = all_to_all(group)

    def construct(self, ids: Tensor, after: Tensor) -> Tensor:
        x = ops.depend(ops.stop_gradient(ids).astype(ms.float32), after)  # after the rows' exchange on every rank
        return ops.stop_gradient(self.op(x)).astype(ms.int32)
