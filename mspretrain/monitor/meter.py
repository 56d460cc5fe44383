"""Per-step measurements of a training session: throughput, MFU and host share over a window of
steps, and memory, each at its own interval.

Design choices:
- The formulas are `monitor/mfu.throughput_metrics` (the one place for tokens/s, MFU, cost); this
  class only keeps the window: the tokens and the wall time since the last sample, and the part
  of that time spent inside the compiled step (`add_step_time`). As a train loop callback it
  times the step itself: from `pre_step` (the micro-batches are fetched) to `post_train_batch`
  (the step ran and the loop moved its counters), and adds its sample to the step's values there.
- The first step of a session includes graph compilation: it resets the window and reports
  nothing, so no figure mixes compile time with step time.
- host_share = 1 - (time inside the compiled step / wall time): the data, metrics and logging
  around the step, i.e. what the once-per-step read of loss/norm/finite can cost the device.
- `mfu` is always present in a throughput sample (0.0 when the device's peak is unknown) so
  metrics.jsonl keeps the same keys on every device.
"""
from __future__ import annotations

import time

from mspretrain.monitor.callback import Callback, Values
from mspretrain.monitor.memory import memory_metrics
from mspretrain.monitor.mfu import observed_peak, throughput_metrics


class StepMeter(Callback):
    def __init__(self, *, tokens_per_step: int, seq_len: int, devices: int, flops_per_token: float,
                 peak_tflops: float, price_per_device_hour: float, throughput_every: int, log_every: int,
                 memory_every: int, target: str) -> None:
        self.tokens_per_step, self.seq_len, self.devices = tokens_per_step, seq_len, devices
        self.flops_per_token, self.peak_tflops, self.price = flops_per_token, peak_tflops, price_per_device_hour
        self.throughput_every, self.log_every, self.memory_every = throughput_every, log_every, memory_every
        self.target = target
        self.start, self._t_run = 0, 0.0
        self.begin()

    # the loop's hooks (monitor/callback.py)
    def pre_train(self, start: int) -> None:
        self.start = start
        self.begin()

    def pre_step(self, step: int) -> None:
        self._t_run = time.perf_counter()

    def post_train_batch(self, step: int, values: Values) -> None:
        self.add_step_time(time.perf_counter() - self._t_run)
        values.update(self.sample(step, first=step == self.start + 1))

    def begin(self) -> None:
        """Open a window now (the start of a session)."""
        self._t, self._tokens, self._step_s = time.perf_counter(), 0, 0.0

    def add_step_time(self, seconds: float) -> None:
        """Wall time spent inside the compiled step."""
        self._step_s += seconds

    def sample(self, step: int, *, first: bool) -> dict[str, float]:
        """The values to log after `step` (one more step's tokens in the window)."""
        self._tokens += self.tokens_per_step
        out: dict[str, float] = {}
        if first:
            self.begin()
        elif step % self.throughput_every == 0 or step % self.log_every == 0:
            dt = max(time.perf_counter() - self._t, 1e-9)
            raised = observed_peak(self.peak_tflops, tokens=self._tokens, seconds=dt,
                                   flops_per_token=self.flops_per_token, devices=self.devices)
            if raised > self.peak_tflops:  # the measured peak was low: MFU stays <= 100 % (monitor/mfu.py)
                self.peak_tflops = raised
            out = throughput_metrics(tokens=self._tokens, samples=self._tokens // self.seq_len, seconds=dt,
                                     flops_per_token=self.flops_per_token, peak_tflops=self.peak_tflops,
                                     devices=self.devices, real_tokens=self._tokens,
                                     price_per_device_hour=self.price)
            out.setdefault("mfu", 0.0)
            if raised > 0:
                out["peak_tflops"] = self.peak_tflops
            out["host_share"] = max(0.0, 1.0 - self._step_s / dt)
            self.begin()
        if step % self.memory_every == 0:
            # host RSS as mem_mb; on Ascend also the NPU's peak allocated/reserved (monitor/memory.py)
            out.update(memory_metrics(self.target))
        return out
