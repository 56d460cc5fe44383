"""An exponential moving average of the weights during training (`train.ema_decay`).

After each applied optimizer step (an overflowed, skipped step changes no weight and is not
counted) the EMA takes the step's weights w_t:
    e_1 = w_1,   e_t = e_{t-1} - (1 - d) * (e_{t-1} - w_t)   (= d * e_{t-1} + (1 - d) * w_t)
in float32 on the host, with numpy, one parameter at a time through one scratch buffer (no
temporary the size of the model). It is saved beside each checkpoint and restored on resume and
rewind, so a killed and resumed run's EMA is the unbroken run's, bit for bit on CPU.

What it averages: the fp32 weights, which are the optimizer's masters when
`precision.param_dtype = fp32` (with "compute" the masters live in the optimizer state, which this
module does not read: refused in one line). Where they are:
- one process, or data parallel without a sharded optimizer: every rank holds every weight whole
  and owns all of it; rank 0 alone keeps the EMA and writes `ema.safetensors` (whole tensors, the
  model file's names);
- ZeRO-1/2 (a sharded optimizer): the weights are whole on every rank, but each rank keeps the EMA
  of exactly the units whose fp32 masters it owns, as the step decides them (step/zero_setup.py
  `plan_zero`, parallel/layout.py `assign_owners`: a parameter whole to one owner, or a split one's
  slice on every rank, read from that slice's 1-D master), plus rank 0 the untrained parameters
  whole; it writes `ema-RRRRR-of-NNNNN.safetensors`, ZeRO-3's per-rank format below (a slice
  `NAME@START:STOP`, 1-D; a whole parameter under its plain name and shape);
- ZeRO-3 (`optim.shard_parameters`): each rank keeps the EMA of its own slices and writes
  `ema-RRRRR-of-NNNNN.safetensors`, the format of its per-rank weight file (checkpoint/model_shards.py:
  `NAME@START:STOP` slices, the whole shapes in the metadata);
- tensor parallel: not supported yet (refused in one line).
A resume reads this rank's part back by range (model_shards' `read_pieces`: its slices; under
ZeRO-1/2 nothing of the parameters it does not own), so any layout and world size resumes any EMA
files (tests/train/test_ema.py: ZeRO-2 files read back at world 2, at world 3 and on one process).
The files are listed in the manifest like every other file. `mspretrain average RUN --last 1
--from-ema` turns a checkpoint's EMA into a checkpoint of its own (checkpoint/average.py reads
the files through model_shards' reader).

Cost: one pass over this rank's owned weights per step on the host, about 1/N of the model on each
of N ZeRO-1/2/3 ranks (a view of the live memory on CPU; a device-to-host copy on Ascend, which
this module does not hide). benchmarks/average_bench.py
`--ema-cost` measures the numpy update and extrapolates it to a 7B model.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

import numpy as np

from mspretrain.checkpoint.average import EMA_FILE, Source, ema_files, ema_shard_name, weight_view
from mspretrain.checkpoint.model_shards import read_pieces, shard_metadata
from mspretrain.errors import UserError
from mspretrain.parallel.shard_key import is_slice, parse_shard_key, shard_key


class WeightEMA:
    def __init__(self, decay: float, params: list[Any], *, keys: list[str], file_name: str,
                 shapes: dict[str, tuple[int, ...]] | None, wanted: dict[str, tuple[int, int] | None]) -> None:
        """`params`: the live fp32 tensors whose EMA this rank keeps (weights, or a split parameter's
        1-D master slice); `keys`: each one's stored name (`NAME` or a slice's `NAME@START:STOP`);
        `shapes`: the whole shapes of sliced parameters (the per-rank file's metadata) or None (the
        whole file); `wanted`: what this rank reads back of a stored EMA (read_pieces)."""
        self.decay, self.params, self.keys = float(decay), params, keys
        self.file_name, self.shapes, self.wanted = file_name, shapes, wanted
        self.values: list[np.ndarray] | None = None
        self._scratch = np.empty(max((math.prod(p.shape) for p in params), default=0), np.float32)

    def _flat(self, j: int) -> np.ndarray:
        return _host(self.params[j]).reshape(-1)

    def update(self) -> None:
        """Take the weights of the step just applied (the first call starts the average at them)."""
        if self.values is None:
            self.values = [self._flat(j).astype(np.float32, copy=True) for j in range(len(self.params))]
            return
        a = np.float32(1.0 - self.decay)
        for j, e in enumerate(self.values):
            s = self._scratch[:e.size]
            np.subtract(e, self._flat(j), out=s)
            s *= a
            e -= s

    def files(self, step: int) -> dict[str, tuple[dict[str, np.ndarray], dict[str, str]]]:
        """{file name: (tensors, safetensors metadata)} to save beside the checkpoint of `step`:
        copies, as the writer thread holds them while the next step runs. Empty before any update."""
        if self.values is None:
            return {}
        # a slice is stored 1-D (`NAME@START:STOP`), a whole tensor in its own shape
        tensors = {k: (e.copy() if is_slice(k) else e.reshape(p.shape).copy()) for k, e, p in zip(self.keys, self.values, self.params)}
        meta = shard_metadata(step, self.shapes) if self.shapes is not None else {"format": "mspretrain", "step": str(step)}
        return {self.file_name: (tensors, meta)}

    def load(self, ckpt: Path, log: Callable[[str], None]) -> None:
        """This rank's part of the EMA saved with `ckpt` (by any layout and world size: the reader
        cuts this rank's ranges from whichever files hold them); a checkpoint without one starts it afresh."""
        if not ema_files(p.name for p in Path(ckpt).iterdir()):
            self.values = None
            log(f"{Path(ckpt).name} holds no EMA of the weights: train.ema_decay starts one from the next step")
            return
        with weight_view(Source(0, Path(ckpt)), from_ema=True) as view:
            stored = read_pieces(view, self.wanted)
        values = []
        for k, p in zip(self.keys, self.params):
            name = parse_shard_key(k)[0]
            if name not in stored or stored[name].size != math.prod(p.shape):
                raise UserError(f"the EMA saved with {Path(ckpt).name} does not match the model's {name}",
                                "resume with the model config the checkpoint was written with")
            values.append(np.asarray(stored[name], np.float32).reshape(-1).copy())
        self.values = values


