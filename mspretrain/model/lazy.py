"""Weights drawn when first read, for a model cut on the host (ZeRO-3, tensor parallel, expert
parallel on an NPU: `Decoder(host_weights=True)`, model/decoder.py), and the one way a cut reads a
whole weight (`whole_value`). Below model/decoder.py and model/layers.py, so that every cut (tp's in
layers.py, ep's in moe.py, ZeRO-3's slicing in step/zero3.py) reads through it without an import
loop."""
from __future__ import annotations

from typing import Any

import numpy as np
from mindspore import Parameter
from mindspore.common.initializer import Initializer


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


def whole_value(p: Parameter) -> np.ndarray:
    """A parameter's whole value on the host, for a cut to read (expert parallel: `MoE.apply_ep`;
    tensor parallel: layers.py `WeightCell._cut`; ZeRO-3: step/zero3.py `_slice_of`).
    An undrawn one (`LazyDraw`) is drawn into a fresh array the caller alone holds, the Parameter
    left undrawn: `asnumpy` would draw it into the Parameter itself, and a dropped MindSpore 2.10
    Parameter is freed by Python's cycle collector, not by its reference count (measured: its drawn
    array stays alive after the last reference goes, until `gc.collect()`), so each whole weight a
    cut read would outlive its replacement for as long as the collector waits."""
    if p.has_init and isinstance(p.init, LazyDraw):
        x = np.empty(tuple(p.shape), np.float32)
        p.init(x)  # LazyDraw._initialize: the eager build's numbers
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
