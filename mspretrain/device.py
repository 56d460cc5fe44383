"""Device selection: one place decides CPU or Ascend and which Ascend-only options apply.

Design choices: `device.target = auto` picks Ascend when MindSpore was built for it and an NPU is
visible, else CPU. What actually runs is decided here and reported at start-up, so the rest of
the code asks `DeviceInfo` instead of probing MindSpore itself, and the start-up line never
claims an option that does not run:
- attention: FlashAttentionScore only where `model.attention` picks it (Ascend,
  fp16/bf16, a head size the kernel takes); the math path otherwise, fp32 on Ascend included.
- graph-kernel fusion stays off (MindSpore Transformers' pretraining config
  configs/qwen3/pretrain_qwen3_32b_4k.yaml runs jit_level "O0"; some of its fine-tuning configs
  opt into "O1"; its predict configs set enable_graph_kernel: False). In MindSpore 2.10 both
  `set_context(enable_graph_kernel=True)` and `set_context(jit_config=...)` are deprecated
  (mindspore/context.py, set_context's docstring: "jit_config ... deprecated ... Please use the
  related parameter of mindspore.jit instead"); the level is `mindspore.jit(..., jit_level="O1")`
  (graph/api.py, `jit`: a per-function argument, default "O0"). `device.jit_level = "O1"` is the
  opt-in, carried in `DeviceInfo.jit_level` to every `ms.jit` call (the step and eval).
- fp16 overflow stays visible on Ascend: MS_ASCEND_CHECK_OVERFLOW_MODE=INFNAN_MODE is set unless
  the user set it, and SATURATION_MODE is refused. Under saturation a 910B clamps an fp16
  overflow to +-65504 instead of producing inf, so the step's `isfinite` check never fires and an
  overflowed step is applied; MindSpore itself then needs the NPU's float-status registers
  (amp.py `_all_finite`: `_ascend_910b_target() and check_overflow_mode == "SATURATION_MODE"` ->
  NPUGetFloatStatusV2), which this step does not read.
- determinism: `device.deterministic` through `mindspore.set_deterministic` (device_manager.py),
  which on Ascend sets HCCL_DETERMINISTIC=true and TE_PARALLEL_COMPILER=1 (serial kernel
  compilation): reproducible all-reduces and kernels at a cost in step time and compile time.
  MindSpore allows one call per process, so a second setup in the same process keeps the first.
- no dataset sink mode: the train loop feeds batches from Python (data/loader.py).
bf16 is refused on CPU before any compute.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from mspretrain.config.schema import Config
from mspretrain.errors import UserError, env_number

LOCAL_RANKS_ENV = "MSPRETRAIN_LOCAL_RANKS"  # set by `mspretrain launch` for its msrun workers


@dataclass(frozen=True)
class DeviceInfo:
    target: str  # "cpu" | "ascend"
    threads: int
    flash_attention: bool  # FlashAttentionScore runs (else the math attention)
    jit_level: str = "O0"
    deterministic: bool = True
    notes: tuple[str, ...] = field(default_factory=tuple)
    max_device_memory_gb: float = 0.0  # Ascend: the runtime pool's cap (device.max_device_memory); 0 on CPU

    def memory_setting(self) -> str | None:
        """`max_size` for `mindspore.runtime.set_memory` (MindSpore 2.10 runtime/memory.py, the
        successor of set_context(max_device_memory=...)): MindSpore Transformers' 910B templates
        use 58GB. None on CPU, where the pool is host memory and is left alone."""
        return f"{self.max_device_memory_gb:g}GB" if self.target == "ascend" and self.max_device_memory_gb > 0 else None

    def describe(self) -> str:
        opts = [f"device {self.target}", f"{self.threads} thread{'s' if self.threads != 1 else ''}",
                f"attention {'flash (FlashAttentionScore)' if self.flash_attention else 'math'}",
                f"jit_level {self.jit_level}", f"deterministic {'on' if self.deterministic else 'off'}"]
        return ", ".join(opts) + "".join(f"; {n}" for n in self.notes)


def ascend_available() -> bool:
    """True when an NPU device node is visible and this MindSpore build can drive it."""
    # Check the device node first: asking MindSpore on a CPU-only box prints a loader error.
    if not any(os.path.exists(p) for p in ("/dev/davinci0", "/dev/davinci_manager")):
        return False
    try:
        # mindspore.device_context.ascend.is_available replaces the deprecated ms.hal.is_available
        # (mindspore/hal/device.py says so in 2.10).
        from mindspore.device_context.ascend import is_available

        return bool(is_available())
    except Exception:  # an import or runtime failure simply means no usable Ascend here
        return False


def resolve_target(target: str) -> str:
    if target == "auto":
        return "ascend" if ascend_available() else "cpu"
    if target == "ascend" and not ascend_available():
        raise UserError("device.target = ascend but no Ascend NPU is visible (/dev/davinci*)",
                        "use device.target=cpu (or auto) on this machine")
    return target


# MindSpore Transformers' 910B pretraining templates cap the runtime's pool at 58 GB of the 64 GB
# (context.max_device_memory: "58GB" in e.g. configs/llama2/pretrain_llama2_7b.yaml): the rest is
# left to HCCL and the driver. We plan against the same figure (device.max_device_memory).
ASCEND_910B_USABLE_GB = 58.0
# HBM each NPU keeps outside MindSpore's pool: the margin of MindSpore Transformers' 910B templates
# (max_device_memory 58GB of 64). The driver holds 4 GB of a 64 GB Atlas 800T A2 NPU while idle and 3
# of a 32 GB one (CANN HDK docs, dcmi_get_device_hbm_info's constraints), HCCL 2 x HCCL_BUFFSIZE per
# communicator. GB here are MindSpore's (2^30 bytes: its "xxGB" sizes, runtime/memory.py, are
# binary; the memory_stats example there shows a 1 GB block as 1073741824 bytes) and npu-smi's MB 2^20.
HBM_RESERVE_GB = 6.0
GIB = 2**30
NPU_SMI = "npu-smi"
NPU_SMI_CAP = 1 << 20  # bytes of npu-smi output read at most: its usage table is a few KB
HBM_PLAUSIBLE = (4 * GIB, 1024 * GIB)  # an NPU's HBM outside these bounds is a misread (npu_hbm_bytes)


def npu_hbm_bytes(npu: int = 0, *, timeout_s: float = 20.0) -> int | None:
    """HBM of one NPU in bytes, read with the driver's `npu-smi info -t usages -i NPU` ("HBM
    Capacity(MB) : 32768" on a 910B4, 65536 on a 910B1-B3; MB = 2^20 bytes), without initialising
    the device. MindSpore's query (`hal.get_device_properties`, what `selftest` uses) binds the NPU,
    which a launcher must not do before its ranks bind theirs. None when npu-smi is missing, fails,
    or prints no such line (unverified on hardware: the field name is what public npu-smi parsers read)."""
    import re
    import shutil

    from mspretrain.fsutil import command_output

    exe = shutil.which(NPU_SMI)
    if exe is None:
        return None
    # bounded: 1 MB and the timeout (a wedged or endless npu-smi would otherwise grow without limit),
    # bytes that are not UTF-8 replaced (one was a UnicodeDecodeError traceback)
    out = command_output([exe, "info", "-t", "usages", "-i", str(npu)], cap=NPU_SMI_CAP, timeout_s=timeout_s)
    if out is None:
        return None
    sizes = [int(m) for m in re.findall(r"HBM Capacity\(MB\)\s*:\s*(\d{1,9})\b", out)]
    return min(sizes) * 2**20 if sizes else None  # one line per chip; the smallest bounds the pool


def pool_problem(hbm_bytes: int, pool_gb: float) -> str | None:
    """Why a memory pool of `pool_gb` (device.max_device_memory) does not fit an NPU of `hbm_bytes`,
    or None. A 910B4 has 32 GB of HBM, so the 910B configs' 58 GB fails at the first large allocation."""
    total_gb = hbm_bytes / GIB
    if pool_gb <= total_gb - HBM_RESERVE_GB:
        return None
    return (f"device.max_device_memory {pool_gb:g} GB does not fit this NPU's {total_gb:.1f} GB of HBM "
            f"less {HBM_RESERVE_GB:g} GB for the driver and HCCL" + (" (a 32 GB 910B4?)" if total_gb < 40 else ""))


