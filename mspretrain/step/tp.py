"""Tensor parallel in a training run (`parallel.tp`): the ranks' mesh, and the train step whose
model holds this rank's tensor-parallel piece (model/parallel.py) while its weights and
optimizer state go to and come from checkpoints whole.

Mesh. world = tp x dp; rank r is tp rank r % tp of tp group r // tp (the tp ranks of a group are
adjacent, as Megatron-LM's `initialize_model_parallel` orders them, so a tp group stays inside an
8-NPU node) and data-parallel rank r // tp of the dp group {j*tp + r % tp}. The data loader, the
budget's micro-batches and the step's gradient reductions (and ZeRO-1/2 owners) are those of the dp
group; a tp group's ranks read the same batches. The groups are made with
`mindspore.communication.create_group` by the ranks in them (`tp_<g>`, `dp_<g>`; HCCL on Ascend,
mccl on CPU: model/parallel.py says what each can do). With tp = world (dp = 1) the tp group is
the world and its collectives are the plain world ones, as with tp = 1 for the dp group.

Checkpoints are a data-parallel run's, of the whole model: weights gathered across the tp group
(every rank takes part), the optimizer state of each dp rank's part gathered the same way, written
by tp rank 0 of each tp group as shard `dp_rank` of `dp` (unsharded: dp rank 0 alone). So any
layout resumes any other: a TP run's checkpoint by one process, by plain data parallel or ZeRO-1/2,
and a tensor-parallel run cuts its pieces from whichever whole tensors or ZeRO slices it finds.
The gathers sum zero-padded pieces (`place`) in fixed-size chunks (`CHUNK`), so the host holds the
whole tensors plus one chunk. `optim.split_mb` is not applied under tp: a dp owner keeps its
tensor-parallel pieces whole (their state keys are the whole tensors' names).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from mspretrain.errors import UserError
from mspretrain.model.decoder import Decoder
from mspretrain.model.parallel import Group, TPSplit, cut, place
from mspretrain.parallel.plan import ParallelPlan
from mspretrain.parallel.shard_key import parse_shard_key
from mspretrain.step.step import TrainStep

CHUNK = 1 << 24  # elements per host-side tp sum (64 MB of fp32): one compiled collective, reused


@dataclass(frozen=True)
class Mesh:
    tp: Group
    dp: Group


def make_mesh(rank: int, world: int, tp: int, device: str, create: bool = True) -> Mesh:
    """This rank's tp and dp groups (module docstring), of the ranks the parallel plan names
    (mspretrain/parallel/plan.py, which refuses a world tp does not divide); `create=False` names
    them without creating them (no communication: a unit test, or the collective-sequence probe)."""
    return mesh_for(ParallelPlan(world=world, rank=rank, tp=tp), device, create)


def mesh_for(plan: ParallelPlan, device: str, create: bool = True) -> Mesh:
    """The communication groups of `plan`'s tp and dp groups for this rank (`make_mesh`)."""
    tp, dp, t, d = plan.tp, plan.dp, plan.tp_rank, plan.dp_rank
    tp_ranks, dp_ranks = plan.tp_ranks, plan.dp_ranks
    if tp == 1 or dp == 1:  # one group is the world (plain primitives), the other a single rank
        return Mesh(Group(tp_ranks, t, device=device), Group(dp_ranks, d, device=device))
    if create:
        from mindspore.communication import create_group

        # every rank creates the two groups it belongs to, and only those (the members of a group
        # create it: mindspore/communication/management.py, create_group; measured on mccl too)
        create_group(f"tp_{d}", list(tp_ranks), group_options("tp", device))
        create_group(f"dp_{t}", list(dp_ranks), group_options("dp", device))
    return Mesh(Group(tp_ranks, t, name=f"tp_{d}", device=device), Group(dp_ranks, d, name=f"dp_{t}", device=device))


def group_options(kind: str, device: str, env: dict[str, str] | None = None) -> Any:
    """`create_group`'s options for the `kind` ("tp" / "dp" / "ep" / "edp") group: on Ascend the HCCL buffer
    `launch` planned for it (parallel/hccl.py `communicators`: each communicator takes 2 x its buffer of
    HBM outside the pool, so each is sized for its own largest collective), None otherwise (CPU,
    or no plan: the group takes HCCL_BUFFSIZE). MindSpore 2.10 communication/management.py,
    `create_group(group, rank_ids, options)`: "for the HCCL backend, hccl_config can be specified
    ... hccl_buffer_size (uint32): Specifies the size of the HCCL communication buffer", a
    `mindspore._c_expression.GroupOptions` (its example). Only a 910B shows HCCL honouring it."""
    import os

    from mspretrain.parallel.hccl import group_buffsize

    mb = group_buffsize(kind, dict(os.environ) if env is None else env) if device == "ascend" else None
    if mb is None:
        return None
    from mindspore._c_expression import GroupOptions

    options = GroupOptions()
    options.hccl_config = {"hccl_buffer_size": mb}
    return options


