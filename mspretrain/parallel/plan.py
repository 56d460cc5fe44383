"""The parallel plan of one run: how its ranks are laid out, built once and then only read.

Pure arithmetic (no MindSpore), so `plan` and `fits` build the very plan `train` runs with.
`train/build.py` makes it (`ParallelPlan.for_config`) right after the ranks are known and hands
it to the step, the checkpoints, the EMA, the end-of-run replica hash and the memory check; the
communication groups themselves are created from it in `step/tp.py` (`make_mesh`): the plan
names ranks, it holds no MindSpore object.

Dimensions. world = tp x dp. Rank r is tensor-parallel rank r % tp of tp group r // tp (a tp
group's ranks are adjacent, as Megatron-LM's `initialize_model_parallel` orders them, so a tp
group stays inside an 8-NPU server) and data-parallel rank r // tp of the dp group
{j*tp + r % tp}. `cp` (context parallel) is a dimension to come: a field of the plan already,
fixed at 1, and any other value is refused in one line.

Expert parallel (`ep`, issue 52.3): the dp ranks are cut into ep groups of `ep` adjacent dp ranks
(dp rank d is ep rank d % ep of ep group d // ep), whose ranks split a mixture of experts' E
experts among them (ep rank e holds experts [e*E/ep, (e+1)*E/ep), `expert_span`); the ranks
holding the same experts form the expert-data-parallel group {j*ep + d % ep} (`edp_ranks`), over
which those experts' gradients are reduced. ep divides the dp ranks; tp > 1 and ZeRO-3 with
ep > 1 are refused for now (the ep groups would be tp-strided and the experts' tp cut is not
built; sharded parameters would need the experts' slices over the edp group), ZeRO-1/2 compose.

ZeRO. `zero` is the level the config asks for (optim.shard_optimizer 1, shard_gradients 2,
shard_parameters 3); it acts over the data-parallel group only, so with one dp rank nothing is
sharded (`sharded`, `zero3`).

Save roles (train/checkpointing.py). Under tp every rank takes part in gathering the whole
weights and optimizer state over its tp group (`gathers_for_save`), and tp rank 0 of each group
writes its dp rank's files (`writes_files`); under ZeRO-3 and expert parallel each dp rank writes
its own weight slices (`writes_model_slices`: ZeRO-3's slices of every weight, expert parallel's
experts, `NAME@START:STOP` of the whole stack, checkpoint/model_shards.py); with a sharded optimizer
or expert parallel each dp rank writes its own optimizer file (`per_rank_files`); rank 0 publishes
the checkpoint (`publishes`). Expert parallel gathers nothing: a whole-model gather would put every
expert on every rank's host at each save (Qwen3-30B-A3B: 116 GB of fp32 weights, three times that
of optimizer state, per rank).

The tensor-parallel divisibility rule (`tp_refusal`) lives here: `train` (model/parallel.py
`check_tp`) and `plan`'s layout table (preflight/layouts.py `train_refusal`) ask this one function,
so the table never recommends a tp that `train` refuses.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mspretrain.errors import UserError

# How a weight-holding cell is cut across the tp ranks (model/layers.py declares one per cell;
# model/params.py's `Role` enum takes its values from these):
COLUMN = "column"  # output rows split (Megatron's column-parallel linear), per fused row block
ROW = "row"  # input columns split (row-parallel linear); its output is summed over tp
VOCAB = "vocab"  # vocabulary rows split (the embedding, the lm_head)
REPLICATED = "replicated"  # whole on every tp rank, the same gradient everywhere (the norms)
PARTIAL = "partial"  # whole on every tp rank, a partial gradient on each (Qwen3's QK-norms)
ROLES = (COLUMN, ROW, VOCAB, REPLICATED, PARTIAL)


def tp_refusal(n_heads: int, n_kv_heads: int, ffn_dim: int, vocab_size: int, tp: int) -> tuple[str, str] | None:
    """(cause, fix) when tensor parallel `tp` cannot cut a model of this shape, else None."""
    if tp == 1:
        return None
    if n_kv_heads % tp:
        best = max(d for d in range(1, n_kv_heads + 1) if n_kv_heads % d == 0 and d <= tp)
        return (f"parallel.tp = {tp} does not divide model.n_kv_heads = {n_kv_heads}: tensor parallel splits the kv heads "
                "across ranks and does not replicate them",
                f"use parallel.tp={best} (a divisor of n_kv_heads) and data parallel for the other ranks")
    for key, value in (("n_heads", n_heads), ("ffn_dim", ffn_dim), ("vocab_size", vocab_size)):
        if value % tp:
            return (f"parallel.tp = {tp} does not divide model.{key} = {value}",
                    f"use a parallel.tp that divides model.{key}"
                    + (" (pad the vocabulary: model.vocab_size may exceed the tokenizer's)" if key == "vocab_size" else ""))
    return None


Where = tuple[int, list[tuple[int, int]]]  # (axis, [start, stop) ranges along it, concatenated in order)


def tp_where(role: str, shape: tuple[int, ...], blocks: tuple[int, ...] | None, tp: int, rank: int) -> Where | None:
    """Where tp rank `rank`'s piece of a whole parameter of `shape` lies, by its cell's `role`:
    (axis, ranges), or None for a whole one. `blocks`: a column-parallel weight's fused row
    blocks (q | k | v, gate | up), each cut by tp; None: one block."""
    if tp == 1 or role in (REPLICATED, PARTIAL):
        return None
    span = lambda n, offset=0: (offset + rank * n // tp, offset + (rank + 1) * n // tp)
    if role == VOCAB:
        return 0, [span(shape[0])]
    if role == ROW:
        return 1, [span(shape[1])]
    if role == COLUMN:
        out, at = [], 0
        for n in blocks or (shape[0],):
            out.append(span(n, at))
            at += n
        return 0, out
    raise ValueError(f"unknown split role {role!r}")


def zero_level(optim: Any) -> int:
    """The ZeRO level the config's optimizer section asks for (0: none)."""
    return 3 if optim.shard_parameters else 2 if optim.shard_gradients else 1 if optim.shard_optimizer else 0


