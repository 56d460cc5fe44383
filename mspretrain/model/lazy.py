"""Weights drawn when first read, for a model cut on the host (ZeRO-3, tensor parallel, expert
parallel on an NPU: `Decoder(host_weights=True)`, model/decoder.py), and the one way a cut reads a
whole weight (`whole_value`). Below model/decoder.py and model/layers.py, so that every cut (tp's in
layers.py, ep's in moe.py, ZeRO-3's slicing in step/zero3.py) reads through it without an import
loop."""
from __future__ import annotations

from typing import Any, Mapping

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor
from mindspore.common.initializer import Initializer

from mspretrain.errors import UserError


class LazyDraw(Initializer):
    """Weight k of `streams` (model/decoder.py `InitStreams`), drawn only when its Parameter's data
    is first read (MindSpore 2.10's lazy initialisation: a Tensor built with `init=` is filled by `Tensor.init_data`, which
    `asnumpy` calls, common/tensor.py). For a model that will be cut on the host (ZeRO-3, tensor
    parallel on an NPU: `Decoder(host_weights=True)`): the cut reads one weight, keeps its piece and
    drops the whole, so a rank's host holds one whole weight at a time, not the whole fp32 model
    (issue 51.2). The numbers are `InitStreams.draw`'s: the index k is taken at creation."""

    def __init__(self, streams: Any, k: int, std: float) -> None:
        super().__init__()
        self.streams, self.k, self.std = streams, k, std

    def _initialize(self, arr: np.ndarray) -> None:
        x = np.ascontiguousarray(arr) if not arr.flags["C_CONTIGUOUS"] else arr
        self.streams.fill(self.k, x, self.std)
        if x is not arr:
            arr[...] = x


class LazyLoad(Initializer):
    """Weight `name` of `tensors` (a checkpoint's weights, mapped: checkpoint/tensor_file.py
    `mapped_tensors`), read only when its Parameter's data is first read, as `LazyDraw` draws:
    `train --init-from` into a model built for a cut on an NPU (`load_when_read`), so each rank's
    host holds one whole weight at a time and reads from the file what its cut keeps."""

    def __init__(self, tensors: Mapping[str, np.ndarray], name: str) -> None:
        super().__init__()
        self.tensors, self.name = tensors, name

    def _initialize(self, arr: np.ndarray) -> None:
        arr[...] = np.asarray(self.tensors[self.name], dtype=np.float32)


def undrawn(model: Any) -> bool:
    """Whether `model` was built for a cut on an NPU (`Decoder(host_weights=True)`): its weights are
    still `LazyDraw`n."""
    return any(p.has_init and isinstance(p.init, LazyDraw) for p in model.get_parameters())


def check_names_and_shapes(params: Mapping[str, Any], tensors: Mapping[str, Any]) -> None:
    """A strict load's checks: a missing, unexpected or mis-shaped tensor raises UserError naming it
    (`np.shape` of a mapped tensor reads none of its bytes)."""
    missing = sorted(set(params) - set(tensors))
    unexpected = sorted(set(tensors) - set(params))
    if missing:
        raise UserError(f"checkpoint has no tensor {missing[0]}" + (f" (and {len(missing) - 1} more missing)" if len(missing) > 1 else ""),
                        "the checkpoint was written for a different model config; use the config saved with it")
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise UserError(f"checkpoint has an unexpected tensor {unexpected[0]}" + more,
                        "the checkpoint was written for a different model config (tie_embeddings? n_layers?)")
    for name, p in params.items():
        shape = tuple(np.shape(tensors[name]))
        if shape != tuple(p.shape):
            raise UserError(f"tensor {name} has shape {shape}, the model expects {tuple(p.shape)}",
                            "the checkpoint was written for a different model config; use the config saved with it")


def load_when_read(model: Any, tensors: Mapping[str, np.ndarray]) -> None:
    """`tensors` into an undrawn model (`undrawn`), checked as `load_numpy` checks them, each
    Parameter replaced by one that reads its weight from `tensors` when first read (`LazyLoad`):
    the cut that follows (ZeRO-3's slicing, tp's, `apply_ep`, `send_undrawn`) reads, cuts and drops
    one whole weight at a time through `whole_value`, as it does with drawn weights."""
    check_names_and_shapes({p.name: p for p in model.get_parameters()}, tensors)
    for _, cell in model.cells_and_names():
        for attr, p in list(cell.parameters_and_names(expand=False)):
            name, grad, shape = p.name, p.requires_grad, tuple(p.shape)
            if p.dtype != ms.float32:  # not a drawn weight (a half-precision norm): small, loaded now
                p.set_data(Tensor(np.asarray(tensors[name], np.float32)).astype(p.dtype))
                continue
            Parameter.init_param = False  # left unread, as decoder.py `_normal` leaves a LazyDraw
            try:
                setattr(cell, attr, Parameter(Tensor(shape=shape, dtype=ms.float32, init=LazyLoad(tensors, name)), name, grad))
            finally:
                Parameter.init_param = True
            getattr(cell, attr).name = name  # the Cell may prefix a Parameter assigned later: keep the model's name
            del p


def whole_value(p: Parameter) -> np.ndarray:
    """A parameter's whole value on the host, for a cut to read (expert parallel: `MoE.apply_ep`;
    tensor parallel: layers.py `WeightCell._cut`; ZeRO-3: step/zero3.py `_slice_of`).
    An undrawn one (`LazyDraw`) is drawn into a fresh array the caller alone holds, the Parameter
    left undrawn: `asnumpy` would draw it into the Parameter itself, and a dropped MindSpore 2.10
    Parameter is freed by Python's cycle collector, not by its reference count (measured: its drawn
    array stays alive after the last reference goes, until `gc.collect()`), so each whole weight a
    cut read would outlive its replacement for as long as the collector waits."""
    if p.has_init and isinstance(p.init, (LazyDraw, LazyLoad)):
        x = np.empty(tuple(p.shape), np.float32)
        p.init(x)  # LazyDraw._initialize: the eager build's numbers; LazyLoad's: the checkpoint's
        return x
    return p.asnumpy()


def send_undrawn(model: Any, device: str) -> None:
    """Every weight of `model` (a Cell) still undrawn (`LazyDraw`: a model built with `host_weights` on
    an NPU) drawn on the host and replaced by a Parameter on the device (model/parallel.py
    `piece_tensor`, the piece being the whole), one at a time: the host holds one whole weight, the
    device what the eager build streamed there (model/decoder.py `_draw`). The numbers are the eager
    build's (a weight's streams are fixed by its index at creation). A model with nothing undrawn
    (the CPU, a loaded `--init-from`) is left as it is. Expert parallel's cut calls it after cutting
    the expert stacks (model/decoder.py `Decoder.apply_ep`)."""
    from mspretrain.model.parallel import piece_tensor

    for _, cell in model.cells_and_names():
        for attr in [k for k, p in cell.parameters_and_names(expand=False) if p.has_init]:
            p = getattr(cell, attr)
            name, grad = p.name, p.requires_grad
            # positionally, a temporary (see decoder.py `_normal`); the whole array is dropped with it, the old Parameter undrawn
            setattr(cell, attr, Parameter(piece_tensor(whole_value(p), p.dtype, device), name, grad))
            getattr(cell, attr).name = name  # the Cell may prefix a Parameter assigned later: keep the model's name
            del p
