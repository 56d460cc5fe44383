"""The optimizer update of a train step, as graph code: the gradients summed over the
data-parallel ranks bucket by bucket (`_reduce`), the norm, the overflow check, clipping and
AdamW on the owned parameters (`_finish`), and the owners' parameters back to every rank
(`_gather`). Split out of step/step.py, whose docstring has the design (ZeRO levels, the order
of the collectives, the branch-free skip); `TrainStep` builds the tables these read.
"""
from __future__ import annotations

from typing import Any

import mindspore as ms
from mindspore import Tensor, ops

_MUL_NO_NAN = ops.MulNoNan()


def _flat(parts: list[Tensor]) -> Tensor:
    return parts[0] if len(parts) == 1 else ops.concat(parts)


def _pieces(flat: Tensor, sizes: tuple[int, ...]) -> tuple[Tensor, ...]:
    return (flat,) if len(sizes) == 1 else ops.split(flat, list(sizes))


class StepUpdate:
    """The update's graph methods, mixed into `TrainStep` (step/step.py), which sets every table
    and collective they read in its __init__ (graph code reads plain lists off the step)."""

    params: tuple[Any, ...]
    world: int
    rank: int

    def _reduce(self, grads: list[Tensor], in_order: bool = False) -> tuple[list[Tensor], Tensor | None]:
        """Sum the (scaled) gradients over ranks, bucket by bucket. `grads` is indexed like the
        parameters, or (in_order) like `self._order`. Returns fp32 tensors in `self._order`: all
        of them, or with sharded gradients only this rank's own. Also returns the last collective's
        result. The collectives run in `self._schedule`'s order, the order in which the backward
        pass completes their buckets, so the first starts while the backward pass still runs. On
        CPU each bucket's flat copy is made after the previous collective's result (`self._chain`):
        all ranks then issue them in one order, and one bucket is alive at a time. The returned last
        result depends on every collective issued here (kept in every rank's graph, in one order)."""
        if in_order:  # replicated buffers already in bucket order: a permutation of all indices
            grads = [grads[self._order_pos[i]] for i in range(len(self.params))]
        if self._tp_partial is not None:  # tensor parallel: the QK-norm gradients summed over tp first
            grads = list(self._tp_partial(tuple(grads)))
        if self.world == 1:
            return [g.astype(ms.float32) for g in grads], None
        if self.zero3:  # reduce-scattered in the backward pass already (step/zero3.py, ShardedGather.bprop)
            out = [g.astype(ms.float32) for g in grads]
            return out, ops.depend(out[0], tuple(out))  # what follows (the loss AllReduce) waits for all of them
        out: list[Tensor] = []
        # tensor parallel on CPU: the first reduction after the whole backward pass, whose tp
        # all-reduces (model/parallel.py) every rank must issue before it, in one order
        # (expert parallel likewise: its dispatch and combine collectives run in the backward pass)
        prev: Tensor | None = ops.depend(grads[0], tuple(grads)) if self._chain and (self.tp is not None or self._ex is not None) else None
        issued: list[Tensor] = []  # every collective's result, used here or not
        for kind, k in self._schedule:
            if kind == 0:  # replicated gradients: AllReduce
                indices, sizes, wire = self._ar[k]
                flat = _flat([grads[i].reshape(-1).astype(wire) for i in indices])
                if self._chain and prev is not None:
                    flat = ops.depend(flat, prev)
                red = self.allreduce(flat)
                prev = red
                issued.append(red)
                for i, piece in zip(indices, _pieces(red, sizes)):
                    out.append(piece.reshape(self.params[i].shape).astype(ms.float32))
            elif kind == 1:  # sharded gradients: each rank ends with its own segment
                segments, sizes, length, used, wire, split = self._rs[k]
                if split:  # the segments are the slices: the flattened gradient is the bucket, padded at its end
                    parts = [grads[segments[0][0]].reshape(-1).astype(wire)]
                    if length * self.world > sum(used):
                        parts.append(ops.zeros((length * self.world - sum(used),), wire))
                else:
                    parts = []
                    for r in range(self.world):
                        parts += [grads[i].reshape(-1).astype(wire) for i in segments[r]]
                        if length > used[r]:
                            parts.append(ops.zeros((length - used[r],), wire))
                flat = _flat(parts)
                if self._chain and prev is not None:
                    flat = ops.depend(flat, prev)
                start = self.rank * length
                mine = self._reduce_scatters[k](flat) if self._reduce_scatters else self.allreduce(flat)[start:start + length]
                prev = mine
                issued.append(mine)
                if segments[self.rank]:
                    own = mine if used[self.rank] == length else mine[:used[self.rank]]
                    if split:  # this rank's slice, 1-D like its moments
                        out.append(own.astype(ms.float32))
                    else:
                        for i, piece in zip(segments[self.rank], _pieces(own, sizes[self.rank])):
                            out.append(piece.reshape(self.params[i].shape).astype(ms.float32))
            elif kind == 3:  # expert stacks (expert parallel): over the ranks holding the same experts
                indices, sizes, wire = self._ex
                if self.edp_sum is None:  # one rank holds them (ep = data-parallel ranks): nothing to sum, nothing
                    # sent, so no flat copy of every expert gradient (13.5 GB at EP8 for Qwen3-30B-A3B) and no wire cast
                    for i in indices:
                        out.append(grads[i].astype(ms.float32))
                else:
                    flat = _flat([grads[i].reshape(-1).astype(wire) for i in indices])
                    if self._chain and prev is not None:
                        flat = ops.depend(flat, prev)
                    flat = self.edp_sum(flat)
                    prev = flat
                    issued.append(flat)
                    for i, piece in zip(indices, _pieces(flat, sizes)):
                        out.append(piece.reshape(self.params[i].shape).astype(ms.float32))
            else:  # too lopsided to bucket: AllReduce, the owner keeps it
                g = grads[k].astype(self.wire[k])
                if self._chain and prev is not None:
                    g = ops.depend(g, prev)
                red = self.allreduce(g)
                prev = red
                issued.append(red)
                if self.owner[k] == self.rank:
                    out.append(red.astype(ms.float32))
        # every collective's result, in schedule order, behind the one returned: a rank keeps the
        # collectives it does not read (see `_chain` in __init__) and reaches them in one order
        return out, ops.depend(prev, tuple(issued))

    def _finish(self, grads: list[Tensor], loss_sum: Tensor, lr: Tensor, inv_scale: Tensor):
        """Norm, overflow check, update of the owned parameters, then every rank gets every owner's
        parameters. `grads`: reduced, still scaled, fp32, in `self._order`."""
        # sum of squares in the scaled domain, as a dot product: no squared copy of the gradient
        # (on MindSpore's CPU backend every full-size graph intermediate stays resident)
        if self._plain_sums:  # Ascend: a reduction, not a (1, n) x (n, 1) matmul on the matrix unit
            terms = [ops.square(grads[k]).sum() for k in self._norm_order]
        else:
            terms = [ops.matmul(grads[k].reshape(1, -1), grads[k].reshape(-1, 1)).reshape(()) for k in self._norm_order]
        if self._ex is None:
            sq = ops.stack([s if self._sq_weight[k] == 1.0 else s * self._sq_weight[k] for s, k in zip(terms, self._norm_order)]).sum()
        else:  # expert parallel: each expert once, its rank's sum of squares added over the ep group
            dense = [s for s, k in zip(terms, self._norm_order) if not self._expert_at[k]]
            mine = ops.stack([s for s, k in zip(terms, self._norm_order) if self._expert_at[k]]).sum()
            if self.ep_sum is not None:
                sq = ops.stack(dense).sum() + self.ep_sum(ops.depend(mine, loss_sum))
            elif self._expert_sq:  # sharded gradients: the world sum below adds the ep group's (step/step.py)
                sq = ops.stack(dense).sum() + mine
            else:  # an edp rank > 0: its experts' squares are edp rank 0's
                sq = ops.stack(dense).sum()
        if self.shard_grads and self.allreduce is not None:
            sq = self.allreduce(ops.depend(sq, loss_sum))  # the owners' partial sums: the same global norm on every rank
        if self.tp is not None:  # tensor parallel: the pieces' sums over the tp group
            sq = self.tp_sum(ops.depend(sq, loss_sum))
        finite = ops.isfinite(sq)
        norm = ops.sqrt(sq) * inv_scale
        # Branch-free skip: on overflow the kernel runs as an exact no-op (beta1 = beta2 = 1,
        # lr = decay = 0, gradient 0), instead of sitting under a graph `if finite:`. Inside such a
        # branch MindSpore 2.10 reads Parameters (the accumulation buffers) stale from the second
        # step on (measured: moments off by 2e-5 after two steps); and `where` keeps inf/NaN out.
        gscale = inv_scale
        if self.clip > 0:
            gscale = inv_scale * ops.minimum(ops.ones((), ms.float32), self.clip / (norm + 1e-6))
        step = self.opt_step + finite.astype(ms.int32)
        ops.assign(self.opt_step, step)
        t = ops.maximum(step, 1).astype(ms.float32)
        bc1 = 1.0 - ops.pow(self.beta1, t)
        root_bc2 = ops.sqrt(1.0 - ops.pow(self.beta2, t))
        zero, one = ops.zeros((), ms.float32), ops.ones((), ms.float32)
        # torch's AdamW in the bias-free kernel: lr·sqrt(bc2)/bc1, eps·sqrt(bc2), wd·bc1/sqrt(bc2)
        lr_t = ops.where(finite, lr * root_bc2 / bc1, zero)
        b1 = ops.where(finite, self.beta1 * one, one)
        b2 = ops.where(finite, self.beta2 * one, one)
        eps_t = self.eps * root_bc2
        wd_factor = ops.where(finite, bc1 / root_bc2, zero)
        # The gradient of a skipped step is 0 (an exact no-op update), without a `where` over the
        # full tensor: MindSpore 2.10's CPU Select with a 0-d operand keeps three index lists of the
        # output's size (24 B per element) for the graph's lifetime (select_cpu_kernel.cc,
        # GetBroadCastIndex; docs/benchmarks/memory.md run 3: -23.5 B/param). MulNoNan is x * y, and
        # 0 wherever y is 0 whatever x holds (mindspore/ops/operations/math_ops.py `MulNoNan`: Ascend,
        # GPU, CPU), so a scale of 0 zeroes the inf and NaN of an overflowed gradient too: the same
        # values as the former `nan_to_num(g * gscale)` (a finite step's scale is positive and its
        # gradients finite), one elementwise pass instead of two (CPU: 10.6 ms against 69.3 ms on
        # 11.2 M elements, the MoE benchmark's step 714 -> 674 ms, docs/benchmarks.md).
        gscale = ops.where(finite, gscale, zero)
        for k, i in enumerate(self.own):
            master = self.own_masters[k]
            g = grads[self._own_pos[k]]
            if self._own_cut[k] is not None:  # a whole (replicated) gradient of a split parameter: this rank's slice
                g = g.reshape(-1)[self._own_cut[k][0]:self._own_cut[k][1]]
            g = _MUL_NO_NAN(g, gscale)
            wd = self.wd[i] * wd_factor if self.wd[i] else 0.0
            if self._moments_rounded:
                self._adamw_rounded(master, self.exp_avg[k], self.exp_avg_sq[k], lr_t, b1, b2, eps_t, wd, g)
            else:
                self._adamw(master, self.exp_avg[k], self.exp_avg_sq[k], lr_t, b1, b2, eps_t, wd, g)
            if self._own_has_master[k] and (self.zero3 or not self._own_split[k]):  # a split one reaches its parameter in `_gather`
                ops.assign(self.params[i], master.astype(self.params[i].dtype))
        # the returned loss depends on the last collective: a collective whose result a rank does
        # not use would otherwise be pruned from that rank's graph only, and the ranks' sequences
        # of collectives would no longer pair up (measured: a hang-free mismatch error in mccl)
        loss_sum = ops.depend(loss_sum, self._gather(ops.depend(ops.depend(loss_sum, finite), sq)))
        return loss_sum, finite, norm

    def _adamw_rounded(self, master, m, v, lr, b1, b2, eps, wd, g) -> None:
        """AdamWeightDecay's arithmetic (the same bias-free arguments) with the moments stored in
        bf16 (optim.moment_dtype; DeepSeek-V3 technical report, arXiv 2412.19437, section 3.3:
        "we adopt the BF16 data format instead of FP32 to track the first and second moments in the
        AdamW optimizer, without incurring observable performance degradation"): read into fp32,
        updated in fp32, this step's update taken from the fp32 values, then rounded to bf16 (round
        to nearest even) for storage. On CPU the Parameters are fp32 holding bf16 values
        (step/state_codec.py says why), so the value goes through bf16 and back. A skipped step
        (b1 = b2 = 1, g = 0, lr = wd = 0) rewrites the same bf16 values and the same master."""
        m32 = b1 * m.astype(ms.float32) + (1.0 - b1) * g
        v32 = b2 * v.astype(ms.float32) + (1.0 - b2) * ops.square(g)
        ops.assign(master, master - lr * (m32 / (ops.sqrt(v32) + eps) + wd * master))
        ops.assign(m, m32.astype(ms.bfloat16).astype(self._moment_dtype))
        ops.assign(v, v32.astype(ms.bfloat16).astype(self._moment_dtype))

    def _gather(self, after: Tensor) -> Tensor:
        """Owners' parameters to every rank: bucketed AllGather, Broadcast for the rest."""
        prev = after
        for k, (segments, sizes, length, used, dtype, own_k) in enumerate(self._ag):
            split = own_k >= 0
            # `p * 1`, a computed tensor, not the Parameter: a Parameter handed straight to a
            # collective is read before the update's assign (measured on CPU), a computed one after.
            if split:  # this rank's updated slice, rounded to the parameter's dtype as a whole one is
                i = segments[0][0]
                parts = [(self.own_masters[own_k] * 1).astype(self._pdtype[i]).astype(dtype)]
            else:
                parts = [(self.params[i] * 1).reshape(-1).astype(dtype) for i in segments[self.rank]]
            if length > used[self.rank]:
                parts.append(ops.zeros((length - used[self.rank],), dtype))
            if self._allgathers:
                full = self._allgathers[k](ops.depend(_flat(parts), prev))
            else:
                before, after_ = self.rank * length, (self.world - 1 - self.rank) * length
                parts = ([ops.zeros((before,), dtype)] if before else []) + parts + ([ops.zeros((after_,), dtype)] if after_ else [])
                full = self.allreduce(ops.depend(_flat(parts), prev))
            prev = full
            if split:  # N segments of `length`: the flattened parameter, then the padding
                i = segments[0][0]
                n = self.sizes[i]
                value = full if n == length * self.world else full[:n]
                ops.assign(self.params[i], value.reshape(self.params[i].shape).astype(self.params[i].dtype))
            else:
                for r in range(self.world):
                    if r != self.rank and segments[r]:
                        start = r * length
                        for i, piece in zip(segments[r], _pieces(full[start:start + used[r]], sizes[r])):
                            ops.assign(self.params[i], piece.reshape(self.params[i].shape).astype(self.params[i].dtype))
        for i, bcast in zip(self._ag_single, self._bcast):
            out = bcast((ops.depend(self.params[i] * 1, prev),))[0]
            if self.owner[i] != self.rank:
                ops.assign(self.params[i], out)
            prev = out
        return prev
