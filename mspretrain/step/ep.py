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

Checkpoints: nothing is gathered. Each data-parallel rank writes its own files (parallel/plan.py
`per_rank_files`, checkpoint/shards.py): the ranks of the first edp replica (edp rank 0, one per
ep rank) their experts' slice of each expert stack, `NAME@START:STOP` of the flattened whole stack
(experts [e0, e1) are one contiguous range of it), in their weight file `model-R-of-N` and, with
their Adam moments (and fp32 masters), in their optimizer file; rank 0 the other weights whole
(and, without ZeRO, their state). This is ZeRO-3's form (checkpoint/model_shards.py): every reader
joins or cuts it at any layout, and a rank resuming at expert parallel reads only its experts'
ranges (`expert_ranges`). A whole-model gather put every expert on every rank's host at each save:
for Qwen3-30B-A3B at ep 16 that was 116 GB of fp32 weights and three times that of optimizer state
per rank (now: its 1/16 of the experts). One process resumes an ep run, an ep run resumes one
process's checkpoint, and ZeRO-3 either (tests/train/test_moe_ep.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from mspretrain.errors import UserError
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

    # ----------------------------------------------------------------- checkpoints: this rank's own
    def expert_ranges(self) -> dict[str, tuple[int, int]]:
        """{stack name: [start, stop) of the flattened whole stack} this rank holds: its experts'
        rows, one contiguous range (the cut is along the experts, model/params.py `ep_piece`)."""
        out = {}
        for name, shape in self.whole_shapes.items():
            axis, ranges = self.piece_where[name]
            assert axis == 0 and len(ranges) == 1, (name, axis, ranges)  # ep cuts whole experts
            row = int(np.prod(shape[1:]))
            out[name] = (ranges[0][0] * row, ranges[0][1] * row)
        return out

    def _writes_experts(self) -> bool:
        return self.plan.edp_rank == 0  # one writer per expert: the edp replicas hold the same

    def model_slices(self) -> tuple[dict[str, np.ndarray], dict[str, tuple[int, ...]]]:
        """This rank's weight file (copies) and the whole shapes of the stacks it slices: its experts
        (edp rank 0 of each ep group), and on rank 0 every other weight whole (fp16 ones as fp16)."""
        from mspretrain.model.decoder import state_numpy
        from mspretrain.parallel.shard_key import shard_key

        ranges, out = self.expert_ranges(), {}
        for name, value in state_numpy(self.model, keep_fp16=True).items():
            if name in ranges:
                if self._writes_experts():
                    out[shard_key(name, *ranges[name])] = value.reshape(-1).copy()
            elif self.plan.dp_rank == 0:
                out[name] = value.copy()
        return out, dict(self.whole_shapes)

    def optimizer_state(self) -> dict[str, np.ndarray]:
        """This rank's optimizer file (views): its experts' moments and masters as slices of the whole
        stacks (edp rank 0 of each ep group), the other parameters' state as TrainStep keeps it (this
        rank's shard under ZeRO; without ZeRO every rank holds all of it, and rank 0 writes it)."""
        from mspretrain.parallel.shard_key import shard_key

        ranges, out = self.expert_ranges(), {}
        for key, value in TrainStep.optimizer_state(self).items():
            name = key.split(".", 1)[-1]
            if name in ranges:
                if self._writes_experts():
                    out[shard_key(key, *ranges[name])] = value.reshape(-1)
            elif key == "opt_step" or self.plan.sharded or self.plan.dp_rank == 0:
                out[key] = value
        return out

    def keys_to_read(self, available: set[str]) -> set[str]:
        """The stored keys of this rank's state: the other parameters' as TrainStep reads them, and
        of each expert stack's state only the slices (or whole tensors) overlapping this rank's experts."""
        from mspretrain.parallel.shard_key import parse_shard_key

        ranges = self.expert_ranges()
        out = set()
        for key in available:
            logical, rng = parse_shard_key(key)
            name = logical.split(".", 1)[-1]
            if name not in ranges:
                continue
            a, b = ranges[name]
            if rng is None or (rng[0] < b and a < rng[1]):
                out.add(key)
        rest = {k for k in available if parse_shard_key(k)[0].split(".", 1)[-1] not in ranges}
        return out | TrainStep.keys_to_read(self, rest)

    def load_optimizer_state(self, tensors: dict[str, np.ndarray], available: set[str] | None = None) -> None:
        """The experts' state assembled from the stored slices or whole tensors overlapping this rank's
        range (one key each, checked to tile it), the rest loaded as TrainStep does."""
        from mspretrain.checkpoint.model_shards import check_tiling
        from mspretrain.parallel.shard_key import parse_shard_key

        ranges, local, pieces = self.expert_ranges(), {}, {}
        for key, value in tensors.items():
            logical, rng = parse_shard_key(key)
            name = logical.split(".", 1)[-1]
            if name not in ranges:
                local[key] = value
                continue
            shape = self.whole_shapes[name]
            flat = np.asarray(value).reshape(-1)
            got = rng or (0, int(np.prod(shape)))
            if flat.size != got[1] - got[0]:
                raise UserError(f"the checkpoint's {key[:120]} holds {flat.size:,} elements, not the {got[1] - got[0]:,} it should",
                                "resume from another checkpoint (`mspretrain checkpoints RUN --verify` lists them)")
            pieces.setdefault(logical, []).append((got, flat))
        for logical, parts in pieces.items():
            name = logical.split(".", 1)[-1]
            (a, b), shape = ranges[name], self.whole_shapes[name]
            check_tiling(logical, [rng for rng, _ in parts], a, b,
                         "resume from another checkpoint (`mspretrain checkpoints RUN --verify` lists them)")
            mine = np.empty(b - a, np.float32)
            for (ra, rb), flat in parts:
                lo, hi = max(a, ra), min(b, rb)
                if lo < hi:
                    mine[lo - a:hi - a] = flat[lo - ra:hi - ra]
            local[logical] = mine.reshape((-1,) + tuple(shape[1:]))
        TrainStep.load_optimizer_state(self, local, available=available)

    def load_weights(self, tensors: dict[str, np.ndarray]) -> None:
        """Whole tensors into the model's pieces (each expert stack cut to this rank's experts), or an
        expert stack's range as `read_pieces` gives it for `expert_ranges` (1-D: reshaped)."""
        from mspretrain.model.parallel import cut

        ranges, local = self.expert_ranges(), {}
        for name, value in tensors.items():
            if name not in ranges:
                local[name] = value
                continue
            shape, (a, b) = self.whole_shapes[name], ranges[name]
            if tuple(np.shape(value)) == shape:
                local[name] = cut(np.asarray(value), self.piece_where[name])
            elif np.ndim(value) == 1 and np.size(value) == b - a:
                local[name] = np.asarray(value).reshape((-1,) + tuple(shape[1:]))
            else:
                raise UserError(f"tensor {name} has shape {tuple(np.shape(value))}, the model expects {shape}",
                                "the checkpoint was written for a different model config; use the config saved with it")
        TrainStep.load_weights(self, local)
