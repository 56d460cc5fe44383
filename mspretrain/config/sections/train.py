"""The sections of the optimizer step and the run: [optim], [parallel], [schedule], [train],
[precision], [checkpoint]."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Union

from mspretrain.config.sections.base import Section, cap, check_seed, fail, floor


@dataclass(frozen=True)
class OptimConfig(Section):
    SECTION = "optim"

    lr: float = 3e-4
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # global-norm clipping; 0 disables it
    decay_embeddings: bool = False
    lr_scaling: Literal["none", "sqrt"] = "none"  # "none" | "sqrt": lr * sqrt(global_batch / 32)
    z_loss: float = 0.0
    # The dtype the Adam moments are stored in: "fp32", or "bf16" (2 + 2 bytes a parameter instead
    # of 4 + 4; each step reads them into fp32, updates in fp32 and rounds them back, as DeepSeek-V3
    # does: arXiv 2412.19437, section 3.3). Checkpoints hold them as fp32 either way, so a run can
    # resume with the other setting (fp32 moments are rounded to bf16 on load). step/update.py.
    moment_dtype: Literal["fp32", "bf16"] = "fp32"
    # The LM head and the loss over this many tokens at a time, each chunk's fp32 logits recomputed
    # in the backward pass (model/loss.py `ChunkedNLL`): one chunk's logits alive instead of the
    # micro-batch's (2.5 GB at 4,096 tokens x Qwen's 151,936-token vocabulary), for one more head
    # matmul. 0: the whole micro-batch at once. Not with parallel.tp (its loss is vocabulary-parallel).
    loss_chunk_tokens: int = 0
    # ZeRO-1: each data-parallel rank keeps the Adam moments (and fp32 masters) of the parameters
    # it owns (about 1/N of them), updates those and all-gathers them; no effect with one rank.
    shard_optimizer: bool = False
    # ZeRO-2 (implies shard_optimizer): a rank also keeps the fp32 gradient-accumulation buffers
    # only for what it owns; every micro-batch's gradients are reduce-scattered into them. Saves
    # 4 bytes x (N-1)/N per parameter, costs one reduction per micro-batch instead of one per step.
    shard_gradients: bool = False
    # ZeRO-3 (implies shard_gradients): a rank also keeps only a slice (1/N) of every trained
    # weight; a layer's weights are gathered right before use and freed after, gradients are
    # reduce-scattered into the slices. Costs a gather per weight in the forward and a
    # reduce-scatter in the backward of every micro-batch (step/zero3.py).
    shard_parameters: bool = False
    # Cap of one collective's flat buffer in MB (a transient copy): gradients and parameters cross
    # ranks in a few buckets instead of one collective per parameter. 0 = one per parameter.
    # "auto": 256 on Ascend, 32 on CPU (parallel/layout.py `bucket_mb_for` says why).
    bucket_mb: Union[float, str] = "auto"
    # With sharding: a parameter of at least this many MB (4 bytes an element) is cut into one
    # slice per rank instead of going whole to one owner, so each rank holds 1/N of its Adam
    # moments, master and gradient buffer (a 151 K-row lm_head). 0 = never. "auto": the bucket
    # cap (such a parameter has a collective of its own anyway; none with bucket_mb = 0;
    # parallel/layout.py says more).
    split_mb: Union[float, str] = "auto"

    def check(self) -> None:
        if not (self.lr >= 0 and math.isfinite(self.lr)):
            fail("optim.lr", f"= {self.lr} must be a non-negative number", "the usual range is 1e-4 to 1e-3")
        if self.weight_decay < 0:
            fail("optim.weight_decay", f"= {self.weight_decay} must not be negative", "the Llama value is 0.1")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                fail(f"optim.{name}", f"= {getattr(self, name)} is outside [0, 1)", "Llama uses beta1 0.9, beta2 0.95")
        if not self.eps > 0:
            fail("optim.eps", f"= {self.eps} must be positive", "the Llama value is 1e-8")
        if self.grad_clip < 0:
            fail("optim.grad_clip", f"= {self.grad_clip} must not be negative", "use 1.0, or 0 to disable clipping")
        if self.z_loss < 0:
            fail("optim.z_loss", f"= {self.z_loss} must not be negative", "use 0 (off) or e.g. 1e-4")
        if isinstance(self.bucket_mb, str):
            if self.bucket_mb != "auto":
                fail("optim.bucket_mb", f"= {self.bucket_mb!r} is neither a number nor \"auto\"",
                      'write optim.bucket_mb=64 (MB), 0 for one collective per parameter, or optim.bucket_mb="auto"')
        elif not (self.bucket_mb >= 0 and math.isfinite(self.bucket_mb)):
            fail("optim.bucket_mb", f"= {self.bucket_mb} must be a non-negative number", "use e.g. 256, or 0 for one collective per parameter")
        else:
            cap(self, {"bucket_mb": 1 << 20}, "a bucket larger than any device")
        if isinstance(self.split_mb, str):
            if self.split_mb != "auto":
                fail("optim.split_mb", f"= {self.split_mb!r} is neither a number nor \"auto\"",
                      'write optim.split_mb=256 (MB), 0 to keep every parameter whole, or optim.split_mb="auto"')
        elif not (self.split_mb >= 0 and math.isfinite(self.split_mb)):
            fail("optim.split_mb", f"= {self.split_mb} must be a non-negative number", "use e.g. 256, or 0 to keep every parameter whole")
        if self.loss_chunk_tokens < 0:
            fail("optim.loss_chunk_tokens", f"= {self.loss_chunk_tokens} must not be negative",
                 "use e.g. 512 (tokens per chunk), or 0 for the whole micro-batch at once")
        cap(self, {"lr": 10.0, "weight_decay": 10.0, "eps": 1.0, "grad_clip": 1e6, "z_loss": 1.0},
             "an update this size makes the weights inf in a step")
        floor(self, {"eps": 1e-30}, "float32 rounds it to 0: Adam then divides by 0 for a parameter with no gradient")


@dataclass(frozen=True)
class ParallelConfig(Section):
    SECTION = "parallel"

    # Tensor parallel (Megatron-style, model/parallel.py): this many ranks split every layer's
    # matrices, the embedding and the lm_head among them. The world (msrun's worker count) is
    # tp x data-parallel ranks, tp ranks adjacent (ranks 0..tp-1 are the first tp group). 1 = off.
    tp: int = 1
    # Expert parallel (a mixture of experts, model.num_experts > 0; model/moe.py): this many adjacent
    # data-parallel ranks split every MoE layer's experts among them (each holds num_experts / ep),
    # the tokens dispatched to the experts' ranks and combined back; the ranks holding the same
    # experts reduce their gradients. Must divide num_experts and the data-parallel ranks
    # (world / tp); with ZeRO-1/2 but not yet ZeRO-3 or parallel.tp > 1. 1 = off.
    ep: int = 1

    def check(self) -> None:
        if self.tp < 1:
            fail("parallel.tp", f"= {self.tp} must be at least 1", "use 1 (off) or the ranks that split each layer, e.g. 2, 4 or 8")
        if self.ep < 1:
            fail("parallel.ep", f"= {self.ep} must be at least 1", "use 1 (off) or the ranks that split the experts, e.g. 2, 4 or 8")
        cap(self, {"tp": 1024, "ep": 1024}, "more ranks than any model has heads or experts")


@dataclass(frozen=True)
class ScheduleConfig(Section):
    SECTION = "schedule"

    kind: Literal["cosine", "two_phase", "wsd", "constant"] = "cosine"  # "cosine" | "two_phase" | "wsd" | "constant"
    warmup_steps: Union[int, str] = "auto"  # int or "auto" (field report formula on data tokens)
    min_lr_ratio: float = 0.1
    decay_fraction: float = 0.2  # WSD: last share of steps spent decaying
    peak_ratio: float = 1.2  # two_phase: second phase rises to peak_ratio * lr

    def check(self) -> None:
        if isinstance(self.warmup_steps, str):
            if self.warmup_steps != "auto":
                fail("schedule.warmup_steps", f"= {self.warmup_steps!r} is neither an integer nor \"auto\"",
                      'write schedule.warmup_steps=100 or schedule.warmup_steps="auto"')
        elif self.warmup_steps < 0:
            fail("schedule.warmup_steps", f"= {self.warmup_steps} must not be negative", "use 0 for no warm-up")
        if not 0 <= self.min_lr_ratio <= 1:
            fail("schedule.min_lr_ratio", f"= {self.min_lr_ratio} is outside [0, 1]", "use e.g. 0.1")
        if not 0 < self.decay_fraction <= 1:
            fail("schedule.decay_fraction", f"= {self.decay_fraction} is outside (0, 1]", "use e.g. 0.2")
        if self.peak_ratio < 1:
            fail("schedule.peak_ratio", f"= {self.peak_ratio} must be at least 1", "the field report uses 1.2")
        cap(self, {"peak_ratio": 100.0}, "an lr peak this far above optim.lr diverges")


# The parameter groups `train.trainable` can name (issue 20's stage-1 training: embeddings, lm_head).
ParamGroup = Literal["all", "embeddings", "attention", "mlp", "norms", "lm_head"]


@dataclass(frozen=True)
class TrainConfig(Section):
    SECTION = "train"

    max_steps: int = 0  # 0 = not set; at least one of max_steps / max_tokens is needed
    max_tokens: int = 0
    global_batch: int = 8  # sequences per optimizer step, over all ranks and micro-batches
    micro_batch: int = 0  # 0 = global_batch / world size (no accumulation)
    seed: int = 1234
    log_every: int = 10
    mode: Literal["jit", "pynative"] = "jit"  # "jit" | "pynative"
    # Recompute each decoder layer's activations in the backward pass instead of keeping them:
    # activation memory drops to one layer's worth plus each layer's input, for ~1/3 more compute.
    recompute: bool = False
    # Parameter groups the optimizer updates; the rest stay frozen. "all" (alone) = every
    # parameter; else any of "embeddings", "attention", "mlp", "norms", "lm_head", e.g.
    # ["embeddings", "lm_head"] for the first stage of continued pretraining on a new vocabulary.
    trainable: tuple[ParamGroup, ...] = ("all",)
    # Keep an exponential moving average of the fp32 weights, updated after every applied step
    # (e_1 = w_1, e_t = d e_{t-1} + (1 - d) w_t) and saved beside each checkpoint (ema.safetensors;
    # under ZeRO-1/2/3 ema-R-of-N per rank, each rank the part whose masters it owns);
    # `mspretrain average RUN --last 1 --from-ema` makes it a checkpoint.
    # 0 = off; e.g. 0.999 (train/ema.py).
    ema_decay: float = 0.0

    def check(self) -> None:
        if self.max_steps < 0 or self.max_tokens < 0:
            fail("train.max_steps", "and train.max_tokens must not be negative", "give a positive step or token budget")
        if self.global_batch <= 0:
            fail("train.global_batch", f"= {self.global_batch} must be positive", "set train.global_batch to e.g. 8")
        if self.micro_batch < 0:
            fail("train.micro_batch", f"= {self.micro_batch} must not be negative", "use 0 for global_batch / world size")
        if self.micro_batch and self.global_batch % self.micro_batch:
            fail("train.global_batch", f"= {self.global_batch} is not divisible by train.micro_batch = {self.micro_batch}",
                  "make global_batch a multiple of micro_batch")
        if self.log_every <= 0:
            fail("train.log_every", f"= {self.log_every} must be positive", "use e.g. 10")
        cap(self, {"global_batch": 1 << 24, "micro_batch": 1 << 20}, "batch buffers no host holds")
        cap(self, {"max_steps": 10**12, "max_tokens": 10**16}, "a budget no run reaches: 1e16 tokens is 100x any released model's")
        check_seed(self, "seed")
        if not 0 <= self.ema_decay < 1:
            fail("train.ema_decay", f"= {self.ema_decay} is outside [0, 1)", "use 0 (off) or a decay such as 0.999")
        groups = list(self.trainable)
        if not groups:
            fail("train.trainable", "is empty: nothing would train", 'use train.trainable=["all"], or name parameter groups')
        if len(set(groups)) != len(groups):
            fail("train.trainable", f"= {groups} names a group twice", "name each parameter group once")
        if "all" in groups and len(groups) > 1:
            fail("train.trainable", f"= {groups} mixes \"all\" with other groups",
                  'use train.trainable=["all"] alone, or list only the groups to train')


@dataclass(frozen=True)
class PrecisionConfig(Section):
    SECTION = "precision"

    dtype: Literal["fp32", "fp16", "bf16"] = "fp32"  # "fp32" | "fp16" | "bf16"
    # "auto" (dynamic for fp16, none otherwise) | "dynamic" | "static" | "none"
    loss_scale: Literal["auto", "dynamic", "static", "none"] = "auto"
    init_scale: float = 64.0  # the field report's starting scale
    scale_warmup_to: float = 0.0  # 0 = no linear warm-up of the scale
    scale_warmup_steps: int = 0
    growth_interval: int = 1000
    min_scale: float = 1.0
    max_scale: float = 2.0**24
    # Data-parallel gradient all-reduce in fp16 halves the bytes on the wire (the field report's
    # Ascend setting); lm_head's gradient always stays fp32. Loss-scaled, so overflow is caught.
    allreduce_dtype: Literal["fp32", "fp16"] = "fp32"  # "fp32" | "fp16"
    # "fp32": parameters are the fp32 master weights, cast to `dtype` at use. "compute": the
    # decoder layers' matrices are stored in `dtype`, and fp32 master copies
    # live with the optimizer state (sharded with it under optim.shard_optimizer): 2 instead of
    # 4 bytes per parameter on every device. Same numbers either way: the matmuls read the same
    # rounded weights.
    param_dtype: Literal["fp32", "compute"] = "fp32"  # "fp32" | "compute"

    def check(self) -> None:
        if self.scale_warmup_to < 0:
            fail("precision.scale_warmup_to", f"= {self.scale_warmup_to} must not be negative", "use 0 (no warm-up of the scale) or e.g. 1024")
        if not self.init_scale > 0:
            fail("precision.init_scale", f"= {self.init_scale} must be positive", "the field report uses 64")
        if not 0 < self.min_scale <= self.max_scale:
            fail("precision.min_scale", f"= {self.min_scale} must be positive and at most max_scale", "use e.g. min_scale 1, max_scale 16777216")
        # The loss scale is a float32 on the device: above ~3.4e38 it is inf, and every step overflows.
        cap(self, {"init_scale": 2.0**64, "max_scale": 2.0**64, "scale_warmup_to": 2.0**64}, "a loss scale that overflows float32 gradients")
        if self.growth_interval <= 0:
            fail("precision.growth_interval", f"= {self.growth_interval} must be positive", "use e.g. 1000")
        if self.scale_warmup_to and self.scale_warmup_steps <= 0:
            fail("precision.scale_warmup_steps", "must be positive when scale_warmup_to is set", "the field report warms 64 -> 1024 over 500 steps")
        scaled = self.loss_scale in ("dynamic", "static") or (self.loss_scale == "auto" and self.dtype == "fp16")
        if self.allreduce_dtype == "fp16" and not scaled:
            # Unscaled per-rank gradients of a large model's mean loss (~1e-6) sit below fp16's normal
            # range (6.1e-5): on the wire they flush to zero or keep a few bits.
            fail("precision.allreduce_dtype", f"= fp16 needs loss scaling, which is off here (dtype {self.dtype}, loss_scale {self.loss_scale})",
                  "use precision.allreduce_dtype=fp32, or turn loss scaling on (precision.loss_scale=dynamic)")
        if self.param_dtype == "compute" and self.dtype == "fp32":
            fail("precision.param_dtype", "= compute only applies to fp16/bf16 compute (with dtype fp32 the parameters are fp32 already)",
                  "set precision.dtype=fp16 (or bf16 on Ascend), or leave precision.param_dtype=fp32")


@dataclass(frozen=True)
class CheckpointConfig(Section):
    SECTION = "checkpoint"

    every: int = 100
    keep_last: int = 3
    keep_every: int = 0  # also keep every keep_every-th step forever; 0 = off
    async_save: bool = True
    on_error: Literal["stop", "continue"] = "stop"  # "stop" | "continue"

    def check(self) -> None:
        if self.every < 0 or self.keep_last < 1 or self.keep_every < 0:
            fail("checkpoint.keep_last", "must be at least 1 (and every/keep_every not negative)",
                  "use e.g. checkpoint.every=100 checkpoint.keep_last=3")
