"""The sections around the run: [eval], [device], [metrics], [spike], [cost], [profile]."""
from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Literal

from mspretrain.config.sections.base import Section, cap, fail
from mspretrain.errors import UserError

EVAL_MAX_BATCH = 4096  # sequences per evaluation forward pass: far above any device's memory for a real model


@dataclass(frozen=True)
class EvalConfig(Section):
    SECTION = "eval"

    every: int = 0  # steps between evaluations; 0 = only at the end (eval.at_end)
    # false: no evaluation at the last step, only every `every` steps (a separate `mspretrain eval`
    # of the checkpoints, or short runs whose perplexity nobody reads: compiling the eval graph
    # takes ~40 % of the train step's compile time, measured on the tiny config on CPU)
    at_end: bool = True
    max_tokens: int = 200_000
    batch_size: int = 8
    # Multiple-choice JSONL file (one question with its choices and answer per line) scored during
    # training; "" = none.
    choices_file: str = ""
    choices_dev_file: str = ""  # JSONL of solved examples the few-shot prompts are drawn from; "" = none
    choices_shots: int = 0  # solved examples from choices_dev_file put before each question (0 = zero-shot)
    # lm-evaluation-harness tasks scored at the same steps (comma-separated lm-eval task/group names,
    # e.g. "ceval-valid" with its data local; "" = none): mspretrain/eval/harness.py, the `eval` extra
    harness_tasks: str = ""
    harness_limit: int = 0  # at most this many examples per task at each evaluation (0 = all)
    harness_include_path: str = ""  # directory of your own task YAML files (lm-eval's --include_path)
    harness_num_fewshot: int = -1  # few-shot examples per question (-1 = the task's own default)

    def check(self) -> None:
        if self.every < 0 or self.max_tokens < 0 or self.batch_size <= 0:
            fail("eval.batch_size", "must be positive (and every/max_tokens not negative)", "use e.g. eval.batch_size=8")
        if self.harness_limit < 0 or self.harness_num_fewshot < -1:
            fail("eval.harness_limit", "must not be negative (harness_num_fewshot: -1 = the task's default, or >= 0)",
                 "use eval.harness_limit=0 for every example, or e.g. 100")
        if self.choices_shots < 0:
            fail("eval.choices_shots", f"= {self.choices_shots} must not be negative", "use 0 (zero-shot) or e.g. 5")
        # the batch's logits are allocated whole (eval.batch_size=1e8 asked numpy for 24.6 GiB of
        # tokens alone): the same ceiling as `mspretrain eval --batch-size`
        cap(self, {"batch_size": EVAL_MAX_BATCH, "choices_shots": 1000, "harness_num_fewshot": 1000}, "buffers no host holds")


@dataclass(frozen=True)
class DeviceConfig(Section):
    SECTION = "device"

    target: Literal["auto", "cpu", "ascend"] = "auto"  # "auto" | "cpu" | "ascend"
    threads: int = 0  # 0 = this host's cores shared by its ranks (all cores for one process)
    cpu_quota: float = 0.0  # percent of all cores for the training process (cgroup v2); 0 = off
    peak_tflops: float = 0.0  # per-device peak for MFU; 0 = from the built-in table / measured
    # mindspore.set_deterministic: reproducible kernels and (on Ascend) HCCL_DETERMINISTIC=true with
    # serial kernel compilation, which costs step and compile time there. On by default; on
    # Ascend it is the user's choice (false for speed once a run is known to be healthy).
    deterministic: bool = True
    # "O1" (Ascend only): graph-kernel fusion through ms.jit's jit_level; "O0" is what MindSpore
    # Transformers trains with on 910B. The old enable_graph_kernel flag is deprecated in 2.10.
    jit_level: Literal["O0", "O1"] = "O0"
    # Usable device memory in GB: 0 = the default (58 on Ascend 910B, the cap MindSpore
    # Transformers' 910B pretraining templates give max_device_memory; the machine's RAM on CPU).
    # `plan` compares its modelled peak with it, and on Ascend it is MindSpore's max_device_memory.
    max_device_memory: float = 0.0

    def check(self) -> None:
        if self.threads < 0:
            fail("device.threads", f"= {self.threads} must not be negative", "use 0 for all cores")
        if self.peak_tflops < 0:
            fail("device.peak_tflops", f"= {self.peak_tflops} must not be negative", "use 0 for the built-in table, or the device's peak TFLOPs")
        if self.max_device_memory < 0:
            fail("device.max_device_memory", f"= {self.max_device_memory} must not be negative",
                  "use 0 for the default (58 GB on Ascend 910B), or the usable GB per device")
        cap(self, {"threads": 1 << 16}, "more threads than any host has cores")
        cap(self, {"max_device_memory": 1e5, "peak_tflops": 1e6}, "no device has this much")
        if not 0 <= self.cpu_quota <= 100:
            fail("device.cpu_quota", f"= {self.cpu_quota} is outside [0, 100]", "give a percentage of all cores, e.g. 60 (0 = off)")


