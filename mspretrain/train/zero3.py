"""ZeRO-3 (`optim.shard_parameters`): every rank holds one slice of every trained parameter; a
layer's weights are gathered right before use and the gradients are reduce-scattered into the slices.

The slices are those of split parameters (train/layout.py `slice_bounds`): rank r holds elements
[r*c, min(n, (r+1)*c)) of the flattened parameter, c = ceil(n/N), as a 1-D Parameter of that
length under the parameter's own name. The optimizer state of a slice is then exactly the state a
split parameter's owner holds under ZeRO-1/2 (`exp_avg.NAME@START:STOP`), so checkpoints re-cut
across layouts with the code that already does it (train/step.py `_assemble`).

`ShardedGather` is the one primitive: forward, the slice -> the whole weight (a collective);
backward, the whole weight's gradient -> this rank's slice of its sum over ranks. MindSpore 2.10's
own bprop of AllGather is a ReduceScatter (ops/_grad_experimental/grad_comm_ops.py,
`get_bprop_all_gather`), and the bprop of AllReduce(SUM) an AllReduce (`get_bprop_all_reduce`); the
primitive writes its bprop by hand so that it can (a) cut the slice out of the CPU form's
AllReduce and (b) order the backward's collectives (below). By device, as train/step.py does it:
- Ascend: `ops.AllGather` of the zero-padded slice (every rank's input must be c elements), and
  `ops.ReduceScatter(SUM)` of the zero-padded flattened gradient (HCCL has both).
- CPU: MindSpore 2.10's mccl has no ReduceScatter kernel and a second AllGather in one graph fails
  (train/step.py says more), so the gather is an AllReduce of a full-size buffer holding this rank's
  slice at its place and zeros elsewhere (a sum of disjoint pieces: exact), and the reduce-scatter
  an AllReduce of the gradient followed by the rank's slice of it. The same numbers.

Order of the collectives. On CPU the runtime launches a ready kernel whenever it is ready, and
every slice is ready at the start of the step, so unordered gathers would run in a different order
on each rank and mccl would pair one rank's wqkv with another's w13. Each gather therefore takes an
`anchor`, the input of the cell that uses the weight (the activation entering the Linear, the
RMSNorm; the tokens for the embedding): a layer's gather starts once the previous weight has been
used, a total order that is the forward's data flow, the same on every rank. The backward mirrors
it: the bprop returns, as the anchor's gradient, zeros that depend on its reduce-scatter; they are
added into the gradient of the activation, from which every earlier weight's gradient is computed,
so the reduce-scatters run in exactly the reverse order of the gathers on every rank. On Ascend
the same anchors make the compiled order a function of the data flow, which tests/
test_collective_sequence.py compares rank by rank.

No prefetch: a gather anchored on its cell's input cannot start before the previous cell is done,
so a layer's gather does not overlap the previous layer's compute. Overlap would need the gathers
chained among themselves (gather k+1 after gather k, not after cell k's compute), which needs a
token threaded through every cell's signature; not done.

Memory. The slices (weights, and the fp32 master, moments and gradient buffer of each) are 1/N of
the model on every rank. A gathered weight is a graph intermediate: in MindSpore's graph mode its
memory is released after its last user, and the last user of a layer's gathered weight is that
layer's backward (dX = dY·W needs it), so without recompute the gathered weights of all layers are
alive from their forward to their backward: the forward keeps them like activations (the saving is
in the gradients and the optimizer state, and in the weights between steps). With `train.recompute`
the backward recomputes each layer's forward, the gather included, so a layer's gathered weights
are alive during its forward and again during its recomputation and backward only: at most one
layer's gathered weights (plus the embedding / lm_head) at a time.
"""
from __future__ import annotations

import math
from typing import Callable

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from mspretrain.errors import UserError
from mspretrain.train.layout import slice_bounds

