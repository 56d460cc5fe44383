"""The report's figures: one matplotlib Figure per panel of a run's summary (`report_summary.summarize`),
or None when the run has no data for it. matplotlib's object API (`Figure` + Agg canvas), never
pyplot: no global state, no display; matplotlib is imported on the first figure only.
"""
from __future__ import annotations

import math
import statistics
from typing import Any

from mspretrain.forensics.report_summary import is_number, series

PANELS = (  # (file stem, title)
    ("loss", "Training loss (spikes marked)"), ("eval_ppl", "Eval perplexity"),
    ("eval_acc", "Multiple-choice accuracy (eval.choices_file)"),
    ("harness", "lm-eval task scores against tokens (eval.harness_tasks)"), ("lr", "Learning rate"),
    ("grad_norm", "Gradient norm"), ("loss_scale", "Loss scale and skipped steps"),
    ("throughput", "Throughput (right axis: MFU)"), ("memory", "Peak memory (host RSS; device on Ascend)"),
    ("moe", "Expert load: busiest expert / mean per MoE layer (right axis: balance loss)"))
OPTIONAL_PANELS = frozenset({"eval_acc", "harness", "moe"})  # left out, not shown empty, when the run has no data for them


def _figure(title: str):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.2, 3.2), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    ax.set_title(title, fontsize=11)
    ax.set_xlabel("step")
    ax.grid(True, alpha=0.3)
    return fig, ax