def pool_fix(hbm_bytes: int) -> str:
    return f"set device.max_device_memory={max(1, int(hbm_bytes / GIB - HBM_RESERVE_GB))} (GB) or less in the config"


def pool_checked(cfg: Config, *, hbm: int | None = None) -> tuple[str, str, str]:
    """(status ok/warn/fail/skip, detail, fix) of the config's Ascend memory pool against this
    node's NPUs, asked before anything sets the pool (doctor, launch). "skip": not an Ascend run."""
    # No MindSpore here: `launch` asks before any rank starts, and npu-smi answers only where NPUs are.
    if cfg.device.target == "cpu":
        return "skip", "device.target = cpu: no pool to check", ""
    pool = cfg.device.max_device_memory or ASCEND_910B_USABLE_GB
    hbm = npu_hbm_bytes() if hbm is None else hbm
    if hbm is None:
        if cfg.device.target == "auto" and not any(os.path.exists(p) for p in ("/dev/davinci0", "/dev/davinci_manager")):
            return "skip", "no NPU here (device.target = auto runs on CPU): no pool to check", ""
        return ("warn", f"could not read the NPUs' HBM ({NPU_SMI} info -t usages -i 0): the {pool:g} GB pool cap is unchecked",
                f"run `{NPU_SMI} info -t usages -i 0`; on a 32 GB 910B4 set device.max_device_memory=26")
    if not HBM_PLAUSIBLE[0] <= hbm <= HBM_PLAUSIBLE[1]:
        # a figure no NPU has is a misread (another tool's output, a damaged driver), not a fact to
        # plan with: doctor printed 10^12 MB as ok. 910B NPUs have 32 or 64 GB; the bounds leave room.
        return ("warn", f"{NPU_SMI} reports {hbm / GIB:,.1f} GB of HBM per NPU, which no NPU has "
                        f"(expected {HBM_PLAUSIBLE[0] // GIB}-{HBM_PLAUSIBLE[1] // GIB} GB): the {pool:g} GB pool cap is unchecked",
                f"run `{NPU_SMI} info -t usages -i 0` and check the driver; on a 32 GB 910B4 set device.max_device_memory=26")
    problem = pool_problem(hbm, pool)
    if problem:
        return "fail", problem, pool_fix(hbm)
    return "ok", f"{hbm / GIB:.1f} GB HBM per NPU, pool cap device.max_device_memory {pool:g} GB", ""


