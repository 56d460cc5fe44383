"""The numerics of one optimizer step, compiled: forward, loss, accumulation, loss scale, unscale,
all-reduce, clipping, AdamW. Nothing here knows about data files, logging or checkpoints.

Two compiled functions share fp32 accumulator buffers:
  `accumulate(tokens, positions, segments, scale)`  — one micro-batch: forward, summed token NLL
      (fp32 log-softmax) times `scale / global_tokens`, backward, grads added to the buffers.
  `apply(lr, inv_scale)`  — once per step: all-reduce (sum over ranks), unscale, overflow check,
      global-norm clipping, AdamW, zero the buffers; returns (global NLL sum, finite, grad norm).
The order is the field report's: scale → accumulate → unscale → clip → step. The scale is a
host value fixed for the whole window. Loss = sum of token NLL over the global batch ÷ target
tokens of the global batch, so batch size and accumulation do not change it.

An overflowed step changes no weight and no moment and does not advance the AdamW step counter:
the update sits under a graph `if finite:` (no Python `if` on a device tensor). The host reads
one scalar per step (the finite flag, with the loss) to update the loss scale and the lr
schedule; that is the only device→host sync of a step.

Optimizer-state sharding (ZeRO-1, `optim.shard_optimizer`): every parameter has one owner rank
(`assign_owners`, balanced by element count); a rank keeps Adam moments only for what it owns,
updates only those parameters, then every parameter is broadcast from its owner. Gradients are
still all-reduced in full, so the grad norm, the clipping factor and the overflow decision are
the same on every rank, and an owner computes exactly what an unsharded rank would: sharded and
unsharded runs are equal to the bit. We write it out (one `ops.Broadcast` per owner) instead of
using MindSpore's parallel optimizer, which is Ascend-only and would not apply to this AdamW.

Half-precision parameters (`precision.param_dtype = "compute"`, `half_params` here): the decoder's
matrices are stored in the compute dtype and an fp32 master copy of each lives with the optimizer
state, on its owner rank; AdamW updates the master and writes the rounded value into the
parameter. The forward pass reads exactly the rounded weights it would cast at use, so losses
equal those of fp32 parameters bit for bit (tests/test_memory_options.py).

AdamW is written out (PyTorch semantics: bias-corrected moments, eps outside the sqrt,
decoupled weight decay `p *= 1 - lr·wd`) instead of `nn.AdamWeightDecay`, which has no bias
correction, so that it can be checked against `torch.optim.AdamW` number for number.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops

from mspretrain.config import OptimConfig


def decay_mask(names: list[str], decay_embeddings: bool) -> list[bool]:
    """No weight decay on norms and biases; on embeddings only when asked."""
    out = []
    for n in names:
        if "norm" in n or n.endswith("bias"):
            out.append(False)
        elif "embed" in n:
            out.append(decay_embeddings)
        else:
            out.append(True)
    return out


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


@dataclass
class StepResult:
    loss: float  # mean token NLL over the global batch (z-loss excluded)
    grad_norm: float  # global norm of the unscaled gradients, before clipping
    finite: bool  # False: overflow, the update was skipped


class TrainStep:
    """Holds the optimizer state and the compiled accumulate/apply functions for one model."""

    def __init__(self, model: nn.Cell, optim: OptimConfig, *, global_tokens: int, world: int = 1,
                 rank: int = 0, jit: bool = True, allreduce_fp16: bool = False, shard: bool = False,
                 half_params: list[str] | None = None) -> None:
        """half_params: names of parameters to store in the model's compute dtype from now on;
        their fp32 values become master copies held with the optimizer state (by their owner)."""
        from mspretrain.model.loss import token_nll

        self.model = model
        self.params = tuple(model.trainable_params())
        self.names = [p.name for p in self.params]
        self.world = world
        self.global_tokens = float(global_tokens)
        self.beta1, self.beta2, self.eps = optim.beta1, optim.beta2, optim.eps
        self.clip = float(optim.grad_clip)
        self.z_loss = float(optim.z_loss)
        self.wd = [optim.weight_decay if d else 0.0 for d in decay_mask(self.names, optim.decay_embeddings)]
        self.rank = rank
        self.sharded = shard and world > 1
        sizes = [int(np.prod(p.shape)) for p in self.params]
        self.owner = assign_owners(sizes, world) if self.sharded else [rank] * len(self.params)
        self.own = [i for i, r in enumerate(self.owner) if r == rank]  # indices whose moments live here
        self.own_params = ms.ParameterTuple([self.params[i] for i in self.own])
        self.own_wd = [self.wd[i] for i in self.own]
        # Master weights: an fp32 copy for each owned parameter stored in half precision, taken
        # before the parameter is rounded; fp32 parameters are their own masters.
        half = set(half_params or ())
        self._own_has_master = [self.names[i] in half for i in self.own]
        self.own_masters = ms.ParameterTuple([
            Parameter(Tensor(self.params[i].asnumpy().copy()), name=f"master.{self.names[i]}", requires_grad=False)
            if self.names[i] in half else self.params[i] for i in self.own])
        for p in self.params:
            if p.name in half:
                p.set_dtype(model.dtype)
        self._own_mask = [r == rank for r in self.owner]
        zeros = lambda p, prefix: Parameter(ops.zeros(p.shape, ms.float32), name=f"{prefix}.{p.name}", requires_grad=False)
        self.accum = ms.ParameterTuple([zeros(p, "accum") for p in self.params])
        self.exp_avg = ms.ParameterTuple([zeros(self.params[i], "exp_avg") for i in self.own])
        self.exp_avg_sq = ms.ParameterTuple([zeros(self.params[i], "exp_avg_sq") for i in self.own])
        # one broadcast per parameter, from its owner (a multi-tensor Broadcast mixes up tensors of
        # different shapes on CPU: wrong-rank assigns in graph mode, memcpy overlap errors eagerly)
        self._bcast_ops = [ops.Broadcast(r) for r in self.owner] if self.sharded else []
        self._bcast_recv = [r != rank for r in self.owner]
        self.opt_step = Parameter(Tensor(0, ms.int32), name="opt_step", requires_grad=False)
        self.loss_accum = Parameter(Tensor(0.0, ms.float32), name="loss_accum", requires_grad=False)
        self.allreduce = ops.AllReduce(ops.ReduceOp.SUM) if world > 1 else None

        inv_tokens = 1.0 / self.global_tokens
        z = self.z_loss

        def objective(tokens: Tensor, positions: Tensor | None, segments: Tensor | None, scale: Tensor):
            inputs, targets = tokens[:, :-1], tokens[:, 1:]  # (B, T) each
            logits = model(inputs, positions, segments)  # (B, T, V) fp32
            nll, lse = token_nll(logits, targets)  # (B, T) fp32 each
            nll_sum = nll.sum()
            obj = nll_sum
            if z > 0:
                obj = obj + z * (lse * lse).sum()
            return obj * (scale * inv_tokens), nll_sum

        grad_fn = ms.value_and_grad(objective, None, self.params, has_aux=True)

        def accumulate(tokens, positions, segments, scale):
            (_, nll_sum), grads = grad_fn(tokens, positions, segments, scale)
            for acc, g in zip(self.accum, grads):
                ops.assign_add(acc, g.astype(ms.float32))
            ops.assign_add(self.loss_accum, nll_sum)
            return nll_sum

        # fp16 on the wire for every gradient but lm_head's (the field report's exemption)
        wire16 = [allreduce_fp16 and "lm_head" not in n for n in self.names]

        def apply(lr: Tensor, inv_scale: Tensor):
            grads = [acc * 1.0 for acc in self.accum]
            loss_sum = self.loss_accum * 1.0
            if self.allreduce is not None:
                # Reduce the *scaled* sums: fp16 keeps small gradients above its underflow, and a
                # sum that overflows becomes inf, which the finite check below turns into a skip.
                grads = [self.allreduce(g.astype(ms.float16)).astype(ms.float32) if w16 else self.allreduce(g)
                         for g, w16 in zip(grads, wire16)]
                loss_sum = self.allreduce(loss_sum)
            grads = [g * inv_scale for g in grads]
            finite = ms.amp.all_finite(grads)
            sq = ops.stack([(g * g).sum() for g in grads]).sum()
            norm = ops.sqrt(sq)
            if finite:
                coef = ops.ones((), ms.float32)
                if self.clip > 0:
                    coef = ops.minimum(coef, self.clip / (norm + 1e-6))
                step = self.opt_step + 1
                ops.assign(self.opt_step, step)
                t = step.astype(ms.float32)
                bc1 = 1.0 - ops.pow(self.beta1, t)
                bc2 = 1.0 - ops.pow(self.beta2, t)
                own_grads = []
                for g, own in zip(grads, self._own_mask):  # a constant mask: unrolled at compile time
                    if own:
                        own_grads.append(g)
                for p, master, has_master, g, m, v, wd in zip(self.own_params, self.own_masters, self._own_has_master,
                                                               own_grads, self.exp_avg, self.exp_avg_sq, self.own_wd):
                    g = g * coef
                    m_new = self.beta1 * m + (1.0 - self.beta1) * g
                    v_new = self.beta2 * v + (1.0 - self.beta2) * (g * g)
                    ops.assign(m, m_new)
                    ops.assign(v, v_new)
                    denom = ops.sqrt(v_new / bc2) + self.eps
                    p32 = master * 1.0  # the fp32 master (the parameter itself when it is fp32)
                    if wd:
                        p32 = p32 * (1.0 - lr * wd)
                    p_new = p32 - lr * (m_new / bc1) / denom
                    if has_master:
                        ops.assign(master, p_new)
                    ops.assign(p, p_new.astype(p.dtype))
            for bcast, p, receive in zip(self._bcast_ops, self.params, self._bcast_recv):
                # `p * 1.0`, not `p`: a Parameter handed straight to Broadcast is read before the
                # assign above (measured on CPU), a computed tensor after it. Chained through
                # `loss_sum` so every rank issues the broadcasts in the same order.
                out = bcast((ops.depend(p * 1.0, loss_sum),))[0]
                if receive:
                    ops.assign(p, out)
                loss_sum = ops.depend(loss_sum, out)
            for acc in self.accum:
                ops.assign(acc, ops.zeros_like(acc))
            ops.assign(self.loss_accum, ops.zeros_like(self.loss_accum))
            return loss_sum, finite, norm

        self._accumulate: Callable[..., Any] = ms.jit(accumulate) if jit else accumulate
        self._apply: Callable[..., Any] = ms.jit(apply) if jit else apply

    # ----------------------------------------------------------------- running
    def run(self, micro_batches: list[tuple[np.ndarray, np.ndarray | None, np.ndarray | None]],
            lr: float, scale: float) -> StepResult:
        """One optimizer step over this rank's micro-batches (tokens (B, T+1), positions, segments)."""
        scale_t = Tensor(scale, ms.float32)
        for tokens, positions, segments in micro_batches:
            self._accumulate(Tensor(tokens), None if positions is None else Tensor(positions),
                             None if segments is None else Tensor(segments), scale_t)
        loss_sum, finite, norm = self._apply(Tensor(lr, ms.float32), Tensor(1.0 / scale, ms.float32))
        return StepResult(loss=float(loss_sum.asnumpy()) / self.global_tokens,
                          grad_norm=float(norm.asnumpy()), finite=bool(finite.asnumpy()))

    # ----------------------------------------------------------------- state
    def state_keys(self, owned_only: bool = False) -> set[str]:
        """Tensor names of the optimizer state: all of it, or the part this rank holds."""
        idx = self.own if owned_only else range(len(self.names))
        keys = {"opt_step"} | {f"{k}.{self.names[i]}" for i in idx for k in ("exp_avg", "exp_avg_sq")}
        return keys | {f"master.{self.names[i]}" for i in idx if self.params[i].dtype != ms.float32}

    def optimizer_state(self) -> dict[str, np.ndarray]:
        """This rank's part of the state (all of it unless sharded); views of live memory on CPU."""
        out: dict[str, np.ndarray] = {"opt_step": np.asarray(self.opt_step.asnumpy(), dtype=np.int64)}
        for i, m, v, master, has_master in zip(self.own, self.exp_avg, self.exp_avg_sq, self.own_masters, self._own_has_master):
            out[f"exp_avg.{self.names[i]}"] = m.asnumpy()
            out[f"exp_avg_sq.{self.names[i]}"] = v.asnumpy()
            if has_master:
                out[f"master.{self.names[i]}"] = master.asnumpy()
        return out

    def load_optimizer_state(self, tensors: dict[str, np.ndarray], available: set[str] | None = None) -> None:
        """Load this rank's part from `tensors`. `available`: every key the checkpoint holds (all
        shards), checked against the whole model so a checkpoint of another model is refused
        even when the part this rank reads happens to match."""
        from mspretrain.errors import UserError

        have = set(tensors) if available is None else available
        full = self.state_keys()
        missing, unexpected = full - have, have - full
        if missing or unexpected:
            if all(k.startswith("master.") for k in missing | unexpected):
                raise UserError("precision.param_dtype differs from the run that wrote the checkpoint (fp32 master copies "
                                + ("missing)" if missing else "unexpected)"), "resume with the precision.param_dtype of the checkpoint's config.toml")
            raise UserError(f"optimizer state does not match the model (missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]})",
                            "resume with the model config the checkpoint was written with")
        self.opt_step.set_data(Tensor(int(np.asarray(tensors["opt_step"]).reshape(-1)[0]), ms.int32))
        for i, m, v, master, has_master in zip(self.own, self.exp_avg, self.exp_avg_sq, self.own_masters, self._own_has_master):
            m.set_data(Tensor(tensors[f"exp_avg.{self.names[i]}"].astype(np.float32)))
            v.set_data(Tensor(tensors[f"exp_avg_sq.{self.names[i]}"].astype(np.float32)))
            if has_master:
                master.set_data(Tensor(tensors[f"master.{self.names[i]}"].astype(np.float32)))