def plot_panel(stem: str, title: str, s: dict) -> Any | None:
    """One panel as a matplotlib Figure, or None when the run has no data for it."""
    recs = s["records"]
    if stem == "loss":
        xs, ys = series(recs, "loss")
        fin = [(x, y) for x, y in zip(xs, ys) if math.isfinite(y)]
        if not xs:
            return None
        fig, ax = _figure(title)
        if fin:
            ax.plot([x for x, _ in fin], [y for _, y in fin], lw=1, color="tab:blue", label="loss")
        spikes = [e for e in s["events"] if e["kind"] == "loss_spike"]
        if spikes:
            ax.scatter([e["step"] for e in spikes], [e["value"] for e in spikes], color="red", marker="x",
                       s=40, zorder=3, label=f"spike (> rolling mean + {s['config'].spike.threshold if s['config'] else 0.3})")
        for i, e in enumerate(e for e in s["events"] if e["kind"] == "nonfinite"):
            ax.axvline(e["step"], color="orange", lw=0.8, alpha=0.6, label="non-finite loss" if i == 0 else None)
        ax.set_ylabel("loss")
        ax.legend(fontsize=8)
        return fig
    if stem == "loss_scale":
        xs, ys = series(recs, "loss_scale")
        kx, ky = series(recs, "skipped")
        if not xs and not kx:
            return None
        if set(ys) <= {1.0} and not any(ky):
            # fp32 (or loss_scale = "none"): say so; autoscaled, the flat line sat on a +-0.04 axis
            fig, ax = _figure(title)
            ax.plot(xs, ys, lw=1.2, color="tab:purple")
            ax.set_ylim(0, 2)
            ax.set_yticks([1])
            ax.set_ylabel("loss scale")
            dtype = s["config"].precision.dtype if s["config"] else "fp32"
            ax.text(0.5, 0.72, f"no loss scaling ({dtype}): scale 1 at every step,\nno step skipped",
                    transform=ax.transAxes, ha="center", va="center", fontsize=12)
            return fig
        fig, ax = _figure(title)
        lines = []
        if xs:
            lines += ax.plot(xs, ys, lw=1.2, color="tab:purple", label="loss scale")
            if min(ys) > 0:
                ax.set_yscale("log", base=2)
            ax.set_ylabel("loss scale")
        if kx:
            ax2 = ax.twinx()
            lines += ax2.step(kx, ky, where="post", color="tab:red", lw=1, ls="--", label="skipped steps (total)")
            ax2.set_ylabel("skipped steps")
        ax.legend(lines, [ln.get_label() for ln in lines], fontsize=8)
        return fig
    if stem == "throughput":
        xs, ys = series(recs, "tokens_per_s")
        mx, my = series(recs, "mfu")
        if not xs and not mx:
            return None
        fig, ax = _figure(title)
        ratios = [100 * m / t for t, m in zip(ys, my) if t] if xs and mx and xs == mx else []
        if ratios and max(ratios) - min(ratios) <= 1e-9 * max(abs(r) for r in ratios):
            # MFU is tokens/s times a constant (FLOPs per token / peak): one curve, read on either axis
            r = ratios[0]
            ax.plot(xs, ys, lw=1.2, color="tab:green", marker="o" if len(xs) < 30 else None, ms=3)
            ax.set_ylabel("tokens/s")
            if r > 0:
                sec = ax.secondary_yaxis("right", functions=(lambda t: t * r, lambda m: m / r))
                sec.set_ylabel("MFU %")
            return fig
        lines = []
        if xs:
            lines += ax.plot(xs, ys, lw=1.2, color="tab:green", label="tokens/s")
            ax.set_ylabel("tokens/s")
        if mx:
            ax2 = ax.twinx()
            lines += ax2.plot(mx, [100 * v for v in my], lw=1, color="tab:orange", ls="--", label="MFU %")
            ax2.set_ylabel("MFU %")
        ax.legend(lines, [ln.get_label() for ln in lines], fontsize=8)
        return fig
    if stem == "eval_acc":
        named = [(k, label) for k, label in (("eval/acc", "accuracy (summed log-likelihood)"),
                                              ("eval/acc_norm", "accuracy (length-normalised)")) if series(recs, k)[0]]
        if not named:
            return None
        fig, ax = _figure(title)
        for k, label in named:
            xs, ys = series(recs, k)
            ax.plot(xs, [100 * y for y in ys], lw=1, marker="o" if len(xs) < 30 else None, ms=3, label=label)
        ax.set_xlim(0, max(s["last_step"], 1) * 1.04)
        ax.set_ylim(0, 100)
        ax.set_ylabel("accuracy %")
        ax.legend(fontsize=8)
        return fig
    if stem == "harness":
        return _harness_plot(title, recs)
    if stem == "moe":
        return _moe_plot(title, recs)
    if stem == "memory":
        # host RSS and (Ascend) device memory are separate metrics: one line each, never summed
        named = [(k, label) for k, label in (("mem_mb", "host RSS (peak)"), ("device_mem_mb", "device allocated (peak)"),
                                              ("device_mem_reserved_mb", "device reserved (peak)")) if series(recs, k)[0]]
        if not named:
            return None
        fig, ax = _figure(title)
        for k, label in named:
            xs, ys = series(recs, k)
            ax.plot(xs, ys, lw=1, marker="o" if len(xs) < 30 else None, ms=3, label=label)
        ax.set_ylabel("MB")
        ax.legend(fontsize=8)
        return fig
    key, ylabel, logy = {"eval_ppl": ("eval/ppl", "perplexity", True), "lr": ("lr", "lr", False),
                         "grad_norm": ("grad_norm", "grad norm", True), "memory": ("mem_mb", "MB", False)}[stem]
    xs, ys = series(recs, key)
    pts = [(x, y) for x, y in zip(xs, ys) if math.isfinite(y)]
    if not pts:
        return None
    fig, ax = _figure(title)
    ax.plot([x for x, _ in pts], [y for _, y in pts], lw=1, marker="o" if len(pts) < 30 else None, ms=3)
    if stem == "eval_ppl":  # on the run's step axis, with the value written out: often one or two points
        ax.set_xlim(0, max(s["last_step"], pts[-1][0]) * 1.04)
        x, y = pts[-1]
        ax.annotate(f"{y:,.1f}", (x, y), textcoords="offset points", xytext=(-6, 6), ha="right", fontsize=9)
    if logy and min(y for _, y in pts) > 0 and max(y for _, y in pts) / min(y for _, y in pts) > 20:
        ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    if stem == "grad_norm":
        for e in (e for e in s["events"] if e["kind"] == "grad_norm"):
            ax.scatter([e["step"]], [e["value"]], color="red", marker="x", s=40, zorder=3)
    return fig


