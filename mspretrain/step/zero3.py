"""ZeRO-3 (`optim.shard_parameters`): every rank holds one slice of every trained parameter; a
layer's weights are gathered right before use and the gradients are reduce-scattered into the slices.

The slices are those of split parameters (parallel/layout.py `slice_bounds`): rank r holds elements
[r*c, min(n, (r+1)*c)) of the flattened parameter, c = ceil(n/N), as a 1-D Parameter of that
length under the parameter's own name. The optimizer state of a slice is then exactly the state a
split parameter's owner holds under ZeRO-1/2 (`exp_avg.NAME@START:STOP`), so checkpoints re-cut
across layouts with the code that already does it (step/step.py `_assemble`).

`ShardedGather` is the one primitive: forward, the slice -> the whole weight (a collective);
backward, the whole weight's gradient -> this rank's slice of its sum over ranks. MindSpore 2.10's
own bprop of AllGather is a ReduceScatter (ops/_grad_experimental/grad_comm_ops.py,
`get_bprop_all_gather`), and the bprop of AllReduce(SUM) an AllReduce (`get_bprop_all_reduce`); the
primitive writes its bprop by hand so that it can (a) cut the slice out of the CPU form's
AllReduce and (b) order the backward's collectives (below). By device, as step/step.py does it:
- Ascend: `ops.AllGather` of the zero-padded slice (every rank's input must be c elements), and
  `ops.ReduceScatter(SUM)` of the zero-padded flattened gradient (HCCL has both).
- CPU: MindSpore 2.10's mccl has no ReduceScatter kernel and a second AllGather in one graph fails
  (step/step.py says more), so the gather is an AllReduce of a full-size buffer holding this rank's
  slice at its place and zeros elsewhere (a sum of disjoint pieces: exact), and the reduce-scatter
  an AllReduce of the gradient followed by the rank's slice of it. The same numbers.

Order of the collectives. On CPU the runtime launches a ready kernel whenever it is ready, and
every slice is ready at the start of the step, so unordered gathers would run in a different order
on each rank and mccl would pair one rank's wqkv with another's w13. Each gather therefore takes an
`anchor` it waits for, and the gathers form one chain: the embedding's after the tokens, each
block's weights after the previous gathered weight in the order the forward uses them (model/
decoder.py `Block.pull`: attn_norm, wqkv, its bias, q_norm, k_norm, wo, mlp_norm, w13, w2), the
final norm's and the lm_head's last. The backward mirrors it: the bprop returns, as the anchor's
gradient, zeros that depend on its reduce-scatter; they are added into the gradient of the
previous gathered weight, whose reduce-scatter therefore comes after, so the reduce-scatters run in
exactly the reverse order of the gathers on every rank. On Ascend the same chain makes the compiled
order a function of the data flow, which tests/step/test_collective_sequence.py compares rank by rank.

Prefetch (model/block.py). A block's chain starts from the token the previous block hands on:
one element of its last gathered weight, made to depend on that block's input x_k (`relay`). So
block k+1's gathers run as soon as block k's are done and block k has started, while block k
computes, and block k+2's wait for x_{k+1}, the end of block k: at most two blocks' gathered
weights at once (the head's gathers likewise after the last block's input). Measured in the
compiled graph (tests/step/test_zero3.py, tests/step/zero3_graph_probe.py): block 1's gathers wait for none
of block 0's matmuls, the head's for all of block 0's and none of block 1's, and no matmul waits
for a reduce-scatter (their order is carried by the weights' gradients, not the activations'), so
the backward's reduce-scatters overlap the previous block's backward.

Prefetch and recompute. The gathers are inside the block's cell, so `train.recompute` (Cell.
recompute) recomputes them: the compiled graph holds each block's gathers twice (27 = 15 + 2 x 6
in the 2-layer test model), which keeps the memory bound. The token is a block output, which
recompute excludes from recomputation (Cell.recompute's docstring, MindSpore 2.10 nn/cell.py:
"The outputs of cell are excluded from recomputation"): one element is kept per block. The
recomputed gathers start from the kept token and are placed by MindSpore's recompute pass before
their first backward user; nothing orders them against the next block's reduce-scatters (the
graph of the 2-layer model has 63 unordered pairs of collectives). On Ascend the order is the
compiled one, the same on every rank (test_collective_sequence.py); on the CPU the runtime's launch
order would decide, so there, with recompute, a block's chain starts from its own input x
instead (`prefetches`: no prefetch, the order the chain had before it, whose graph leaves 2 pairs
unordered, a block's last re-gather and its first reduce-scatter, which the 2-rank msrun resume
with recompute has always run through). Without recompute the CPU prefetches too: every
collective is then in one order in the graph (the test checks it).

Checkpoints: no gather. Each rank writes its slices (`slice_state`) to a file of its own and a
resume reads just its ranges (`wanted_ranges`) of whichever form the weights were written in
(checkpoint/model_shards.py).

Memory. The slices (weights, and the fp32 master, moments and gradient buffer of each) are 1/N of
the model on every rank. A gathered weight is a graph intermediate: in MindSpore's graph mode its
memory is released after its last user, and the last user of a layer's gathered weight is that
layer's backward (dX = dY·W needs it), so without recompute the gathered weights of all layers are
alive from their forward to their backward: the forward keeps them like activations (the saving is
in the gradients and the optimizer state, and in the weights between steps). With `train.recompute`
the backward recomputes each layer's forward, the gather included, so a layer's gathered weights
are alive during its forward and again during its recomputation and backward only; with the
prefetch the next layer's (or the head's) are gathered while a layer computes: at most two units'
gathered weights at once (preflight/costs.py `gathered_bytes`), one layer's plus the lm_head's without it.
"""
from __future__ import annotations

