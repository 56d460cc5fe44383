"""`mspretrain doctor`: is this machine ready to train? Each finding is ok / warn / fail with a fix.

Design choices:
- Checks read versions and files; none changes the machine. MindSpore is imported once (about
  two seconds) because "does it import and which device targets does it see" is the question.
- fail = training will not start or will break (numpy 2, MindSpore missing, no room for one
  checkpoint, an Ascend target without a visible NPU); warn = it will run but worse than it could
  (network filesystem, oversubscribed threads, noisy native logs). Exit code 1 only on a fail.
"""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import sys
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from mspretrain.config.schema import Config
from mspretrain.errors import UserError
from mspretrain.fsutil import read_regular_text
from mspretrain.monitor.metrics import MOUNTINFO, _nearest_existing, is_network_fs, mount_of

ASCEND_HOME = Path("/usr/local/Ascend")
GB = 1024**3


@dataclass
class Finding:
    status: str  # "ok" | "warn" | "fail"
    name: str
    detail: str
    fix: str = ""


def _version_of(path: Path, key: str = "version") -> str | None:
    """`key=value` (or `key: value`) from an Ascend version file."""
    try:  # a few lines: a regular file of at most 1 MB (a FIFO or /dev/zero there hung doctor)
        text = read_regular_text(path, 1 << 20, "Ascend version file", errors="replace")
    except UserError:
        return None
    for line in text.splitlines():
        m = re.match(rf"\s*{key}\s*[=:]\s*(\S+)", line, re.IGNORECASE)
        if m:
            return m.group(1).strip("\"'")
    return None


def check_python_stack() -> list[Finding]:
    out = [Finding("ok" if sys.version_info >= (3, 9) else "fail", "python", sys.version.split()[0],
                   "use Python 3.9-3.11 (MindSpore 2.x wheels)")]
    try:
        import numpy
        major = int(numpy.__version__.split(".")[0])
        out.append(Finding("ok" if major < 2 else "fail", "numpy", numpy.__version__ + (" (< 2, as MindSpore needs)" if major < 2 else ""),
                           'pip install "numpy<2" — MindSpore 2.x binaries fail at model build with numpy 2'))
    except ImportError:
        out.append(Finding("fail", "numpy", "not installed", 'pip install "numpy<2"'))
    for mod, why in (("tensorboardX", "TensorBoard event files"), ("matplotlib", "`mspretrain report` plots")):
        found = importlib.util.find_spec(mod) is not None
        out.append(Finding("ok" if found else "warn", mod, "installed" if found else f"missing: no {why}", f"pip install {mod}"))
    tb = importlib.util.find_spec("tensorboard") is not None
    out.append(Finding("ok", "tensorboard", "installed" if tb else "not installed (optional: only `mspretrain dashboard` needs it)"))
    return out


def check_mindspore(target: str = "auto") -> list[Finding]:
    try:
        import mindspore as ms
        from mindspore import device_context  # ms.hal.is_available is deprecated in MindSpore 2.10 (hal/device.py)
    except Exception as exc:  # an import error of a native library is not always ImportError
        return [Finding("fail", "mindspore", f"cannot import: {exc}",
                        'pip install "mindspore==2.10.0" "numpy<2" (Ascend: the wheel matching your CANN)')]
    avail = []
    for t in ("CPU", "Ascend", "GPU"):
        try:
            if getattr(device_context, t.lower()).is_available():
                avail.append(t)
        except Exception:
            pass
    out = [Finding("ok", "mindspore", f"{ms.__version__}; device targets available: {', '.join(avail) or 'none'}")]
    if target == "ascend" and "Ascend" not in avail:
        out.append(Finding("fail", "device", "device.target = ascend but MindSpore sees no Ascend device",
                           "source /usr/local/Ascend/ascend-toolkit/set_env.sh, check `npu-smi info`, and install the Ascend MindSpore wheel"))
    return out