@dataclass(frozen=True)
class MetricsConfig(Section):
    """Each metric is sampled at its own interval (in steps), as the field report recommends."""

    SECTION = "metrics"

    loss_every: int = 1
    lr_every: int = 1
    loss_scale_every: int = 1
    grad_norm_every: int = 50
    memory_every: int = 200
    throughput_every: int = 10
    tensorboard: bool = True

    def check(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name.endswith("_every") and v <= 0:
                fail(f"metrics.{f.name}", f"= {v} must be positive", "give an interval in steps, e.g. 1, 50 or 200")


@dataclass(frozen=True)
class SpikeConfig(Section):
    SECTION = "spike"

    window: int = 50  # rolling window of the loss mean
    threshold: float = 0.3  # flag a loss this far above the rolling mean (the field report's bar)
    grad_norm_factor: float = 5.0  # flag a grad norm this many times the rolling median
    action: Literal["warn", "rewind"] = "warn"  # "warn" | "rewind"
    rewind_skip: int = 0  # batches to skip after a rewind; 0 = as many as the steps rewound
    max_nonfinite: int = 10  # stop after this many non-finite losses in a row

    def check(self) -> None:
        if not self.threshold > 0:
            fail("spike.threshold", f"= {self.threshold} must be positive", "the field report's bar is 0.3 (a loss 0.3 above the rolling mean)")
        if self.window < 2 or self.max_nonfinite < 1 or self.rewind_skip < 0:
            fail("spike.window", "needs window >= 2, threshold > 0, max_nonfinite >= 1, rewind_skip >= 0",
                  "the defaults are window 50, threshold 0.3, max_nonfinite 10")
        cap(self, {"window": 1 << 20}, "a rolling window longer than any run's history")
        if not self.grad_norm_factor > 0:
            fail("spike.grad_norm_factor", f"= {self.grad_norm_factor} must be positive", "the default is 5 (a grad norm 5x the rolling median)")


@dataclass(frozen=True)
class CostConfig(Section):
    SECTION = "cost"

    price_per_device_hour: float = 0.0  # in your currency; 0 = no cost figures

    def check(self) -> None:
        if self.price_per_device_hour < 0:
            fail("cost.price_per_device_hour", "must not be negative", "use 0 for no cost figures")
        cap(self, {"price_per_device_hour": 1e9}, "a cost that overflows to inf over a run")


@dataclass(frozen=True)
class ProfileConfig(Section):
    SECTION = "profile"

    steps: str = ""  # e.g. "10-20": run the MindSpore profiler for those steps

    def check(self) -> None:
        parse_step_range(self.steps)  # refused with the config, before a run dir is made


def parse_step_range(text: str) -> tuple[int, int] | None:
    """profile.steps: "10-20" -> (10, 20) (inclusive); "15" -> (15, 15); "" -> None."""
    text = (text or "").strip()
    if not text:
        return None
    m = re.fullmatch(r"([0-9]{1,12})\s*(?:-\s*([0-9]{1,12}))?", text)  # ASCII digits; steps fit train.max_steps' ceiling
    if not m:
        raise UserError(f"profile.steps = {text!r} is not a step range", 'write profile.steps="10-20" (inclusive) or "15"')
    first, last = int(m.group(1)), int(m.group(2) or m.group(1))
    if first < 1 or last < first:
        raise UserError(f"profile.steps = {text!r} is empty or starts before step 1", 'use e.g. profile.steps="10-20"')
    return first, last