__all__ = ["ShardedGather", "shard_model", "sharded_names", "full_state", "load_full_state"]


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
    """The parameters ZeRO-3 cuts: the trained ones (`names`). Refuses a model or world it cannot
    serve, in one line: a slice must not be empty (n >= N² elements, as for split parameters), and
    the Qwen3 QK-norm's two weights are used side by side on one input, so their gathers would have
    no order between them (module docstring)."""
    if getattr(getattr(model, "cfg", None), "qk_norm", False):
        raise UserError("optim.shard_parameters does not support model.qk_norm yet (its q and k norms gather unordered)",
                        "use optim.shard_gradients=true (ZeRO-2) for this model")
    sizes = {p.name: int(np.prod(p.shape)) for p in model.trainable_params()}
    small = [n for n in names if sizes[n] < world * world]
    if small:
        raise UserError(f"optim.shard_parameters: {small[0]} has {sizes[small[0]]} elements, fewer than world² = {world * world}",
                        "use fewer ranks or optim.shard_gradients=true (ZeRO-2)")
    return list(names)


def shard_model(model: nn.Cell, names: list[str], world: int, rank: int, device: str) -> None:
    """Replace each named parameter of `model` by this rank's 1-D slice (same name) and give the
    cell that holds it a `ShardedGather` (`cell.gather`), which the cell's construct calls. The
    cells that hold weights: Linear, Embedding, RMSNorm (model/llama.py)."""
    want = set(names)
    for _, cell in model.cells_and_names():
        p = getattr(cell, "weight", None)
        if not isinstance(p, Parameter) or p.name not in want:
            continue
        if getattr(cell, "has_bias", False) and cell.bias.name in want:  # Qwen2's q/k/v bias: not gathered yet
            raise UserError("optim.shard_parameters does not support model.qkv_bias yet",
                            "use optim.shard_gradients=true (ZeRO-2) for this model")
        n = int(np.prod(p.shape))
        a, b = slice_bounds(n, world, rank)
        value = p.asnumpy().reshape(-1)[a:b].copy()
        name, dtype, shape = p.name, p.dtype, tuple(p.shape)
        cell.gather = ShardedGather(shape, world, rank, device)
        cell.weight = Parameter(Tensor(value).astype(dtype), name=name, requires_grad=p.requires_grad)
        cell.weight.name = name  # the Cell may prefix a Parameter assigned later: keep the model's name
        want.discard(name)
    if want:
        raise UserError(f"optim.shard_parameters cannot shard {sorted(want)[0]} (no cell gathers it)",
                        "use optim.shard_gradients=true (ZeRO-2) for this model")


def gathered_cells(model: nn.Cell) -> list[tuple[str, nn.Cell]]:
    """(parameter name, cell) of every sharded weight, in the model's parameter order."""
    return [(c.weight.name, c) for _, c in model.cells_and_names() if getattr(c, "gather", None) is not None]


def full_state(model: nn.Cell, jit: bool = True) -> Callable[[], dict[str, np.ndarray]]:
    """A function returning every parameter whole by name (a checkpoint's model file; fp16 ones as
    fp16, the rest fp32): the slices gathered in one compiled graph, one collective per parameter,
    each after the previous one (the same order on every rank; every rank must call it). The whole
    model is then on the host of each rank, transiently: what a checkpoint of whole weights costs
    (docs/design.md, ZeRO-3)."""
    cells = gathered_cells(model)
    gathers = [c.gather for _, c in cells]
    params = [c.weight for _, c in cells]
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
        whole = {name: w for (name, _), w in zip(cells, fn(token))}
        out = {}
        for p in model.get_parameters():
            value = whole.get(p.name, p)
            out[p.name] = value.asnumpy() if value.dtype in (ms.float32, ms.float16) else value.astype(ms.float32).asnumpy()
        return out

    return run


def load_full_state(model: nn.Cell, tensors: dict[str, np.ndarray], world: int, rank: int) -> None:
    """Load whole tensors (a checkpoint's model file, any layout) into a sharded model: each sharded
    parameter takes its slice, the others their whole value. Shapes are checked against the whole
    shapes the gathers produce."""
    from mspretrain.model.llama import load_numpy

    whole_shape = {name: c.gather.shape for name, c in gathered_cells(model)}
    for name, shape in whole_shape.items():
        if name in tensors and tuple(np.shape(tensors[name])) != shape:
            raise UserError(f"tensor {name} has shape {tuple(np.shape(tensors[name]))}, the model expects {shape}",
                            "the checkpoint was written for a different model config; use the config saved with it")
    cut = {}
    for name, arr in tensors.items():
        if name in whole_shape:
            a, b = slice_bounds(math.prod(whole_shape[name]), world, rank)
            cut[name] = np.asarray(arr).reshape(-1)[a:b]
        else:
            cut[name] = arr
    load_numpy(model, cut)