def check_ascend(root: Path = ASCEND_HOME) -> list[Finding]:
    if not root.exists() and not os.environ.get("ASCEND_HOME_PATH"):
        return [Finding("ok", "ascend", f"no {root}: not an Ascend host (CPU development is fine)")]
    out = []
    driver = _version_of(root / "driver" / "version.info", "Version")
    out.append(Finding("ok" if driver else "warn", "ascend driver", driver or f"no {root}/driver/version.info",
                       "install the Ascend driver (Ascend-hdk-*-npu-driver) matching your CANN"))
    cann = None
    latest = root / "ascend-toolkit" / "latest"
    for cand in [latest / "version.cfg", *sorted(latest.glob("*/ascend_toolkit_install.info"))]:
        cann = _version_of(cand) or _version_of(cand, "toolkit_installed_version")
        if cann:
            break
    out.append(Finding("ok" if cann else "warn", "CANN toolkit", cann or "version not found under ascend-toolkit/latest",
                       "install the CANN toolkit that your MindSpore wheel was built for"))
    env_ok = bool(os.environ.get("ASCEND_OPP_PATH") or "Ascend" in os.environ.get("LD_LIBRARY_PATH", ""))
    out.append(Finding("ok" if env_ok else "warn", "CANN environment", "set_env.sh sourced" if env_ok else "ASCEND_OPP_PATH unset",
                       "source /usr/local/Ascend/ascend-toolkit/set_env.sh before training"))
    return out


def check_launcher_and_threads(cfg: Config) -> list[Finding]:
    out = []
    msrun = shutil.which("msrun")
    out.append(Finding("ok" if msrun else "warn", "msrun", msrun or "not on PATH",
                       "activate the venv MindSpore is installed in (msrun ships with it); msrun workers run `python` from PATH"))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    omp = os.environ.get("OMP_NUM_THREADS")
    detail = f"{cores} usable cores; OMP_NUM_THREADS={omp or 'unset'}; device.threads={cfg.device.threads or 'auto (cores / ranks)'}"
    bad = (omp and omp.isdigit() and int(omp) > cores) or cfg.device.threads > cores
    out.append(Finding("warn" if bad else "ok", "threads", detail,
                       f"keep OMP_NUM_THREADS and device.threads <= {cores}: oversubscribed threads slow every step"))
    v = os.environ.get("GLOG_v")
    noisy = v is not None and v.strip() in ("0", "1")
    glog = f"GLOG_v={v if v is not None else 'unset (mspretrain sets 3)'}"
    for k in ("GLOG_logtostderr", "GLOG_stderrthreshold", "GLOG_log_dir"):
        if k in os.environ:
            glog += f", {k}={os.environ[k]}"
    out.append(Finding("warn" if noisy else "ok", "native logs", glog,
                       "unset GLOG_v (or set GLOG_v=3): INFO/DEBUG native logs bury the loss lines; use --verbose when debugging"))
    cache = os.environ.get("MS_COMPILER_CACHE_ENABLE", "")
    # Measured: with the compile cache a resumed run trains with zero gradients (loss frozen, grad norm 0).
    out.append(Finding("warn" if cache.strip() in ("1", "true", "True") else "ok", "compile cache",
                       f"MS_COMPILER_CACHE_ENABLE={cache or 'unset'}",
                       "unset MS_COMPILER_CACHE_ENABLE: a cached graph ignores the parameters restored on resume"))
    return out


def _meminfo() -> dict[str, int]:
    out = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            k, _, rest = line.partition(":")
            out[k] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return out


def check_run_dir(run_dir: Path, cfg: Config, mountinfo: str | Path = MOUNTINFO) -> list[Finding]:
    from mspretrain.preflight.plan import _param_count, make_plan

    out = []
    where = _nearest_existing(Path(run_dir))
    # The run writes here: a read-only filesystem, or a plain file where a parent dir must be,
    # was reported as "0.0 GB free" or as ok (and every train would then refuse at its start).
    if not where.is_dir():
        out.append(Finding("fail", "run dir writable", f"{where} is a file, so {run_dir} cannot be made under it",
                           "choose a --run path under a directory"))
    elif os.statvfs(where).f_flag & os.ST_RDONLY or not os.access(where, os.W_OK | os.X_OK):
        out.append(Finding("fail", "run dir writable", f"{where} is on a read-only filesystem or not writable (for {run_dir})",
                           "choose a --run dir you can write to"))
    mount = mount_of(where, mountinfo)
    if mount:
        net = is_network_fs(mount[1])
        out.append(Finding("warn" if net else "ok", "run dir filesystem", f"{mount[1]} at {mount[0]} (for {run_dir})",
                           "put --run on a local disk (metrics and checkpoints block on a network FS) and rsync it to shared storage"))
    # Before `prepare` the vocab is unknown: the configured tokenizer size is the best guess.
    m = cfg.model if cfg.model.vocab_size else replace(cfg.model, vocab_size=cfg.prepare.vocab_size)
    # the plan's figure, from the plan's own function: fp16/bf16 parameters with fp32 masters make a
    # checkpoint 14-16 bytes per parameter, not 12 (doctor and plan must not disagree)
    # (the size needs no budget: without one the plan skips the schedule, whose checks are train's)
    no_budget = replace(cfg.train, max_steps=0, max_tokens=0)
    ckpt = int(make_plan(replace(cfg, model=m, train=no_budget), devices=1, tokens=None, data_dir=None,
                         tokens_per_s_per_device=None)["checkpoint_bytes"])
    need = ckpt * (cfg.checkpoint.keep_last + 1)  # keep_last kept + the one being written
    free = shutil.disk_usage(where).free
    status = "fail" if free < ckpt else ("warn" if free < need else "ok")
    out.append(Finding(status, "disk", f"{free / GB:,.1f} GB free in {where}; a checkpoint is {ckpt / GB:,.3f} GB, "
                                       f"{cfg.checkpoint.keep_last} kept + 1 in flight = {need / GB:,.3f} GB",
                       "free space, lower checkpoint.keep_last, or choose another --run dir"))
    mem = _meminfo()
    if "MemAvailable" in mem:
        avail = mem["MemAvailable"]
        need_host = 16 * _param_count(m) if cfg.device.target in ("cpu", "auto") else 2 * GB
        status = "warn" if avail < max(need_host, 2 * GB) else "ok"
        out.append(Finding(status, "memory", f"{avail / GB:,.1f} GB available of {mem.get('MemTotal', 0) / GB:,.1f} GB",
                           "close other jobs or train a smaller model; `mspretrain plan` estimates the need"))
    return out