class WholeTensors:
    """Whole tensors in and out of a train step whose model holds pieces of some parameters
    (tensor parallel: every split weight; expert parallel, step/ep.py: the expert stacks): a
    checkpoint holds the whole model, gathered over `piece_group` by summing zero-padded pieces
    (module docstring), and a load cuts each rank's pieces out of whole tensors or ZeRO slices.
    Mixed in before TrainStep, which supplies the rest; the subclass sets `piece_group` (a
    model/parallel.py `Group`), `whole_shapes` and `piece_where` ({name: (axis, ranges)}) and
    `_host_sum = None`. `full_weights`, `optimizer_state` and `weights_digest` are collectives:
    every rank calls them, in the same order."""

    piece_group: Any
    whole_shapes: dict[str, tuple[int, ...]]
    piece_where: dict[str, tuple[int, list[tuple[int, int]]]]
    _host_sum: Any

    def _where(self, name: str) -> tuple[int, list[tuple[int, int]]] | None:
        return self.piece_where.get(name)

    # ----------------------------------------------------------------- whole tensors out
    def _sum_chunk(self, x: np.ndarray) -> np.ndarray:
        import mindspore as ms
        from mindspore import Tensor

        if self._host_sum is None:
            op = self.piece_group.all_reduce()

            def tp_sum(x: Tensor) -> Tensor:
                return op(x)

            self._host_sum = ms.jit(tp_sum) if self._jit is not None else op
        return self._host_sum(Tensor(x)).asnumpy()

    def _whole(self, pieces: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Every split piece (by its parameter's name, e.g. `exp_avg.NAME` -> NAME) summed into its
        whole tensor over the pieces' group; replicated ones as they are (the same on every tp rank)."""
        logical = {key: key.split(".", 1)[1] if key.split(".", 1)[0] in ("exp_avg", "exp_avg_sq", "master") else key
                   for key in pieces}
        split = [k for k in sorted(pieces) if logical[k] in self.whole_shapes]
        out = {k: v for k, v in pieces.items() if k not in split}
        placed = [place(np.asarray(pieces[k], np.float32), self._where(logical[k]), self.whole_shapes[logical[k]]).reshape(-1)
                  for k in split]
        total = sum(p.size for p in placed)  # the same on every rank of the group
        if total:
            chunk = min(CHUNK, total)
            stream = np.empty(-(-total // chunk) * chunk, np.float32)
            at = 0
            for p in placed:
                stream[at:at + p.size] = p
                at += p.size
            stream[total:] = 0
            for start in range(0, stream.size, chunk):  # every rank: the same chunks in the same order
                stream[start:start + chunk] = self._sum_chunk(stream[start:start + chunk])
            at = 0
            for k, p in zip(split, placed):
                out[k] = stream[at:at + p.size].reshape(self.whole_shapes[logical[k]]).astype(np.asarray(pieces[k]).dtype)
                at += p.size
        return out

    def full_weights(self) -> dict[str, np.ndarray]:
        return self._whole({k: v.copy() for k, v in super().full_weights().items()})

    def optimizer_state(self) -> dict[str, np.ndarray]:
        return self._whole({k: v.copy() for k, v in super().optimizer_state().items()})

    def weights_digest(self) -> str:
        """TrainStep.weights_digest over the whole tensors, each summed over the pieces' group alone
        (`_whole` of one parameter), never the whole model on the host (issue 51.4). A collective:
        every rank calls it."""
        import hashlib

        from mspretrain.model.decoder import state_numpy

        h = hashlib.sha256()
        pieces = state_numpy(self.model, keep_fp16=True)  # views of this rank's pieces (no copy)
        for name in sorted(pieces):
            arr = self._whole({name: pieces[name]})[name]
            h.update(name.encode())
            h.update(np.ascontiguousarray(arr).tobytes())
        return h.hexdigest()

    # ----------------------------------------------------------------- whole tensors in
    def load_weights(self, tensors: dict[str, np.ndarray]) -> None:
        for name, shape in self.whole_shapes.items():
            if name in tensors and tuple(np.shape(tensors[name])) != shape:
                raise UserError(f"tensor {name} has shape {tuple(np.shape(tensors[name]))}, the model expects {shape}",
                                "the checkpoint was written for a different model config; use the config saved with it")
        super().load_weights({k: cut(np.asarray(v), self._where(k)) if k in self.whole_shapes else v for k, v in tensors.items()})

    def keys_to_read(self, available: set[str]) -> set[str]:
        """Every stored key (whole or a ZeRO slice) of the state this rank's dp part needs."""
        want = {"opt_step"} | {f"{kind}.{self.names[i]}" for i in self.own for kind in self._kinds(i)}
        return {k for k in available if parse_shard_key(k)[0] in want}

    def load_optimizer_state(self, tensors: dict[str, np.ndarray], available: set[str] | None = None) -> None:
        """Whole tensors, or the slices a ZeRO run stored (`NAME@START:STOP` of the flattened whole),
        joined and cut to this rank's pieces, then loaded as TrainStep does."""
        joined: dict[str, np.ndarray] = {}
        slices: dict[str, list[tuple[tuple[int, int], np.ndarray]]] = {}
        for key, value in tensors.items():
            name, rng = parse_shard_key(key)
            if rng is None:
                joined[name] = np.asarray(value)
            else:
                slices.setdefault(name, []).append((rng, np.asarray(value).reshape(-1)))
        for name, parts in slices.items():
            parts.sort(key=lambda p: p[0])
            if parts[0][0][0] != 0 or any(a[0][1] != b[0][0] for a, b in zip(parts, parts[1:])):
                raise UserError(f"the checkpoint's slices of {name} do not cover it",
                                "resume from another checkpoint (`mspretrain checkpoints RUN` lists them)")
            joined[name] = np.concatenate([v for _, v in parts])
        local = {}
        for key, value in joined.items():
            logical = key.split(".", 1)[1] if "." in key else key
            shape = self.whole_shapes.get(logical)
            local[key] = value if shape is None else cut(value.reshape(shape), self._where(logical))
        super().load_optimizer_state(local, available=available)


class TPTrainStep(WholeTensors, TrainStep):
    """TrainStep over the dp group for a model cut by its `apply_tp` (model/decoder.py); whole
    tensors in and out (module docstring). `full_weights` and `optimizer_state` are collectives:
    every rank calls them, in the same order."""

    def __init__(self, model: Decoder, optim: Any, *, mesh: Mesh, jit: bool = True, plan: ParallelPlan | None = None,
                 **kw: Any) -> None:
        """`model`: cut by its `apply_tp` (model/decoder.py); `plan`: the run's (train/build.py), else
        the one `mesh` and the shard flags describe."""
        self.mesh = mesh
        self.split: TPSplit = model.tp_split
        self.whole_shapes: dict[str, tuple[int, ...]] = dict(self.split.whole_shapes)
        kw.pop("split_mb", None)
        if plan is None:
            tp, dp = mesh.tp, mesh.dp
            zero = 3 if kw.get("shard_params") else 2 if kw.get("shard_grads") else 1 if kw.get("shard") else 0
            plan = ParallelPlan(world=tp.size * dp.size, rank=dp.rank * tp.size + tp.rank, tp=tp.size, zero=zero)
        super().__init__(model, optim, world=mesh.dp.size, rank=mesh.dp.rank, jit=jit, split_mb=0,
                         comm=mesh.dp if mesh.dp.size > 1 else None, plan=plan, tp=self.split, **kw)
        self._host_sum: Any = None
        self.piece_group, self.piece_where = mesh.tp, dict(self.split.where)

    def collectives(self, accumulation: int = 1) -> dict[str, int]:
        """The data-parallel reduction's calls and bytes (TrainStep.collectives) plus tensor
        parallel's own per step: per micro-batch, the forward all-reduce of every ReduceFromTP (the
        embedding's lookup, each layer's wo and w2) and, again, of the recomputed layers' under
        layer recompute; the backward all-reduce of every CopyToTP (each norm before a
        column-parallel layer, the final norm's); the vocabulary-parallel loss's three (max,
        sum-exp, target logit, fp32 over the micro-batch's tokens); per step the gradient norm's tp
        sum and, with Qwen3's QK-norms, their partial gradients' sum (model/parallel.py). An
        activation is (tokens, dim) in the model's compute dtype. The start-up line said "0
        collectives" for a tp run with one data-parallel rank (issue 54.15)."""
        import mindspore as ms

        from mspretrain.model.parallel import CopyToTP, ReduceFromTP

        base = super().collectives(accumulation) if self.mesh.dp.size > 1 else {"calls": 0, "bytes": 0}
        model = self.model
        e = 2 if model.dtype in (ms.float16, ms.bfloat16) else 4
        tokens = int(self.global_tokens) // max(1, self.mesh.dp.size * accumulation)  # one rank's micro-batch
        act = tokens * model.cfg.dim * e
        cells = [c for _, c in model.cells_and_names()]
        forward = sum(isinstance(c, ReduceFromTP) for c in cells)
        recomputed = sum(2 for layer in model.layers if getattr(layer, "_has_config_recompute", False))
        backward = sum(isinstance(c, CopyToTP) for c in cells)
        group = self.mesh.tp.size
        loss = [tokens * 4 * group, tokens * 4, tokens * 4]  # the max's slots on CPU (one per member); on Ascend one
        if model.tp_loss.core.max.native:
            loss[0] = tokens * 4
        per_micro_calls = forward + recomputed + backward + len(loss)  # the norm's tp sum: once a step (+ 1)
        per_micro_bytes = (forward + recomputed + backward) * act + sum(loss)
        # the QK-norms' partial sum runs with each reduction: per micro-batch with sharded gradients
        partial = [p for p in model.trainable_params() if p.name in self.split.partial]
        sums = (accumulation if self.shard_grads else 1) if partial else 0
        return {"calls": base["calls"] + accumulation * per_micro_calls + 1 + sums,
                "bytes": base["bytes"] + accumulation * per_micro_bytes + 4
                + sums * 4 * sum(int(np.prod(p.shape)) for p in partial)}