ATTENTION_KINDS = ("auto", "math", "flash")
# FlashAttentionScore's head size D: "a multiple of 16, with the max value of 512"
# (mindspore/ops/auto_generate/gen_ops_prim.py, FlashAttentionScore's doc, MindSpore 2.10).
FLASH_HEAD_MULTIPLE, FLASH_HEAD_MAX = 16, 512


def flash_head_dim_problem(head_dim: int) -> str | None:
    """Why FlashAttentionScore cannot take this head size, or None when it can."""
    if head_dim % FLASH_HEAD_MULTIPLE or not 0 < head_dim <= FLASH_HEAD_MAX:
        return (f"head size {head_dim} is not a multiple of {FLASH_HEAD_MULTIPLE} up to {FLASH_HEAD_MAX}, "
                "which FlashAttentionScore needs")
    return None


def select_attention(attention: str, device: str, dtype: str, head_dim: int | None = None) -> bool:
    """True when the fused Ascend kernel should run; errors for impossible requests.

    auto falls back to the math path where the kernel cannot run (and device.py says so at
    start-up); an explicit "flash" that cannot run is an error."""
    if attention not in ATTENTION_KINDS:
        raise UserError(f"attention = {attention!r} is not one of {', '.join(ATTENTION_KINDS)}", "use auto (flash on Ascend, math elsewhere)")
    if attention == "math":
        return False
    flash_ok = device == "ascend" and dtype in ("fp16", "bf16")
    if attention == "flash" and not flash_ok:
        raise UserError(f"FlashAttentionScore needs device ascend and dtype fp16/bf16 (got {device}, {dtype})",
                        "use attention=math (or auto) on this device / dtype")
    problem = flash_head_dim_problem(head_dim) if head_dim is not None else None
    if attention == "flash" and problem:
        raise UserError(f"FlashAttentionScore cannot run: {problem}", "choose model.dim / model.n_heads = 64 or 128, or attention=math")
    return flash_ok and problem is None


OVERFLOW_MODE_ENV = "MS_ASCEND_CHECK_OVERFLOW_MODE"
INFNAN_MODE, SATURATION_MODE = "INFNAN_MODE", "SATURATION_MODE"


def overflow_mode_problem(env: Mapping[str, str] | None = None) -> str | None:
    """Why the Ascend overflow mode in `env` would hide fp16 overflows, or None (see the docstring)."""
    mode = (os.environ if env is None else env).get(OVERFLOW_MODE_ENV, "").strip()
    if mode and mode != INFNAN_MODE:
        return (f"{OVERFLOW_MODE_ENV}={mode}: an Ascend 910B then clamps fp16 overflow to +-65504 instead of inf, "
                "so overflowed steps would be applied")
    return None


