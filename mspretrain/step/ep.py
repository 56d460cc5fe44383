"""Expert parallel in a training run (`parallel.ep`, issue 52.3): the ep and expert-data-parallel
groups of the parallel plan, and the train step whose MoE layers hold this rank's experts
(model/moe.py `MoE.apply_ep`, model/expert_parallel.py) while checkpoints hold the whole model.

Groups (mspretrain/parallel/plan.py): ep groups of `ep` adjacent data-parallel ranks split the
experts; the ranks holding the same experts form the expert-data-parallel (edp) group. Made with
`mindspore.communication.create_group` by their members (`ep_<g>`, `edp_<e>`); a group that is
the whole world uses the plain world primitives, and a one-rank edp group needs no collective.

The step (step/step.py, step/update.py): every parameter but the expert stacks is reduced over
the data-parallel world as without ep; the expert stacks' gradients already hold the whole ep
group's tokens (the combine's backward gathered their output gradients) and are summed over the
edp group only, with the same divisor (the loss is scaled by the global batch's tokens). The
gradient norm counts each expert once: the expert part of the squared norm is summed over the ep
group. The routing stats behind the load-balancing loss are summed over the data-parallel world
(step/objective.py), so that loss is one process's on the whole batch. ZeRO-1: the other
parameters' state is sharded over the world as without ep; each rank keeps its own experts' state
whole (parallel/layout.py `LOCAL`; with ep < dp the edp group's ranks hold the same experts' state:
not sharded over it yet), and a checkpoint writes the experts' gathered state in dp rank 0's shard.
ZeRO-2: the other parameters' gradients are reduce-scattered over the world every micro-batch as
without ep; the expert stacks' are summed over the edp group every micro-batch and kept whole (in
no rank bucket); the squared norm is the world's sum of each rank's owned part, the experts' part
counted by edp rank 0 of each ep group only. ZeRO-3 with ep is not built (refused).

Checkpoints: the expert stacks (and their Adam moments) are gathered over the ep group by the
tensor-parallel machinery (step/tp.py `WholeTensors`: zero-padded pieces summed), and rank 0
writes the whole model under the whole-model names, as a data-parallel run does; a load cuts
this rank's experts from whole tensors. So one process resumes an ep run and an ep run resumes
one process's checkpoint (tests/train/test_moe_ep.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from mspretrain.model.decoder import Decoder
from mspretrain.model.parallel import Group
from mspretrain.parallel.plan import ParallelPlan
from mspretrain.step.step import TrainStep
from mspretrain.step.tp import WholeTensors, group_options


@dataclass(frozen=True)
class ExpertMesh:
    ep: Group  # the ranks splitting the experts
    edp: Group  # the ranks holding the same experts
    dp: Group  # the data-parallel world (tp is 1 under expert parallel)


def expert_mesh(plan: ParallelPlan, device: str, create: bool = True) -> ExpertMesh:
    """The communication groups of `plan`'s ep and edp groups for this rank; `create=False` names
    them without creating them (no communication: a unit test, or the collective-sequence probe)."""
    world = tuple(range(plan.world))

    def group(kind: str, index: int, ranks: tuple[int, ...], rank: int) -> Group:
        if ranks == world or len(ranks) == 1:  # the world (plain primitives), or one rank (no collective)
            return Group(ranks, rank, device=device)
        name = f"{kind}_{index}"
        if create:
            from mindspore.communication import create_group

            # each group its own HCCL buffer: `launch` plans the ep group's for the dispatch and the edp
            # group's for the expert bucket (parallel/hccl.py `communicators`, MSPRETRAIN_HCCL_GROUP_MB ep=MB,edp=MB)
            create_group(name, list(ranks), group_options(kind, device))
        return Group(ranks, rank, name=name, device=device)

    return ExpertMesh(ep=group("ep", plan.edp_rank, plan.ep_ranks, plan.ep_rank),
                      edp=group("edp", plan.ep_rank, plan.edp_ranks, plan.edp_rank),
                      dp=Group(world, plan.rank, device=device))


class EPTrainStep(WholeTensors, TrainStep):
    """TrainStep over the data-parallel world for a model cut by its `apply_ep` (model/decoder.py);
    whole tensors in and out (module docstring)."""

    def __init__(self, model: Decoder, optim: Any, *, mesh: ExpertMesh, plan: ParallelPlan, **kw: Any) -> None:
        split = model.ep_split
        self.mesh = mesh
        self.whole_shapes: dict[str, tuple[int, ...]] = dict(split.whole_shapes)
        self.piece_group, self.piece_where = mesh.ep, dict(split.where)
        self._host_sum: Any = None
        super().__init__(model, optim, plan=plan, ep=split, edp=mesh.edp, **kw)

    def collectives(self, accumulation: int = 1) -> dict[str, int]:
        """Calls and bytes handed to collectives per step: the data-parallel world's buckets without
        the expert stacks (TrainStep.collectives' layout counts them there), the stacks' own bucket
        over the edp group (none with one rank), the norm's ep sum; per micro-batch and MoE layer the
        dispatch (rows, ids), the combine and their two backward collectives, and the routing stats'
        world sum (model/expert_parallel.py, step/objective.py), in the form the device runs (MoE's
        `all_to_all`): the AllToAll form's send buffers hold a slot of N rows per ep rank, the CPU
        gather form's AllReduce sums the whole group's buffer, so both hand over ep-times-N rows."""
        import mindspore as ms

        base = super().collectives(accumulation)
        model, n = self.model, self.mesh.ep.size
        e = 2 if model.dtype in (ms.float16, ms.bfloat16) else 4
        expert_elems = sum(int(np.prod(s)) // n for s in self.whole_shapes.values())
        wire = 2 if self._ex is not None and self._ex[2] == ms.float16 else 4
        # the norm's ep sum (ZeRO-2: none, the world's sum of the owned squares adds the experts'), the
        # edp bucket (ZeRO-2: every micro-batch; the layout's rank buckets do not hold the stacks)
        times = accumulation if self.shard_grads else 1
        calls = base["calls"] + (1 if self.ep_sum is not None else 0) + (times if self.edp_sum is not None else 0)
        if self.shard_grads:
            nbytes = base["bytes"] + (times * expert_elems * wire if self.edp_sum is not None else 0)
        else:
            nbytes = base["bytes"] + 4 - (0 if self.edp_sum is not None else expert_elems * wire)
        cfg = model.cfg
        layers = sum(cfg.is_moe_layer(i) for i in range(cfg.n_layers))
        tokens = int(self.global_tokens) // max(1, self.world * accumulation)  # one rank's micro-batch
        D, K, E = cfg.dim, cfg.experts_per_token, cfg.num_experts
        # one rank's N tokens: packed rows (D + K), expert ids (K, fp32 on the wire), outputs (D)
        rows, ids, out = tokens * (D + K) * e, tokens * K * 4, tokens * D * e
        # Both forms hand over n*N rows each way, so one count serves both devices:
        # - Ascend, the AllToAll form (model/moe.py MoE._expert_parallel, a2a_send): forward the
        #   (n*N, D + K) send buffer, its (n*N, K) ids and the combine's (n*N, D) return; backward the
        #   combine's and the dispatch's reverse exchanges of the same buffers (AllToAllRows.bprop);
        # - CPU, the gather form as AllReduce sums (mccl): GatherRows and GatherIds sum each rank's rows
        #   in its slot of an n*N buffer, ScatterRows the (n*N, D) partial outputs; backward ScatterRows'
        #   gather and GatherRows' reduce-scatter, the same sums of n*N rows.
        # (HCCL's gather form, no longer run, handed over N rows to gather and n*N to scatter.)
        forward, backward = rows * n + ids * n + out * n, out * n + rows * n
        per_layer = forward + backward
        stats = layers * self._moe_rows.count * E * 4
        calls += accumulation * (5 * layers + 1)
        nbytes += accumulation * (layers * per_layer + stats)
        return {"calls": calls, "bytes": nbytes}

    def expert_bucket_bytes(self) -> int:
        """Bytes of the expert stacks' bucket `_reduce` makes (step/update.py kind 3): the flat copy of
        this rank's expert gradients on the wire and the edp group's sum of it; none with one edp
        rank, where each gradient is taken as it is (plan's `collective_buffers`, preflight/costs.py)."""
        import mindspore as ms

        if self._ex is None or self.edp_sum is None:
            return 0
        _, sizes, wire = self._ex
        return 2 * sum(sizes) * (2 if wire == ms.float16 else 4)

    def optimizer_state(self) -> dict[str, np.ndarray]:
        """The state with the experts' whole (gathered over the ep group: every rank takes part).
        Under ZeRO-1 each dp rank writes its own shard and every rank holds its experts' state, so
        only dp rank 0's shard keeps the experts' (one writer per key; any layout reads it whole)."""
        out = super().optimizer_state()
        if self.plan.sharded and self.plan.dp_rank != 0:
            out = {k: v for k, v in out.items() if k.split(".", 1)[-1] not in self.whole_shapes}
        return out