HARNESS_METRICS = ("acc", "acc_norm", "exact_match")  # scores on a 0-1 scale: one axis in %


def expert_load_curves(recs: list[dict]) -> dict[int, tuple[list[int], list[float]]]:
    """{MoE layer: (steps, busiest expert's assignments / mean)} from `moe/layer_L/max_over_mean`
    (model/moe.py `load_metrics`)."""
    curves: dict[int, tuple[list[int], list[float]]] = {}
    for r in recs:
        for k, v in r.items():
            if k.startswith("moe/layer_") and k.endswith("/max_over_mean") and is_number(v) and math.isfinite(v):
                layer = k[len("moe/layer_"):-len("/max_over_mean")]
                if layer.isdigit():
                    xs, ys = curves.setdefault(int(layer), ([], []))
                    xs.append(r["step"])
                    ys.append(float(v))
    return curves


def _moe_plot(title: str, recs: list[dict]) -> Any | None:
    curves = expert_load_curves(recs)
    if not curves:
        return None
    fig, ax = _figure(title)
    if len(curves) <= 8:
        for layer, (xs, ys) in sorted(curves.items()):
            ax.plot(xs, ys, lw=1, label=f"layer {layer}")
    else:  # many layers: the worst and the median layer at each step
        by_step: dict[int, list[float]] = {}
        for xs, ys in curves.values():
            for x, y in zip(xs, ys):
                by_step.setdefault(x, []).append(y)
        steps = sorted(by_step)
        ax.plot(steps, [max(by_step[x]) for x in steps], lw=1, label=f"worst of {len(curves)} layers")
        ax.plot(steps, [statistics.median(by_step[x]) for x in steps], lw=1, label="median layer")
    ax.axhline(1.0, color="gray", lw=0.8, ls="--", label="balanced")
    ax.set_ylabel("max / mean")
    bx, by = series(recs, "moe/balance_loss")
    if bx:
        ax2 = ax.twinx()
        ax2.plot(bx, by, lw=1, color="tab:red", alpha=0.6)
        ax2.set_ylabel("balance loss", color="tab:red")
    ax.legend(fontsize=8)
    return fig


def harness_curves(recs: list[dict]) -> dict[str, tuple[list[float], list[float]]]:
    """{"TASK/METRIC": (tokens seen, score)} of the lm-eval scores in the metrics (`harness/TASK/METRIC`
    keys at the evaluation steps), the x axis the `tokens` logged in the same record."""
    curves: dict[str, tuple[list[float], list[float]]] = {}
    for r in recs:
        for k, v in r.items():
            if k.startswith("harness/") and k.rsplit("/", 1)[-1] in HARNESS_METRICS and is_number(v) \
                    and math.isfinite(v) and is_number(r.get("tokens")):
                xs, ys = curves.setdefault(k.removeprefix("harness/"), ([], []))
                xs.append(float(r["tokens"]))
                ys.append(float(v))
    return curves


def _harness_plot(title: str, recs: list[dict]) -> Any | None:
    curves = harness_curves(recs)
    if not curves:
        return None
    fig, ax = _figure(title)
    for name, (xs, ys) in sorted(curves.items()):
        ax.plot(xs, [100 * y for y in ys], lw=1, marker="o" if len(xs) < 30 else None, ms=3, label=name)
    ax.set_xlabel("tokens seen")
    ax.set_ylim(0, 100)
    ax.set_ylabel("score %")
    ax.legend(fontsize=8)
    return fig