def cpu_threads(env: Mapping[str, str] | None = None) -> int:
    """Kernel threads of one training process when `device.threads` is 0: this host's cores shared by
    its ranks (what `launch` exported, else msrun's MS_WORKER_NUM, else 1).

    Each msrun rank is a process with its own kernel pool. With every pool the size of the box, the
    ranks' idle kernel threads spin on the cores their peers are computing on: a 2-rank job on 2
    cores spent ~8 % more CPU at `threads = 2` than at 1, with identical losses
    (docs/benchmarks.md, "Threads per msrun rank")."""
    env = os.environ if env is None else env
    name = LOCAL_RANKS_ENV if env.get(LOCAL_RANKS_ENV, "").strip() else "MS_WORKER_NUM"
    n = env_number(name, 1, kind=int, minimum=1, value=env.get(name, ""))
    return max(1, (os.cpu_count() or 1) // max(int(n), 1))


def plan_device(cfg: Config, *, target: str | None = None) -> DeviceInfo:
    """Decide the device and its options from the config, without touching MindSpore.

    `target`: an already resolved target (tests pass "ascend" to see what a 910B would run)."""
    target = target or resolve_target(cfg.device.target)
    threads = cfg.device.threads or cpu_threads()
    dtype = cfg.precision.dtype
    head_dim = cfg.model.head_size if cfg.model.n_heads else 0
    flash = select_attention("auto", target, dtype, head_dim)
    notes = []
    if target != "ascend":
        notes.append("FlashAttentionScore is Ascend-only")
        if cfg.device.jit_level != "O0":
            raise UserError(f"device.jit_level = {cfg.device.jit_level} is an Ascend option (graph-kernel fusion)",
                            "leave device.jit_level=O0 on CPU")
    elif (problem := overflow_mode_problem()) is not None:
        raise UserError(problem, f"unset {OVERFLOW_MODE_ENV} or set it to {INFNAN_MODE}")
    elif dtype == "fp32":
        notes.append("FlashAttentionScore has no fp32")
    elif not flash:
        notes.append(flash_head_dim_problem(head_dim))
    mem_gb = (cfg.device.max_device_memory or ASCEND_910B_USABLE_GB) if target == "ascend" else 0.0
    return DeviceInfo(target=target, threads=threads, flash_attention=flash, jit_level=cfg.device.jit_level,
                      deterministic=cfg.device.deterministic, notes=tuple(notes), max_device_memory_gb=mem_gb)


# MindSpore 2.10 hands every compiled graph to a host pipeline queue, and whoever reads a result
# (`asnumpy`) waits for that queue in an empty loop (runtime/pipeline/async_r_queue.cc,
# `AsyncRQueue::Wait`: `while (!tasks_queue_->IsEmpty()) {}`). On Ascend that spin costs a host core
# the device does not use. On CPU the device IS the host: the spinning Python thread takes a core
# from the two kernel threads every step (perf: 99 % of the main thread in AsyncRQueue::Wait; ~700 ms
# of CPU per 1.2 s step on 2 cores, docs/benchmarks/train.md). With MS_DEV_HOST_BLOCKING_RUN=1
# (`AsyncRQueue::Push`: `if (blocking_run || disable_multi_thread_) { task->Run(); return; }`) the
# calling thread runs the graph itself and nothing spins. The flag is a function-local static read at
# the first queued task of the process, so it must be set before any MindSpore op runs; a user's own
# value wins (setdefault). CPU only: on Ascend the queue lets Python run ahead of the device.
HOST_BLOCKING_ENV = "MS_DEV_HOST_BLOCKING_RUN"


def setup_mindspore(info: DeviceInfo, *, device_id: int | None = None) -> None:
    """Point MindSpore at the device. Global mode stays PyNative; hot paths are `ms.jit`.

    device_id: the NPU to bind on Ascend; None = MindSpore's choice (msrun negotiates it). A process
    started from a rank table passes its DEVICE_ID (world.select_launch)."""
    if info.target == "cpu":
        os.environ.setdefault(HOST_BLOCKING_ENV, "1")
    else:  # read by the Ascend runtime; plan_device has refused any other value
        os.environ.setdefault(OVERFLOW_MODE_ENV, INFNAN_MODE)
    import mindspore as ms

    target = "Ascend" if info.target == "ascend" else "CPU"
    try:
        if device_id is None:
            ms.set_device(target)
        else:
            ms.set_device(target, device_id)
    except RuntimeError:
        # Already fixed for this process (a kernel ran, or an earlier call): fine if it is the same device.
        # get_current_device (device_manager.py) is 2.10's successor of get_context("device_target")
        if ms.get_current_device().device_target != target:
            raise
    ms.set_context(mode=ms.PYNATIVE_MODE)
    if info.target == "cpu":
        try:
            # MindSpore's CPU kernels default to 25 threads; on a small box that oversubscription
            # costs ~1.5x per step (measured in benchmarks/train_bench.py). Settable once per process.
            ms.device_context.cpu.op_tuning.threads_num(info.threads)
        except Exception:  # already set by an earlier call in this process, or an older runtime
            pass
    if info.memory_setting() is not None:
        try:
            ms.runtime.set_memory(max_size=info.memory_setting())
        except RuntimeError:  # "can not be set repeatedly": the first setup of this process stands
            pass
    try:
        ms.set_deterministic(info.deterministic)
    except RuntimeError:  # "can not be set repeatedly": the first setup of this process stands
        pass