def check_cgroup(cfg: Config, cgroup_root: Path = Path("/sys/fs/cgroup")) -> list[Finding]:
    from mspretrain.preflight.isolate import cgroup_v2_writable

    ok, why = cgroup_v2_writable(cgroup_root)
    if ok:
        return [Finding("ok", "cpu isolation", f"cgroup v2 with the cpu controller at {cgroup_root}")]
    status = "warn" if cfg.device.cpu_quota > 0 else "ok"
    return [Finding(status, "cpu isolation", f"no cgroup v2 quota possible ({why}); --cpu-quota falls back to CPU affinity + nice",
                    "run as root on a host with a writable cgroup v2 hierarchy (systemd-run --scope -p CPUQuota=60% also works)")]


def check_overflow_mode(target: str, env: Mapping[str, str] | None = None) -> list[Finding]:
    """MS_ASCEND_CHECK_OVERFLOW_MODE: anything but INFNAN_MODE hides fp16 overflows on a 910B
    (mspretrain/device.py, `overflow_mode_problem`), and `train` refuses it on Ascend."""
    from mspretrain.device import INFNAN_MODE, OVERFLOW_MODE_ENV, ascend_available, overflow_mode_problem

    env = os.environ if env is None else env
    problem = overflow_mode_problem(env)
    if problem:
        status = "fail" if target == "ascend" or (target == "auto" and ascend_available()) else "warn"
        return [Finding(status, "fp16 overflow mode", problem, f"unset {OVERFLOW_MODE_ENV} or export {OVERFLOW_MODE_ENV}={INFNAN_MODE}")]
    detail = env.get(OVERFLOW_MODE_ENV) or f"{OVERFLOW_MODE_ENV} unset (train sets {INFNAN_MODE} on Ascend)"
    return [Finding("ok", "fp16 overflow mode", detail)]


def check_device_memory(cfg: Config, *, hbm: int | None = None) -> list[Finding]:
    """The memory pool the run will ask for (device.max_device_memory, 58 GB by default on Ascend)
    against the NPUs' HBM, read with npu-smi before anything binds a device: a 910B4 has 32 GB,
    and the pool would fail at the first large allocation, minutes into the job."""
    from mspretrain.device import pool_checked

    status, detail, fix = pool_checked(cfg, hbm=hbm)
    return [Finding("ok" if status == "skip" else status, "device memory", detail, fix)]


def run_checks(run_dir: Path, cfg: Config, *, mountinfo: str | Path = MOUNTINFO) -> list[Finding]:
    return (check_python_stack() + check_mindspore(cfg.device.target) + check_ascend() + check_overflow_mode(cfg.device.target)
            + check_device_memory(cfg) + check_launcher_and_threads(cfg) + check_run_dir(run_dir, cfg, mountinfo) + check_cgroup(cfg))


def format_findings(findings: list[Finding]) -> str:
    lines = []
    for f in findings:
        lines.append(f"[{f.status:^4}] {f.name}: {f.detail}")
        if f.status != "ok" and f.fix:
            lines.append(f"       fix: {f.fix}")
    n = {s: sum(1 for f in findings if f.status == s) for s in ("ok", "warn", "fail")}
    lines.append(f"{n['ok']} ok, {n['warn']} warn, {n['fail']} fail")
    return "\n".join(lines)
