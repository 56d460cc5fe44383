"""Device selection: one place decides CPU or Ascend and which Ascend-only options apply.

Design choices: `device.target = auto` picks Ascend when MindSpore was built for it and an NPU is
visible, else CPU. Options that only Ascend can run (fused FlashAttention, dataset sink mode,
graph-kernel fusion) are chosen here and reported at start-up, so the rest of the code asks
`DeviceInfo` instead of probing MindSpore itself. bf16 is refused on CPU before any compute.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from mspretrain.config import Config
from mspretrain.errors import UserError


@dataclass(frozen=True)
class DeviceInfo:
    target: str  # "cpu" | "ascend"
    threads: int
    flash_attention: bool
    sink_mode: bool
    graph_kernel_fusion: bool
    notes: tuple[str, ...] = field(default_factory=tuple)

    def describe(self) -> str:
        opts = [f"device {self.target}", f"{self.threads} threads"]
        for name in ("flash_attention", "sink_mode", "graph_kernel_fusion"):
            opts.append(f"{name.replace('_', ' ')} {'on' if getattr(self, name) else 'off'}")
        return ", ".join(opts)


def ascend_available() -> bool:
    """True when an NPU device node is visible and this MindSpore build can drive it."""
    # Check the device node first: asking MindSpore on a CPU-only box prints a loader error.
    if not any(os.path.exists(p) for p in ("/dev/davinci0", "/dev/davinci_manager")):
        return False
    try:
        import mindspore as ms

        return bool(ms.hal.is_available("Ascend"))
    except Exception:  # an import or runtime failure simply means no usable Ascend here
        return False


def resolve_target(target: str) -> str:
    if target == "auto":
        return "ascend" if ascend_available() else "cpu"
    if target == "ascend" and not ascend_available():
        raise UserError("device.target = ascend but no Ascend NPU is visible (/dev/davinci*)",
                        "use device.target=cpu (or auto) on this machine")
    return target


def plan_device(cfg: Config) -> DeviceInfo:
    """Decide the device and its options from the config, without touching MindSpore."""
    target = resolve_target(cfg.device.target)
    threads = cfg.device.threads or (os.cpu_count() or 1)
    on_ascend = target == "ascend"
    notes = []
    if not on_ascend:
        notes.append("math attention (FlashAttentionScore is Ascend-only)")
    return DeviceInfo(target=target, threads=threads, flash_attention=on_ascend, sink_mode=on_ascend,
                      graph_kernel_fusion=on_ascend, notes=tuple(notes))


def setup_mindspore(info: DeviceInfo, *, deterministic: bool = True) -> None:
    """Point MindSpore at the device. Global mode stays PyNative; hot paths are `ms.jit`."""
    import mindspore as ms

    target = "Ascend" if info.target == "ascend" else "CPU"
    try:
        ms.set_device(target)
    except RuntimeError:
        # Already fixed for this process (a kernel ran, or an earlier call): fine if it is the same device.
        if ms.get_context("device_target") != target:
            raise
    ms.set_context(mode=ms.PYNATIVE_MODE)
    if info.target == "cpu":
        try:
            # MindSpore's CPU kernels default to 25 threads; on a small box that oversubscription
            # costs ~1.5x per step (measured in benchmarks/train_bench.py). Settable once per process.
            ms.device_context.cpu.op_tuning.threads_num(info.threads)
        except Exception:  # already set by an earlier call in this process, or an older runtime
            pass
    if deterministic and info.target == "ascend":
        ms.set_context(deterministic="ON")
    if info.graph_kernel_fusion:
        ms.set_context(enable_graph_kernel=True)
