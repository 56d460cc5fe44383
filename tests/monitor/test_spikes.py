"""Spike detector: loss spikes over the rolling mean, grad-norm spikes, non-finite streaks, state."""
from __future__ import annotations

import json
import math

from mspretrain.config.schema import SpikeConfig
from mspretrain.monitor.spikes import SpikeDetector, scan_metrics

CFG = SpikeConfig(window=20, threshold=0.3, grad_norm_factor=5.0)


def feed(det: SpikeDetector, losses, start: int = 1, grad=None) -> dict[int, list[str]]:
    out = {}
    for i, loss in enumerate(losses):
        step = start + i
        ev = det.update(step, loss, None if grad is None else grad[i])
        if ev:
            out[step] = ev
    return out


def test_loss_spike_above_rolling_mean_by_threshold():
    det = SpikeDetector(CFG)
    assert feed(det, [2.0] * 20) == {}
    assert feed(det, [2.29], start=21) == {}  # 0.29 above the mean: below the bar
    ev = feed(det, [2.5], start=22)
    assert list(ev) == [22] and "loss spike" in ev[22][0]


def test_no_flag_before_enough_history_or_during_warmup():
    det = SpikeDetector(CFG)
    assert feed(det, [2.0, 2.0, 9.0]) == {}  # only two values in the window
    det = SpikeDetector(CFG)
    det.warmup_steps = 15
    assert feed(det, [2.0] * 12 + [3.0]) == {}  # step 13 <= warm-up
    assert list(feed(det, [2.0, 2.0, 3.5], start=14)) == [16]


def test_grad_norm_spike_over_rolling_median():
    det = SpikeDetector(CFG)
    grads = [1.0] * 12 + [4.9, 6.0]
    ev = feed(det, [2.0] * 14, grad=grads)
    assert list(ev) == [14] and "grad norm" in ev[14][0]


def test_nonfinite_losses_counted_in_a_row_and_reset():
    det = SpikeDetector(CFG)
    feed(det, [2.0] * 5)
    ev = feed(det, [float("nan"), float("inf"), float("nan")], start=6)
    assert sorted(ev) == [6, 7, 8] and det.nonfinite_streak == 3
    feed(det, [2.0], start=9)
    assert det.nonfinite_streak == 0


def test_state_round_trip_through_json_gives_identical_events():
    losses = [3.0 - 0.01 * i + (0.8 if i in (25, 33) else 0.0) for i in range(40)]
    losses[30] = math.nan
    grads = [1.0 + (9.0 if i == 27 else 0.0) for i in range(40)]
    a = SpikeDetector(CFG)
    whole = feed(a, losses, grad=grads)
    b = SpikeDetector(CFG)
    first = feed(b, losses[:20], grad=grads[:20])
    c = SpikeDetector(CFG)
    c.load_state(json.loads(json.dumps(b.state())))
    rest = feed(c, losses[20:], start=21, grad=grads[20:])
    assert {**first, **rest} == whole
    assert sorted(whole) == [26, 28, 31, 34]


def test_scan_metrics_on_records_with_gaps():
    records = [{"step": s, "loss": 2.0} for s in range(1, 31)]
    records[19] = {"step": 20, "lr": 1e-4}  # no loss at this step
    records[24] = {"step": 25, "loss": 3.0, "grad_norm": 1.0}
    records.append({"step": 31, "loss": float("nan")})
    found = scan_metrics(list(reversed(records)), CFG)
    assert [(f["step"], f["kind"]) for f in found] == [(25, "loss_spike"), (31, "nonfinite")]
    assert scan_metrics(records, CFG, warmup=26) == [found[1]]
