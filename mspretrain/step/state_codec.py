"""A train step's optimizer state and its codec: the Adam moments, fp32 masters and step counter
this rank holds, written to and read from a checkpoint's tensors by name.

Split out of `step/step.py`, whose compiled functions update these Parameters in place. A split
parameter's state is stored per slice (`shard_key`); a rank reading it back (any world size:
another one cuts other slices, or none) assembles its own part from whichever stored slices
overlap it (`load`). The logical keys (the names without `@...`) are those of an unsplit run,
and the checks of a checkpoint against the model use them.

Moments in bf16 (`optim.moment_dtype = "bf16"`, step/update.py `_adamw_rounded`): held as bf16
Parameters on an NPU; on CPU as fp32 Parameters holding bf16 values, because MindSpore 2.10's CPU
Assign has no bf16 kernel (measured: "Select CPU operator[Assign] fail! Unsupported data type"),
while its CPU Cast fp32 -> bf16 rounds to nearest even exactly as ml_dtypes does (measured on 1e5
values across the exponent range): the same numbers, not the saved bytes. A checkpoint stores
moments as fp32 either way (a bf16 value is exact in fp32), so a bf16 run resumes bit-exactly, an
fp32 checkpoint resumed with bf16 moments is rounded to bf16 on load (what the option means), and
a bf16 checkpoint resumed with fp32 moments is read exactly.
"""
from __future__ import annotations

import mindspore as ms
import ml_dtypes
import numpy as np
from mindspore import Parameter, Tensor, ops

from mspretrain.checkpoint.model_shards import check_tiling
from mspretrain.errors import UserError
from mspretrain.parallel.shard_key import parse_shard_key as parse_key  # the stored keys' one reader
from mspretrain.step.zero_setup import Ownership


