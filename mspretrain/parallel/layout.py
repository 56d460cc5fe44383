"""Who owns which parameter, and how gradients and parameters are packed for the collectives.

Pure arithmetic on parameter sizes (no MindSpore): every rank computes the same tables without
communicating, the planner uses the same numbers the step allocates, and the tests check them
by hand.

Ownership units (ZeRO): a parameter goes whole to one owner rank, unless it is large (at least
`split` elements, by default the bucket cap: `split_elements_for`). A large parameter is cut into N
contiguous slices of its flattened elements, slice r = [r*c, min(n, (r+1)*c)) with c = ceil(n/N),
and rank r owns slice r: its Adam moments, fp32 master and (ZeRO-2) gradient buffer are 1/N of the
tensor on every rank. Why: whole-tensor ownership leaves the rank that owns a 545 M-parameter
lm_head (Qwen2.5) with its 4.4 GB of moments and its update temporaries alone, however many ranks
share the rest (DeepSpeed's and Megatron's distributed optimizers flatten and partition for the
same reason). Contiguous slices of size c make the gathered bucket (N segments of c) exactly the
flattened parameter plus padding at its end, so it is reshaped into place without a copy of
pieces, and the reduction's input is the flattened gradient itself. Each split parameter is its own
bucket: it is at least a bucket cap (by default), so it would have had a bucket of its own anyway
(a lower `optim.split_mb` costs one collective each way per split parameter).

Two packings, both into flat 1-D buckets of at most `cap` elements (a parameter larger than the
cap gets a bucket of its own; only the split parameters above are cut):
- `flat_buckets`: replicated data, one AllReduce per bucket. Parameters of one wire dtype per
  bucket.
- `rank_buckets`: sharded data. Bucket k is the concatenation over ranks r = 0..N-1 of a segment
  of `length` elements holding chunk k of the parameters rank r owns (zero padded), so that a
  ReduceScatter hands rank r exactly its own gradients and an AllGather of each rank's segment
  gives every rank every owner's parameters. Each rank's owned list is cut into the same number
  of chunks of about equal size, so the padding stays small (the parameters are balanced across
  ranks by `assign_owners`).
Both come in gradient-readiness order: the backward pass produces gradients in reverse parameter
order (lm_head first, the embedding last), so parameters are packed from the last one down and the
buckets are sorted by the moment their last gradient appears (their lowest parameter index,
highest first). The first collective can then start while the backward pass still runs, instead
of every bucket waiting for the embedding's gradient. The order is a function of the sizes only,
the same on every rank.
Why buckets: one collective per parameter is ~195 AllReduce + ~195 Broadcast per step for a 7B
model, each paying a launch and a latency; a few large buckets keep the link busy. Why a cap:
a bucket is a transient copy, so the cap bounds the extra memory of the reduction.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable


def assign_owners(sizes: list[int], world: int) -> list[int]:
    """Owner rank of each parameter: largest first, to the rank holding the fewest elements so far.

    Deterministic (ties go to the lower index and the lower rank), so every rank computes the
    same table without communicating, and a resumed run with the same world gets the same one.
    """
    load = [0] * world
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += sizes[i]
    return owner


@dataclass(frozen=True)
class FlatBucket:
    indices: tuple[int, ...]  # parameter indices, in order
    sizes: tuple[int, ...]  # their element counts

    @property
    def numel(self) -> int:
        return sum(self.sizes)


@dataclass(frozen=True)
class RankBucket:
    segments: tuple[tuple[int, ...], ...]  # segments[r]: parameter indices rank r owns in this bucket
    sizes: tuple[tuple[int, ...], ...]  # their element counts
    length: int  # elements per rank segment (the largest segment; others are zero padded)
    split: bool = False  # one split parameter: segment r is slice r of it (`split_buckets`)

    @property
    def numel(self) -> int:
        return self.length * len(self.segments)

    def used(self, rank: int) -> int:
        return sum(self.sizes[rank])


def slice_bounds(n: int, world: int, rank: int) -> tuple[int, int]:
    """[start, stop) of rank `rank`'s slice of a split parameter of n elements (see the module
    docstring): c = ceil(n / world) elements each, the last ranks' slices shorter by < world."""
    c = -(-n // world)
    return min(n, rank * c), min(n, (rank + 1) * c)


def splits(sizes: list[int], world: int, split: int) -> list[bool]:
    """Which parameters are cut into `world` slices: at least `split` elements (split <= 0: none)
    and at least world² elements, so that no rank's slice is empty (the sizes differ by < world)."""
    return [world > 1 and split > 0 and n >= split and n >= world * world for n in sizes]


def split_buckets(sizes: list[int], split: list[bool], world: int) -> list[RankBucket]:
    """One rank bucket per split parameter, from the last one down: segment r is slice r."""
    out = []
    for i in reversed(range(len(sizes))):
        if split[i]:
            lengths = tuple(b - a for a, b in (slice_bounds(sizes[i], world, r) for r in range(world)))
            out.append(RankBucket(tuple((i,) for _ in range(world)), tuple((n,) for n in lengths), lengths[0], split=True))
    return out


def flat_buckets(sizes: list[int], keys: list[object], cap: int) -> list[FlatBucket]:
    """Parameters grouped by key (e.g. the wire dtype), then packed from the last parameter down
    into buckets of at most `cap` elements, in readiness order (`by_readiness`). cap <= 0: one
    bucket per parameter."""
    out: list[FlatBucket] = []
    for key in dict.fromkeys(keys):
        cur: list[int] = []
        total = 0
        for i in reversed(range(len(sizes))):
            n, k = sizes[i], keys[i]
            if k != key:
                continue
            if cur and (cap <= 0 or total + n > cap):
                out.append(FlatBucket(tuple(cur), tuple(sizes[j] for j in cur)))
                cur, total = [], 0
            cur.append(i)
            total += n
        if cur:
            out.append(FlatBucket(tuple(cur), tuple(sizes[j] for j in cur)))
    return by_readiness(out, lambda b: b.indices)


def readiness(indices: Iterable[int]) -> int:
    """When a bucket's gradients are all there, as a rank in backward order: its lowest parameter
    index (the backward pass ends with parameter 0); higher is earlier."""
    return min(indices)


def by_readiness(buckets: list, indices_of: Callable[[Any], Iterable[int]]) -> list:
    """Buckets sorted so that the one whose gradients are complete first comes first (stable)."""
    return sorted(buckets, key=lambda b: -readiness(indices_of(b)))


def _chunks(indices: list[int], sizes: list[int], n_chunks: int) -> list[list[int]]:
    """Cut an ordered list into n_chunks runs of about equal element count (some may be empty)."""
    total = sum(sizes[i] for i in indices)
    out: list[list[int]] = [[] for _ in range(n_chunks)]
    acc = 0
    for i in indices:
        # the chunk this parameter's midpoint falls in: balanced without look-ahead
        k = min(n_chunks - 1, int((acc + sizes[i] / 2) * n_chunks / total)) if total else 0
        out[k].append(i)
        acc += sizes[i]
    return out


def rank_buckets(owner: list[int], sizes: list[int], keys: list[object], world: int,
                 cap: int) -> tuple[list[RankBucket], list[int]]:
    """Buckets for sharded collectives, grouped by key (wire or parameter dtype): see the module
    docstring. cap: elements of the whole bucket (all ranks' segments); cap <= 0: the k-th owned
    parameter of every rank per bucket.

    Returns (buckets, singletons): a bucket more than a quarter padding (one rank owns a large
    parameter that no other rank can match, e.g. lm_head alone on an fp32 wire) is dissolved and
    its parameters go to `singletons`, which the step moves with one collective each, so padding
    never costs more than a third of the bytes it moves. Buckets in readiness order
    (`by_readiness`), singletons from the last parameter down."""
    buckets: list[RankBucket] = []
    singletons: list[int] = []
    for key in dict.fromkeys(keys):
        # from the last parameter down: chunk 0 holds the gradients the backward pass produces first
        mine = [[i for i in reversed(range(len(sizes))) if owner[i] == r and keys[i] == key] for r in range(world)]
        load = max(sum(sizes[i] for i in m) for m in mine)
        if load == 0:
            continue
        most = max(len(m) for m in mine)
        if cap <= 0:  # the k-th owned parameter of every rank
            n_chunks = most
            per_rank = [[m[k:k + 1] for k in range(most)] for m in mine]
        else:
            n_chunks = min(most, max(1, math.ceil(load * world / cap)))
            per_rank = [_chunks(m, sizes, n_chunks) for m in mine]
        for k in range(n_chunks):
            segs = tuple(tuple(per_rank[r][k]) for r in range(world))
            if not any(segs):
                continue
            seg_sizes = tuple(tuple(sizes[i] for i in s) for s in segs)
            b = RankBucket(segs, seg_sizes, max(sum(s) for s in seg_sizes))
            if 4 * sum(b.used(r) for r in range(world)) < 3 * b.numel:
                singletons.extend(sorted(i for s in segs for i in s))
            else:
                buckets.append(b)
    return by_readiness(buckets, _bucket_indices), sorted(singletons, reverse=True)


def assign_owners_grouped(sizes: list[int], keys: list[object], world: int) -> list[int]:
    """`assign_owners` within each key group (the parameter dtype), largest group first and
    continuing from the loads so far: every rank's share of each group is balanced, so the
    groups' rank buckets need little padding, and the total stays balanced."""
    load = [0] * world
    owner = [0] * len(sizes)
    groups = list(dict.fromkeys(keys))
    groups.sort(key=lambda k: -sum(n for n, kk in zip(sizes, keys) if kk == k))
    for key in groups:
        for i in sorted((i for i in range(len(sizes)) if keys[i] == key), key=lambda i: (-sizes[i], i)):
            r = min(range(world), key=lambda r: (load[r], r))
            owner[i] = r
            load[r] += sizes[i]
    return owner


def split_elements_for(split_mb: float | str, cap: int) -> int:
    """`optim.split_mb` in elements (4 bytes each): "auto" is the bucket cap (a parameter that
    large has a bucket of its own anyway, so cutting it adds no collective); 0: never split."""
    if isinstance(split_mb, str):
        return cap
    return cap_elements(float(split_mb))


ASCEND_BUCKET_MB = 256.0
CPU_BUCKET_MB = 32.0


def bucket_mb_for(bucket_mb: float | str, target: str) -> float:
    """`optim.bucket_mb` as it runs on `target`: a number as given; "auto" by device.

    Ascend: 256 MB, a few large buckets per step (HCCL pays a launch and a latency per call).
    CPU: 32 MB. MindSpore's CPU collectives (mccl) over loopback gain nothing from large buckets,
    and MindSpore's CPU backend holds four to six times a bucket's bytes while it crosses (its flat
    copy, the all-reduced result, the slices cut from it, mccl's received chunks: measured in
    docs/benchmarks/memory.md run 5), so a large bucket is a large, step-long transient there.
    Any other target (a plan for `device.target = "auto"`) plans Ascend's production value."""
    if isinstance(bucket_mb, str):
        return CPU_BUCKET_MB if target == "cpu" else ASCEND_BUCKET_MB
    return float(bucket_mb)


def cap_elements(bucket_mb: float) -> int:
    """The bucket cap in elements of 4 bytes (0 = one collective per parameter)."""
    return int(bucket_mb * 2**20 // 4) if bucket_mb > 0 else 0


LOCAL = -2  # the owner of a parameter every rank holds its own piece of (`plan_layout`'s `local`)


@dataclass(frozen=True)
class Layout:
    """Everything the step and the planner derive from the parameter sizes: owners and the
    packing of each collective. `wire16[i]`: gradient i crosses ranks in fp16; `half[i]`:
    parameter i is stored in fp16/bf16; `split[i]`: parameter i is cut into one slice per rank
    (its owner is -1: every rank owns a slice)."""

    sizes: tuple[int, ...]
    half: tuple[bool, ...]
    wire16: tuple[bool, ...]
    world: int
    sharded: bool  # optimizer state (ZeRO-1)
    shard_grads: bool  # and gradients (ZeRO-2)
    owner: tuple[int, ...]
    reduce_flat: tuple[FlatBucket, ...]  # replicated gradients: AllReduce
    reduce_rank: tuple[RankBucket, ...]  # sharded gradients: ReduceScatter
    reduce_single: tuple[int, ...]  # sharded gradients too lopsided to bucket: AllReduce each
    gather_rank: tuple[RankBucket, ...]  # owners' parameters: AllGather
    gather_single: tuple[int, ...]  # Broadcast each
    split: tuple[bool, ...] = ()
    zero3: bool = False  # the gathers and reduce-scatters are in the model's graph (`zero3_layout`)

    def is_split(self, i: int) -> bool:
        return bool(self.split) and self.split[i]

    def owned(self, rank: int) -> list[int]:
        """Parameters with optimizer state on `rank`: its whole ones, every split one (a slice) and
        every local one (`LOCAL`: this rank's own piece, whole)."""
        return [i for i, r in enumerate(self.owner) if r in (rank, LOCAL) or self.is_split(i)]

    def unit(self, i: int, rank: int) -> tuple[int, int]:
        """[start, stop) of the flattened parameter i whose state `rank` holds."""
        return slice_bounds(self.sizes[i], self.world, rank) if self.is_split(i) else (0, self.sizes[i])

    def owned_sizes(self, rank: int) -> list[int]:
        """Elements of each owned unit (`owned`'s order): the sizes of the state tensors."""
        return [b - a for a, b in (self.unit(i, rank) for i in self.owned(rank))]

    def heaviest_rank(self) -> int:
        """The rank holding the most elements (the one whose memory decides whether a run fits)."""
        return max(range(self.world), key=lambda r: (sum(self.owned_sizes(r)), -r))

    def traffic(self, accumulation: int = 1) -> tuple[int, int]:
        """(collective calls, bytes a rank hands to them) per step: payload sizes; a ring moves
        about 2·(N-1)/N of an AllReduce's payload and (N-1)/N of the others'. With sharded
        gradients the reduction runs once per micro-batch."""
        wb = lambda i: 2 if self.wire16[i] else 4
        pb = lambda i: 2 if self.half[i] else 4
        first = lambda b: next(s for s in b.segments if s)[0]
        red_calls = len(self.reduce_flat) + len(self.reduce_rank) + len(self.reduce_single)
        red_bytes = (sum(n * wb(i) for b in self.reduce_flat for i, n in zip(b.indices, b.sizes))
                     + sum(b.numel * wb(first(b)) for b in self.reduce_rank)
                     + sum(self.sizes[i] * wb(i) for i in self.reduce_single))
        times = accumulation if self.shard_grads else 1
        if self.zero3:  # per micro-batch, every parameter: a gather forward, a reduce-scatter backward
            n = len(self.sizes)  # (in the storage dtype both ways; layer recompute gathers once more)
            return 2 * n * accumulation, 2 * accumulation * sum(s * pb(i) for i, s in enumerate(self.sizes))
        gather_calls = len(self.gather_rank) + len(self.gather_single)
        gather_bytes = (sum(b.numel * pb(first(b)) for b in self.gather_rank)
                        + sum(self.sizes[i] * pb(i) for i in self.gather_single))
        return red_calls * times + gather_calls, red_bytes * times + gather_bytes

    def largest_bucket_bytes(self) -> tuple[int, int]:
        """(largest reduction payload, largest gather payload) in bytes: the transient copies.
        ZeRO-3 (no bucket): one gather and one reduce-scatter per parameter, both of the whole
        parameter in its storage dtype (step/zero3.py: the gradient of a bf16 weight is bf16),
        the largest being the lm_head's or the embedding's."""
        wb = lambda i: 2 if self.wire16[i] else 4
        pb = lambda i: 2 if self.half[i] else 4
        if self.zero3:
            whole = max((n * pb(i) for i, n in enumerate(self.sizes)), default=0)
            return whole, whole
        first = lambda b: next(s for s in b.segments if s)[0]
        red = [sum(n * wb(i) for i, n in zip(b.indices, b.sizes)) for b in self.reduce_flat]
        red += [b.numel * wb(first(b)) for b in self.reduce_rank] + [self.sizes[i] * wb(i) for i in self.reduce_single]
        gat = [b.numel * pb(first(b)) for b in self.gather_rank] + [self.sizes[i] * pb(i) for i in self.gather_single]
        return max(red, default=0), max(gat, default=0)


def plan_layout(sizes: list[int], half: list[bool], wire16: list[bool], world: int, *, shard: bool,
                shard_grads: bool, cap: int, split: int = 0, local: list[bool] | None = None) -> Layout:
    """Owners and buckets for `world` data-parallel ranks (world 1: no collectives). split: with
    sharding, parameters of at least this many elements are cut into a slice per rank (0: none).
    local: parameters every rank holds a piece of its own of (expert parallel's expert stacks): with
    sharding, owned whole by every rank (owner `LOCAL`), never cut and in no gather; their gradients
    are in the flat buckets, which the step (step/zero_setup.py) takes them out of."""
    shard_grads = shard_grads and world > 1
    sharded = (shard or shard_grads) and world > 1
    pkeys = ["half" if h else "fp32" for h in half]
    wkeys = ["fp16" if w else "fp32" for w in wire16]
    local = local or [False] * len(sizes)
    cut = [c and not lo for c, lo in zip(splits(sizes, world, split), local)] if sharded else [False] * len(sizes)
    whole = [i for i in range(len(sizes)) if not cut[i] and not local[i]]
    owner = [-1 if c else LOCAL if lo and sharded else 0 for c, lo in zip(cut, local)]  # -1: every rank owns a slice
    if sharded:
        for i, r in zip(whole, assign_owners_grouped([sizes[i] for i in whole], [pkeys[i] for i in whole], world)):
            owner[i] = r
    reduce_flat: list[FlatBucket] = []
    reduce_rank: list[RankBucket] = []
    reduce_single: list[int] = []
    gather_rank: list[RankBucket] = []
    gather_single: list[int] = []
    if world > 1:
        if shard_grads:
            # grouped by parameter dtype too: owners are balanced within those groups (little padding)
            rkeys = [f"{w}/{k}" for w, k in zip(wkeys, pkeys)]
            reduce_rank, reduce_single = rank_buckets(owner, sizes, rkeys, world, cap)
            reduce_rank = by_readiness(reduce_rank + split_buckets(sizes, cut, world), _bucket_indices)
        else:
            reduce_flat = flat_buckets(sizes, wkeys, cap)
        if sharded:
            gather_rank, gather_single = rank_buckets(owner, sizes, pkeys, world, cap)
            gather_rank = by_readiness(gather_rank + split_buckets(sizes, cut, world), _bucket_indices)
    return Layout(tuple(sizes), tuple(half), tuple(wire16), world, sharded, shard_grads, tuple(owner),
                  tuple(reduce_flat), tuple(reduce_rank), tuple(reduce_single), tuple(gather_rank), tuple(gather_single),
                  tuple(cut))


def zero3_layout(sizes: list[int], half: list[bool], wire16: list[bool], world: int) -> Layout:
    """ZeRO-3 (step/zero3.py): every parameter split into a slice per rank (`slice_bounds`), no
    bucket: the gathers and the reduce-scatters are in the model's graph, one per parameter."""
    n = len(sizes)
    return Layout(tuple(sizes), tuple(half), tuple(wire16), world, True, True, (-1,) * n, (), (), (), (), (), (True,) * n, True)


def _bucket_indices(b: RankBucket) -> Iterable[int]:
    return (i for s in b.segments for i in s)


# ------------------------------------------------------------------ what `train` refuses of a layout
# A pure check shared by `train` (step/zero3.py `sharded_names`) and `plan`'s layout table
# (preflight/layouts.py), so the table never recommends a layout `train` refuses (tensor parallel's:
# parallel/plan.py `tp_refusal`).

def zero3_refusal(sizes: dict[str, int], world: int) -> tuple[str, str] | None:
    """(cause, fix) when ZeRO-3 cannot cut the trained parameters `sizes` (name -> elements) over
    `world` ranks: every slice must hold elements (n >= world², as for split parameters)."""
    small = [n for n, k in sizes.items() if k < world * world]
    if not small:
        return None
    return (f"optim.shard_parameters: {small[0]} has {sizes[small[0]]} elements, fewer than world² = {world * world}",
            "use fewer ranks or optim.shard_gradients=true (ZeRO-2)")