def _host(p: Any) -> np.ndarray:
    return p.asnumpy()  # CPU: a view of the live memory (read before the next step changes it)


def for_run(cfg: Any, model: Any, step_fn: Any, *, rank: int, world: int) -> WeightEMA | None:
    """The EMA a run keeps (None when train.ema_decay is 0, and on ranks that keep none)."""
    decay = cfg.train.ema_decay
    if not decay:
        return None
    if cfg.parallel.tp > 1:
        raise UserError(f"train.ema_decay is not supported with parallel.tp = {cfg.parallel.tp} yet",
                        "train without it (train.ema_decay=0) and average checkpoints afterwards with `mspretrain average`")
    if cfg.precision.param_dtype == "compute":
        raise UserError("train.ema_decay needs precision.param_dtype = fp32 (with \"compute\" the fp32 masters are in the "
                        "optimizer state, which the EMA does not read yet)",
                        "use precision.param_dtype=fp32, or average checkpoints afterwards with `mspretrain average`")
    params = list(model.get_parameters())
    plan = step_fn.plan  # the run's parallel plan (mspretrain/parallel/plan.py)
    if plan.zero3:
        from mspretrain.parallel.layout import slice_bounds
        from mspretrain.step.zero3 import gathered, wanted_ranges

        shapes = {name: tuple(g.shape) for name, g, _ in gathered(model)}
        keep, keys = [], []
        for p in params:  # step/zero3.py slice_state's cut and names: a sharded weight's slice, frozen ones on rank 0
            if p.name in shapes:
                a, b = slice_bounds(math.prod(shapes[p.name]), world, rank)
                keep.append(p)
                keys.append(shard_key(p.name, a, b))
            elif rank == 0:
                keep.append(p)
                keys.append(p.name)
        return WeightEMA(decay, keep, keys=keys, file_name=ema_shard_name(rank, world), shapes=shapes,
                         wanted=wanted_ranges(model, world, rank))
    if world > 1 and plan.sharded:
        return _zero12(decay, params, step_fn.zero_setup, step_fn.own_masters, rank=rank, world=world)
    if rank != 0:  # the weights are whole on every rank and no rank owns a part: rank 0's EMA is the run's
        return None
    return WeightEMA(decay, params, keys=[p.name for p in params], file_name=EMA_FILE, shapes=None, wanted={})


def _zero12(decay: float, params: list[Any], z: Any, masters: Any, *, rank: int, world: int) -> WeightEMA:
    """ZeRO-1/2: the EMA of exactly the units whose fp32 masters this rank owns (the step's own
    ownership, step/zero_setup.py `plan_zero`: whole parameters, which are their own masters, and
    this rank's slice of each split one, read from its 1-D master (`masters[k]`, step/state_codec.py),
    which the step's gather has just copied into every rank's weights: on Ascend the device-to-host
    read is the slice, not the whole parameter), and of the untrained parameters on rank 0, as
    ZeRO-3 keeps them."""
    o = z.ownership
    owned = {o.names[i]: k for k, i in enumerate(o.own)}  # at most one unit of a parameter per rank
    trained = set(o.names)
    keep, keys = [], []
    # every parameter is whole on every rank: a rank reads back only its units' ranges, (0, 0) of the rest
    wanted: dict[str, tuple[int, int] | None] = {}
    for p in params:
        k = owned.get(p.name)
        if k is not None and o.split[k]:
            keep.append(masters[k])
            keys.append(shard_key(p.name, *o.bounds[k]))
            wanted[p.name] = o.bounds[k]
        elif k is not None or (p.name not in trained and rank == 0):
            keep.append(p)
            keys.append(p.name)
            wanted[p.name] = None
        else:
            wanted[p.name] = (0, 0)
    split = {n for i, n in enumerate(o.names) if z.layout.is_split(i)}
    shapes = {p.name: tuple(p.shape) for p in params if p.name in split}  # every rank knows every split one
    return WeightEMA(decay, keep, keys=keys, file_name=ema_shard_name(rank, world), shapes=shapes, wanted=wanted)