import math
from typing import Callable, Iterator

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from mspretrain.errors import UserError
from mspretrain.model.layers import WeightCell
from mspretrain.parallel.layout import slice_bounds
from mspretrain.parallel.shard_key import shard_key

__all__ = ["ShardedGather", "shard_model", "sharded_names", "gathered", "full_state", "load_full_state"]


class ShardedGather(nn.Cell):
    """slice (1-D, this rank's `slice_bounds`) + anchor -> the whole weight of `shape`, by device
    (see the module docstring). bprop: the gradient's sum over ranks, this rank's slice of it."""

    def __init__(self, shape: tuple[int, ...], world: int, rank: int, device: str) -> None:
        super().__init__()
        self.shape = tuple(shape)
        self.n = int(np.prod(shape))
        self.world, self.rank = world, rank
        self.c = -(-self.n // world)
        a, b = slice_bounds(self.n, world, rank)
        self.len = b - a
        self.ascend = device == "ascend"
        if self.ascend:  # HCCL: the real collectives (comm_ops.py AllGather, ReduceScatter)
            self.all_gather = ops.AllGather()
            self.reduce_scatter = ops.ReduceScatter(ops.ReduceOp.SUM)
        else:  # mccl: AllReduce forms (module docstring)
            self.all_reduce = ops.AllReduce(ops.ReduceOp.SUM)

    def _padded(self, flat: Tensor, before: int, after: int) -> Tensor:
        parts = ([ops.zeros((before,), flat.dtype)] if before else []) + [flat] + ([ops.zeros((after,), flat.dtype)] if after else [])
        return parts[0] if len(parts) == 1 else ops.concat(parts)

    def construct(self, piece: Tensor, anchor: Tensor) -> Tensor:
        if self.ascend:  # every rank hands c elements; the result is rank 0's, rank 1's, ... in order
            flat = self._padded(piece.reshape(-1), 0, self.c - self.len)
            full = self.all_gather(ops.depend(flat, anchor))
        else:  # this rank's slice at its place, zeros elsewhere: the sum is the whole tensor
            start = self.rank * self.c
            flat = self._padded(piece.reshape(-1), start, self.world * self.c - start - self.len)
            full = self.all_reduce(ops.depend(flat, anchor))
        if self.world * self.c != self.n:
            full = full[:self.n]
        return full.reshape(self.shape)

    def bprop(self, piece: Tensor, anchor: Tensor, out: Tensor, dout: Tensor) -> tuple[Tensor, Tensor]:
        g = self._padded(dout.reshape(-1), 0, self.world * self.c - self.n)
        if self.ascend:
            mine = self.reduce_scatter(g)
        else:
            start = self.rank * self.c
            mine = self.all_reduce(g)[start:start + self.c]
        if self.len != self.c:
            mine = mine[:self.len]
        # zeros that exist only after this reduce-scatter: added into the anchor's gradient, they
        # make every earlier weight's gradient, hence its reduce-scatter, wait for this one
        return mine.reshape(piece.shape).astype(piece.dtype), ops.depend(ops.zeros_like(anchor), mine)


def sharded_names(model: nn.Cell, names: list[str], world: int) -> list[str]:
    """The parameters ZeRO-3 cuts: the trained ones (`names`). Refuses a world it cannot serve, in
    one line: a slice must not be empty (n >= N² elements, as for split parameters)."""
    from mspretrain.parallel.layout import zero3_refusal

    sizes = {p.name: int(np.prod(p.shape)) for p in model.trainable_params()}
    refused = zero3_refusal({n: sizes[n] for n in names}, world)  # plan's layout table asks the same
    if refused:
        raise UserError(*refused)
    return list(names)


def _slice_of(p: Parameter, world: int, rank: int, device: str) -> tuple[Parameter, ShardedGather]:
    """This rank's 1-D slice of `p` (same name, dtype, requires_grad) and its gather."""
    n = int(np.prod(p.shape))
    a, b = slice_bounds(n, world, rank)
    from mspretrain.model.lazy import whole_value
    from mspretrain.model.parallel import piece_tensor

    # only the slice goes to the device (piece_tensor); the model was drawn on the host (train/build.py),
    # a lazily drawn weight into an array freed with this frame, not into `p` (model/lazy.py `whole_value`)
    piece = Parameter(piece_tensor(whole_value(p).reshape(-1)[a:b].copy(), p.dtype, device), p.name, p.requires_grad)
    return piece, ShardedGather(tuple(p.shape), world, rank, device)


def shard_model(model: nn.Cell, names: list[str], world: int, rank: int, device: str) -> None:
    """Replace each named parameter of `model` by this rank's 1-D slice (same name) and give the
    cell that holds it a `ShardedGather`, which the cell's `pull` calls: `cell.gather` for a weight
    (Linear, Embedding, RMSNorm: model/layers.py), `cell.bias_gather` for Qwen2's q/k/v bias; and
    switch the model to its sharded forward (`model.sharded`, each block's `prefetch`).

    Every weight is sliced and gathered, the small ones too (Qwen2's q/k/v bias, Qwen3's QK-norm
    weights, the RMSNorm weights): one rule for every parameter, so the optimizer state of each is
    a slice and the checkpoint re-cuts as for any other; keeping the small ones replicated would
    need an all-reduce of their gradients outside the model's graph, a second mechanism with its own
    order to keep, for under 0.1 % of the parameters. Their gathers are links of the block's chain
    like the others (model/block.py `Block.pull`)."""
    want = set(names)
    for cell in weight_cells(model):
        p = cell.weight
        if p.name in want:
            name = p.name
            cell.weight, cell.gather = _slice_of(p, world, rank, device)
            cell.weight.name = name  # the Cell may prefix a Parameter assigned later: keep the model's name
            want.discard(name)
        bias = cell.bias if cell.has_bias else None
        if bias is not None and bias.name in want:
            if cell.gather is None:  # its gather is chained after its gathered weight's (Linear.pull)
                raise UserError(f"optim.shard_parameters cannot shard {bias.name} while its weight is frozen",
                                "train the weight too (train.trainable), or use optim.shard_gradients=true (ZeRO-2)")
            name = bias.name
            cell.bias, cell.bias_gather = _slice_of(bias, world, rank, device)
            cell.bias.name = name
            want.discard(name)
    if want:
        raise UserError(f"optim.shard_parameters cannot shard {sorted(want)[0]} (no cell gathers it)",
                        "use optim.shard_gradients=true (ZeRO-2) for this model")
    model.sharded = True  # Decoder.construct runs the token chain (model/block.py)
    for layer in getattr(model, "layers", ()):
        layer.prefetch = prefetches(layer, device)


def prefetches(block: nn.Cell, device: str) -> bool:
    """Whether `block`'s gathers start from the previous block's token (the prefetch) rather than
    from its own input: everywhere but the CPU with layer recompute (module docstring, "Prefetch
    and recompute"). Recompute is read from the cell: `Cell.recompute()` sets
    `_has_config_recompute` (MindSpore 2.10 nn/cell.py, `Cell._recompute`)."""
    return device == "ascend" or not getattr(block, "_has_config_recompute", False)


def weight_cells(model: nn.Cell) -> list[WeightCell]:
    """The model's weight-holding cells (model/layers.py `WeightCell`: Linear, Embedding, RMSNorm),
    each declaring its ZeRO-3 gathers, in the model's cell order."""
    return [c for _, c in model.cells_and_names() if isinstance(c, WeightCell)]


def gathered(model: nn.Cell) -> list[tuple[str, ShardedGather, Parameter]]:
    """(parameter name, its gather, its slice) of every sharded parameter, in the model's parameter order."""
    out = []
    for c in weight_cells(model):
        if c.gather is not None:
            out.append((c.weight.name, c.gather, c.weight))
        if c.bias_gather is not None:
            out.append((c.bias.name, c.bias_gather, c.bias))
    return out


def full_state(model: nn.Cell, jit: bool = True) -> Callable[[], dict[str, np.ndarray]]:
    """A function returning every parameter whole by name (fp16 ones as fp16, the rest fp32): the
    slices gathered in one compiled graph, one collective per parameter, each after the previous one
    (the same order on every rank; every rank must call it). The whole model is then on the host of
    each rank, transiently, so checkpoints do not use it (each rank writes its slices: `slice_state`);
    the replicas' end-of-run hash and the tests do."""
    cells = gathered(model)
    gathers = [g for _, g, _ in cells]
    params = [p for _, _, p in cells]
    token = Tensor(np.zeros((1,), np.float32))

    def gather_all(anchor):
        out = []
        for g, p in zip(gathers, params):
            w = g(p * 1, anchor)  # `p * 1`: a computed tensor, read after a pending update
            out.append(w)
            anchor = w.reshape(-1)[:1]  # the next gather after this one
        return tuple(out)

    fn = ms.jit(gather_all) if jit else gather_all

    def run() -> dict[str, np.ndarray]:
        whole = {name: w for (name, _, _), w in zip(cells, fn(token))}
        out = {}
        for p in model.get_parameters():
            value = whole.get(p.name, p)
            out[p.name] = value.asnumpy() if value.dtype in (ms.float32, ms.float16) else value.astype(ms.float32).asnumpy()
        return out

    return run


def slice_state(model: nn.Cell, world: int, rank: int) -> tuple[dict[str, np.ndarray], dict[str, tuple[int, ...]]]:
    """This rank's part of a checkpoint's weights, without any collective (checkpoint/model_shards.py):
    each sharded parameter's slice as `NAME@START:STOP` (1-D; fp16 ones as fp16, the rest fp32),
    and on rank 0 the parameters no rank slices (frozen ones) whole; plus the whole shapes of
    every sharded parameter. Copies: the writer thread holds them while the next step runs."""
    sharded = {name: g.shape for name, g, _ in gathered(model)}
    out: dict[str, np.ndarray] = {}
    for p in model.get_parameters():
        value = (p.asnumpy() if p.dtype in (ms.float32, ms.float16) else p.astype(ms.float32).asnumpy()).copy()
        if p.name in sharded:
            a, b = slice_bounds(math.prod(sharded[p.name]), world, rank)
            out[shard_key(p.name, a, b)] = value.reshape(-1)
        elif rank == 0:
            out[p.name] = value
    return out, sharded


def wanted_ranges(model: nn.Cell, world: int, rank: int) -> dict[str, tuple[int, int]]:
    """[start, stop) of this rank's slice of every sharded parameter: what a resume reads of the
    checkpoint's weights (checkpoint/model_shards.py `read_pieces`); the others are read whole."""
    return {name: slice_bounds(math.prod(g.shape), world, rank) for name, g, _ in gathered(model)}


def one_at_a_time(model: nn.Cell, world: int, rank: int, device: str, jit: bool = True,
                  collective: Callable[[Tensor], Tensor] | None = None) -> Callable[[], Iterator[tuple[str, np.ndarray]]]:
    """A function yielding every parameter whole by name, in name order, one at a time (as
    `full_state` gives them: fp16 ones as fp16, the rest fp32), each gathered when it is asked for
    and dropped before the next: the end-of-run replica hash reads the model this way, where
    `full_state` held every gathered weight at once (61 GiB for Qwen3-14B: the job died after its
    final checkpoint, issue 51.4). Every rank must iterate it to the end, in step: one collective
    per sharded parameter, in name order. The collective is a compiled graph of its own per buffer
    size (a handful for a decoder: its layers repeat the shapes): AllGather of the zero-padded
    slice on Ascend, the CPU form's AllReduce of a whole-size buffer holding this rank's slice at
    its place (as `ShardedGather`)."""
    sharded = {name: (g, p) for name, g, p in gathered(model)}
    ascend = device == "ascend"
    op = ops.AllGather() if ascend else ops.AllReduce(ops.ReduceOp.SUM)

    def collect(buf: Tensor) -> Tensor:
        return op(buf)

    run_collective = collective or (ms.jit(collect) if jit else collect)  # `collective`: a test's loopback

    def whole(g: ShardedGather, p: Parameter) -> Tensor:  # p: this rank's 1-D slice of the weight of g.shape
        n, c = g.n, g.c
        a, b = slice_bounds(n, world, rank)
        flat = p.reshape(-1)
        before, after = (0, c - (b - a)) if ascend else (rank * c, world * c - rank * c - (b - a))
        parts = ([ops.zeros((before,), p.dtype)] if before else []) + [flat] + ([ops.zeros((after,), p.dtype)] if after else [])
        buf = parts[0] if len(parts) == 1 else ops.concat(parts)
        return run_collective(buf)[:n].reshape(g.shape)

    def run() -> Iterator[tuple[str, np.ndarray]]:
        for p in sorted(model.get_parameters(), key=lambda q: q.name):
            value = whole(*sharded[p.name]) if p.name in sharded else p
            yield p.name, (value.asnumpy() if value.dtype in (ms.float32, ms.float16) else value.astype(ms.float32).asnumpy())

    return run


def load_full_state(model: nn.Cell, tensors: dict[str, np.ndarray], world: int, rank: int) -> None:
    """Load a checkpoint's weights (written by any layout) into a sharded model: a sharded
    parameter takes its slice of a whole tensor, or the already cut 1-D slice (`wanted_ranges`,
    as `read_pieces` returns it); the others their whole value. Whole shapes are checked against
    the shapes the gathers produce, slices against this rank's length."""
    from mspretrain.model.decoder import load_numpy

    whole_shape = {name: g.shape for name, g, _ in gathered(model)}
    cut = {}
    for name, arr in tensors.items():
        arr = np.asarray(arr)
        if name not in whole_shape:
            cut[name] = arr
            continue
        shape = whole_shape[name]
        a, b = slice_bounds(math.prod(shape), world, rank)
        if tuple(arr.shape) == shape:
            cut[name] = arr.reshape(-1)[a:b]
        elif tuple(arr.shape) == (b - a,):  # this rank's slice, read as such
            cut[name] = arr
        else:
            raise UserError(f"tensor {name} has shape {tuple(arr.shape)}, the model expects {shape}",
                            "the checkpoint was written for a different model config; use the config saved with it")
    load_numpy(model, cut)