class OptimizerState:
    """The state Parameters of the owned units (`Ownership`) of the trained `params`."""

    def __init__(self, params: tuple[Parameter, ...], frozen: tuple[Parameter, ...], ownership: Ownership,
                 moment_dtype: str = "fp32", device: str = "cpu") -> None:
        self.params, self.frozen, self.o = params, frozen, ownership
        o = ownership
        # bf16 moments: their values are rounded to bf16 (`rounded`); stored in bf16 off the CPU
        self.rounded = moment_dtype == "bf16"
        self.moment_dtype = ms.bfloat16 if self.rounded and device != "cpu" else ms.float32
        # Every state Parameter below gets a temporary and positional arguments: MindSpore 2.10's
        # Parameter.__new__ wraps its input only at refcount 4 and otherwise rebuilds it from
        # `asnumpy()` (model/decoder.py `_normal` says why), which would bring each zeroed moment
        # and accumulator of an NPU back through host memory (tests/train/test_startup.py).
        # Master weights: an fp32 copy for each owned parameter stored in half precision, taken
        # here, before the step rounds the parameter; fp32 parameters are their own masters,
        # unless split (`Ownership.separate`).
        self.masters = ms.ParameterTuple([
            Parameter(Tensor(o.flat_value(params, k)), o.key(k, "master"), False) if sep else params[i]
            for k, (i, sep) in enumerate(zip(o.own, o.separate))])
        # a slice's state is 1-D, a whole parameter's has its shape
        shape = lambda k: (o.bounds[k][1] - o.bounds[k][0],) if o.split[k] else params[o.own[k]].shape  # noqa: E731
        zeros = lambda k, prefix: Parameter(ops.zeros(shape(k), self.moment_dtype), o.key(k, prefix), False)  # noqa: E731
        self.exp_avg = ms.ParameterTuple([zeros(k, "exp_avg") for k in range(len(o.own))])
        self.exp_avg_sq = ms.ParameterTuple([zeros(k, "exp_avg_sq") for k in range(len(o.own))])
        self.opt_step = Parameter(Tensor(0, ms.int32), name="opt_step", requires_grad=False)

    def kinds(self, i: int) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq", "master") if self.params[i].dtype != ms.float32 else ("exp_avg", "exp_avg_sq")

    def keys(self, owned_only: bool = False) -> set[str]:
        """Tensor names of the optimizer state: all of it (logical names), or the part this rank
        holds (as it writes them: a split parameter's slices by `shard_key`)."""
        o = self.o
        if owned_only:
            return {"opt_step"} | {o.key(k, kind) for k, i in enumerate(o.own) for kind in self.kinds(i)}
        return {"opt_step"} | {f"{kind}.{o.names[i]}" for i in range(len(o.names)) for kind in self.kinds(i)}

    def tensors(self) -> dict[str, np.ndarray]:
        """This rank's part of the state (all of it unless sharded); views of live memory on CPU."""
        o = self.o
        out: dict[str, np.ndarray] = {"opt_step": np.asarray(self.opt_step.asnumpy(), dtype=np.int64)}
        for k, (m, v, master, has_master) in enumerate(zip(self.exp_avg, self.exp_avg_sq, self.masters, o.has_master)):
            out[o.key(k, "exp_avg")] = _fp32(m)
            out[o.key(k, "exp_avg_sq")] = _fp32(v)
            if has_master:
                out[o.key(k, "master")] = master.asnumpy()
        return out

    def keys_to_read(self, available: set[str]) -> set[str]:
        """The stored keys this rank's part is assembled from: its own names, or any stored slice
        (or whole tensor) overlapping one of its units."""
        o = self.o
        want: dict[str, tuple[int, int]] = {"opt_step": (0, 1)}
        for k, i in enumerate(o.own):
            for kind in self.kinds(i):
                want[f"{kind}.{o.names[i]}"] = o.bounds[k]
        out = set()
        for key in available:
            name, rng = parse_key(key)
            if name in want and (rng is None or (rng[0] < want[name][1] and want[name][0] < rng[1])):
                out.add(key)
        return out

    def _assemble(self, tensors: dict[str, np.ndarray], name: str, k: int) -> np.ndarray:
        """Owned unit k's part of logical tensor `name`, from the stored whole tensor or the stored
        slices in `tensors`, shaped like this rank's state tensor (1-D for a slice)."""
        i, (a, b) = self.o.own[k], self.o.bounds[k]
        if name in tensors:  # written whole (by an unsplit run)
            flat = np.asarray(tensors[name], dtype=np.float32).reshape(-1)
            if flat.size < b:
                raise UserError(f"the checkpoint's {name} holds {flat.size:,} elements, fewer than the model's {b:,}",
                                "resume with the model config the checkpoint was written with")
            flat = flat[a:b]
        else:
            slices = [(key, rng) for key, rng in ((key, parse_key(key)) for key in tensors)
                      if rng[0] == name and rng[1] is not None]
            # the stored slices must cover this rank's part exactly once: a gap is a missing or
            # foreign shard, an overlap a slice that is not this checkpoint's (a sum of covered
            # lengths let one hide the other)
            check_tiling(name, [rng for _, (_, rng) in slices], a, b,
                         "resume from another checkpoint (`mspretrain checkpoints RUN` lists them)")
            flat = np.empty(b - a, np.float32)
            for key, (_, (ra, rb)) in slices:
                lo, hi = max(a, ra), min(b, rb)
                value = np.asarray(tensors[key]).reshape(-1)
                if value.size != rb - ra:
                    raise UserError(f"the checkpoint's {key[:120]} holds {value.size:,} elements, not the {rb - ra:,} its name says",
                                    "resume from another checkpoint (`mspretrain checkpoints RUN` lists them)")
                if lo < hi:
                    flat[lo - a:hi - a] = value[lo - ra:hi - ra].astype(np.float32, copy=False)
        return flat.copy() if self.o.split[k] else flat.reshape(self.params[i].shape).copy()

    def load(self, tensors: dict[str, np.ndarray], available: set[str] | None = None) -> None:
        """Load this rank's part from `tensors` (stored keys: whole tensors and/or slices).
        `available`: every key the checkpoint holds (all shards), checked against the whole model
        so a checkpoint of another model is refused even when the part this rank reads happens to match."""
        o = self.o
        have = {parse_key(k)[0] for k in (set(tensors) if available is None else available)}
        full = self.keys()
        missing, unexpected = full - have, have - full
        if missing or unexpected:
            if all(k.startswith("master.") for k in missing | unexpected):
                raise UserError("precision.param_dtype differs from the run that wrote the checkpoint (fp32 master copies "
                                + ("missing)" if missing else "unexpected)"), "resume with the precision.param_dtype of the checkpoint's config.toml")
            param_of = lambda keys: {k.split(".", 1)[1] for k in keys if "." in k}  # exp_avg.NAME -> NAME  # noqa: E731
            lacking, extra = param_of(missing), param_of(unexpected)
            if "opt_step" in have and lacking | extra and lacking | extra <= {p.name for p in self.params + self.frozen}:
                # the same model with other parameters trained (train.trainable changed)
                what = [f"no optimizer state for {len(lacking)} of the {len(o.names)} parameters trained now"] if lacking else []
                what += [f"optimizer state for {len(extra)} parameters frozen now"] if extra else []
                raise UserError(f"train.trainable differs from the run that wrote the checkpoint: it has {' and '.join(what)}",
                                "resume with the train.trainable of the checkpoint's config.toml, "
                                "or start a new run from its weights with --init-from")
            raise UserError(f"optimizer state does not match the model (missing {sorted(missing)[:3]}, "
                            f"unexpected {sorted(unexpected)[:3]})",
                            "resume with the model config the checkpoint was written with")
        self.opt_step.set_data(Tensor(int(np.asarray(tensors["opt_step"]).reshape(-1)[0]), ms.int32))
        for k, (i, m, v, master) in enumerate(zip(o.own, self.exp_avg, self.exp_avg_sq, self.masters)):
            m.set_data(self._moment(self._assemble(tensors, f"exp_avg.{o.names[i]}", k)))
            v.set_data(self._moment(self._assemble(tensors, f"exp_avg_sq.{o.names[i]}", k)))
            if o.has_master[k]:
                master.set_data(Tensor(self._assemble(tensors, f"master.{o.names[i]}", k)))
            elif o.separate[k]:  # an fp32 split parameter: its master is the slice of the weights just loaded
                master.set_data(Tensor(o.flat_value(self.params, k)))

    def _moment(self, value: np.ndarray) -> Tensor:
        """A stored (fp32) moment as this state holds it: rounded to bf16 with bf16 moments (exact
        for a bf16 run's own checkpoint; an fp32 run's is converted), in the storage dtype."""
        if not self.rounded:
            return Tensor(value)
        half = value.astype(ml_dtypes.bfloat16)  # round to nearest even, as MindSpore's Cast does
        return Tensor(half) if self.moment_dtype == ms.bfloat16 else Tensor(half.astype(np.float32))


def _fp32(p: Parameter) -> np.ndarray:
    """A moment as a checkpoint stores it: fp32 (a view of live memory on CPU; a bf16 one is copied)."""
    return p.asnumpy() if p.dtype == ms.float32 else p.asnumpy().astype(np.float32)