@dataclass(frozen=True)
class ParallelPlan:
    """One run's layout of ranks (module docstring). Refused in one line when it cannot be run."""

    world: int = 1
    rank: int = 0
    tp: int = 1
    ep: int = 1
    cp: int = 1
    zero: int = 0

    def __post_init__(self) -> None:
        if self.cp != 1:
            raise UserError(f"parallel.cp = {self.cp}: context parallel is not supported yet",
                            "use parallel.cp=1 (data, tensor and expert parallel split the ranks)")
        if self.world < 1 or not 0 <= self.rank < self.world or self.tp < 1 or self.ep < 1 or self.zero not in (0, 1, 2, 3):
            raise ValueError(f"not a parallel plan: {self!r}")
        if self.world % self.tp:
            raise UserError(f"parallel.tp = {self.tp} does not divide the {self.world} ranks of this job",
                            f"launch a multiple of {self.tp} ranks (world = tp x data-parallel ranks), or change parallel.tp")
        if self.ep > 1:
            if self.tp > 1:
                raise UserError(f"parallel.ep = {self.ep} with parallel.tp = {self.tp}: expert parallel with tensor parallel is not supported yet",
                                "use parallel.tp=1 with expert parallel (the ep groups split the data-parallel ranks)")
            if self.dp % self.ep:
                raise UserError(f"parallel.ep = {self.ep} does not divide the {self.dp} data-parallel ranks of this job",
                                f"launch a multiple of {self.ep} ranks (data-parallel ranks = ep x expert-data-parallel), or change parallel.ep")
            if self.zero > 2:
                raise UserError(f"ZeRO-{self.zero} with parallel.ep = {self.ep} is not supported yet",
                                "use optim.shard_gradients=true (ZeRO-2) or less with expert parallel")

    @classmethod
    def for_config(cls, cfg: Any, world: int = 1, rank: int = 0) -> ParallelPlan:
        """The plan a run of `cfg` on `world` ranks has, seen from `rank`."""
        return cls(world=world, rank=rank, tp=cfg.parallel.tp, ep=cfg.parallel.ep, zero=zero_level(cfg.optim))

    # ---- the dimensions and this rank's place in them
    @property
    def dp(self) -> int:
        return self.world // self.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp

    @property
    def tp_ranks(self) -> tuple[int, ...]:
        """The world ranks of this rank's tp group, in group order."""
        return tuple(self.dp_rank * self.tp + i for i in range(self.tp))

    @property
    def dp_ranks(self) -> tuple[int, ...]:
        """The world ranks of this rank's dp group, in group order."""
        return tuple(j * self.tp + self.tp_rank for j in range(self.dp))

    # ---- expert parallel: ep groups of adjacent dp ranks, expert-data-parallel groups across them
    @property
    def ep_rank(self) -> int:
        return self.dp_rank % self.ep

    @property
    def edp(self) -> int:
        """The ranks holding the same experts (expert-data-parallel size): dp / ep."""
        return self.dp // self.ep

    @property
    def edp_rank(self) -> int:
        return self.dp_rank // self.ep

    @property
    def ep_ranks(self) -> tuple[int, ...]:
        """The world ranks of this rank's ep group (they split the experts), in group order."""
        return tuple((self.edp_rank * self.ep + i) * self.tp + self.tp_rank for i in range(self.ep))

    @property
    def edp_ranks(self) -> tuple[int, ...]:
        """The world ranks holding this rank's experts (their gradients' reduction), in group order."""
        return tuple((j * self.ep + self.ep_rank) * self.tp + self.tp_rank for j in range(self.edp))

    def expert_span(self, experts: int) -> tuple[int, int]:
        """[start, stop) of the experts this rank holds out of `experts` (all of them without ep)."""
        n = experts // self.ep
        return self.ep_rank * n, (self.ep_rank + 1) * n

    # ---- ZeRO over the dp group
    @property
    def sharded(self) -> bool:
        """The optimizer state is sharded over the dp ranks (ZeRO-1 and up, with more than one)."""
        return self.zero >= 1 and self.dp > 1

    @property
    def zero3(self) -> bool:
        """The weights themselves are sliced over the dp ranks (step/zero3.py)."""
        return self.zero == 3 and self.dp > 1

    # ---- save roles
    @property
    def gathers_for_save(self) -> bool:
        """Every rank takes part in gathering the whole weights and state over its tp group."""
        return self.tp > 1

    @property
    def holds_pieces(self) -> bool:
        """This rank's model holds pieces of some weights (ZeRO-3 slices, tp pieces, ep's experts):
        a digest of the whole weights is a collective (train/replicas.py)."""
        return self.zero3 or self.tp > 1 or self.ep > 1

    @property
    def per_rank_files(self) -> bool:
        """Every dp rank writes its own files for rank 0 to publish (checkpoint/shards.py): its
        optimizer shard (ZeRO-1 and up), its experts' weights and state (expert parallel)."""
        return self.sharded or self.ep > 1

    @property
    def writes_files(self) -> bool:
        """This rank writes its dp rank's checkpoint files (tp rank 0 of its group)."""
        return self.tp_rank == 0

    @property
    def writes_model_slices(self) -> bool:
        """This rank writes its own weight slices (`model-R-of-N`: ZeRO-3's, expert parallel's
        experts) instead of whole weights."""
        return self.zero3 or self.ep > 1

    @property
    def publishes(self) -> bool:
        """This rank writes the whole-run files and publishes the checkpoint (rank 0)."""
        return self.rank == 0

    def check_model(self, n_heads: int, n_kv_heads: int, ffn_dim: int, vocab_size: int) -> None:
        """Refuse, in one line, a model this plan's tp cannot cut."""
        refused = tp_refusal(n_heads, n_kv_heads, ffn_dim, vocab_size, self.tp)
        if refused:
            raise UserError(*refused)

    def describe(self) -> str:
        ep = f" (ep {self.ep} x expert-dp {self.edp})" if self.ep > 1 else ""
        return f"world {self.world} = tp {self.tp} x dp {self.dp}{ep}, ZeRO-{self.zero}"
