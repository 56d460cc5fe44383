"""Checkpoints that cannot lie: full state, atomic, verified.

Layout of `RUN_DIR/checkpoints/step_NNNNNN/`:
    model.safetensors       parameters by our model's names
      or model-RRRRR-of-NNNNN.safetensors, one per rank, under ZeRO-3 (`optim.shard_parameters`):
      each rank's slices of the weights (checkpoint/model_shards.py); any layout reads them back
    optimizer.safetensors   AdamW moments and step counters (absent in weights-only checkpoints)
      or optimizer-RRRRR-of-NNNNN.safetensors, one per rank, when the optimizer state is
      sharded (`optim.shard_optimizer`): each holds the moments of the parameters that rank
      owns, and `opt_step`; their union is the whole state, so any world size can resume
    train_state.json        step, tokens seen, loss-scale state, schedule position, RNG, spikes
    data_state.json         loader state incl. data fingerprints
    config.toml             the resolved config that produced it
    tokenizer.model         a copy, so export/generate work without the data dir
    manifest.json           written LAST: format version, code version, SHA-256 + size of each file

Design choices: a checkpoint is written into `step_NNNNNN.tmp/`, every file and the directory
are fsynced, then the directory is renamed; a crash at any moment leaves either the old set or
the new set, and a directory without a manifest, or whose files do not match it, does not exist
for resume. Tensors are safetensors (never pickle); everything else is JSON/TOML a person can
read. Hashing is done on the bytes just written, in the writer thread, so verification at save
time costs one read of data already in the page cache.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
from safetensors import safe_open

from mspretrain import __version__
from mspretrain.checkpoint.model_shards import MODEL_FILE, model_files_problem, read_whole
from mspretrain.checkpoint.tensor_file import save_tensors
from mspretrain.config import schema as cfgmod
from mspretrain.config.schema import Config
from mspretrain.errors import UserError, env_number
from mspretrain.fsutil import chmod_like_open, fsync_path, read_json_file
from mspretrain.paths import DataPaths, RunPaths
from mspretrain.paths import step_dir_name as step_dir_name  # kept as store.step_dir_name for its callers

# The files of a checkpoint dir (a contract: docs/design.md "Files"); the run dir's are in paths.RunPaths.
FORMAT_VERSION = 1
STEP_RE = re.compile(r"^step_(\d{6,})$")
OPTIM_FILE = "optimizer.safetensors"
OPTIM_SHARD_RE = re.compile(r"^optimizer-(\d{5})-of-(\d{5})\.safetensors$")
TRAIN_STATE = "train_state.json"
DATA_STATE = "data_state.json"
CONFIG_FILE = "config.toml"
MANIFEST = "manifest.json"
TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json")  # a copy of the run's, whichever it has


class SaveError(OSError):
    """A checkpoint could not be written (disk full, permissions, ...); nothing was published."""


@dataclass(frozen=True)
class CheckpointRef:
    dir: Path
    step: int
    config: Config
    data_dir: Path | None
    tokenizer_path: Path | None


# --------------------------------------------------------------------------- writing

# Big reads: one syscall and one GIL-free hashlib.update per 16 MB keeps threads hashing in
# parallel and the disk streaming; 8 threads x 16 MB buffers = 128 MB at most.
_HASH_CHUNK = 16 << 20
_VERIFY_THREADS = 8


class _Stop(Exception):
    """Raised inside a hashing thread whose result can no longer change verify()'s answer."""


def _advise_sequential(fd: int) -> None:
    # Doubles the kernel's readahead window on Linux: cold files stream instead of seeking.
    if hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        except OSError:
            pass  # advice only; some filesystems refuse it


def _sha256(path: Path, stop: Callable[[], bool] | None = None) -> str:
    """Hex SHA-256 of a file; `stop()` is polled between chunks to abandon the work early."""
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:  # unbuffered: readinto goes straight to our buffer
        _advise_sequential(f.fileno())
        # small files (json, toml) get a small buffer: no 16 MB allocation per config file
        buf = bytearray(max(1, min(_HASH_CHUNK, os.fstat(f.fileno()).st_size)))
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])  # releases the GIL for large buffers
            if stop is not None and stop():
                raise _Stop
    return h.hexdigest()



def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=1, sort_keys=True, ensure_ascii=False), encoding="utf-8")


def optimizer_shard_name(rank: int, world: int) -> str:
    return f"optimizer-{rank:05d}-of-{world:05d}.safetensors"


def optimizer_files(names: Any) -> list[str]:
    """The optimizer files among `names` (one whole file, or the shards of a sharded run), sorted."""
    return sorted(n for n in names if n == OPTIM_FILE or OPTIM_SHARD_RE.match(n))


def write_checkpoint_dir(
    final_dir: Path,
    *,
    step: int,
    model: dict[str, np.ndarray],
    optimizer: dict[str, np.ndarray] | None,
    train_state: dict[str, Any],
    data_state: dict[str, Any] | None,
    config: Config,
    tokenizer_path: Path | None = None,
    optimizer_file: str = OPTIM_FILE,
    model_file: str = MODEL_FILE,
    model_metadata: dict[str, str] | None = None,
    collect: Callable[[Path], dict[str, dict[str, Any]]] | None = None,
) -> Path:
    """Write a complete checkpoint to `final_dir` atomically (tmp dir, fsync, rename).

    `model_file` / `model_metadata`: rank 0's per-rank weight file under ZeRO-3 (model_shards.py).
    `collect(tmp)`: moves files written by other ranks (optimizer and weight shards) into `tmp` before the
    manifest is written, and returns their manifest entries (hashed by the rank that wrote them).
    On any error the temporary directory is removed and the error re-raised; nothing that
    existed before is touched.
    """
    final_dir = Path(final_dir)
    tmp = final_dir.with_name(final_dir.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        tmp.mkdir(parents=True)
        save_tensors(model, tmp / model_file, model_metadata or {"format": "mspretrain", "step": str(step)})
        _fault_delay(step)
        if optimizer is not None:
            save_tensors(optimizer, tmp / optimizer_file, {"format": "mspretrain", "step": str(step)})
        _write_json(tmp / TRAIN_STATE, dict(train_state, step=step))
        if data_state is not None:
            _write_json(tmp / DATA_STATE, data_state)
        cfgmod.save(config, tmp / CONFIG_FILE)
        if tokenizer_path is not None and Path(tokenizer_path).is_file():
            shutil.copyfile(tokenizer_path, tmp / Path(tokenizer_path).name)
        files = collect(tmp) if collect is not None else {}
        for p in sorted(tmp.iterdir()):
            if p.name not in files:
                chmod_like_open(p)
                fsync_path(p)
                files[p.name] = {"sha256": _sha256(p), "bytes": p.stat().st_size}
        manifest = {"format_version": FORMAT_VERSION, "code_version": __version__, "step": step,
                    "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "files": files}
        _write_json(tmp / MANIFEST, manifest)
        fsync_path(tmp / MANIFEST)
        fsync_path(tmp)
        if final_dir.exists():  # re-saving the same step (e.g. after a rewind): replace it whole
            shutil.rmtree(final_dir)
        os.replace(tmp, final_dir)
        fsync_path(final_dir.parent)
    except Exception as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        # safetensors reports I/O failures as its own error type: one type for callers to catch
        raise SaveError(str(exc).replace("Error while serializing: ", "")) from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final_dir


def _fault_delay(step: int) -> None:
    """Fault-injection hook for the crash tests: hold a save open mid-write for N seconds.
    MSPRETRAIN_FAULT_SAVE_DELAY=N holds every save; N@STEP only the save of STEP (a crash test
    holds the last save so that its kill always lands before the run could finish, whatever the
    scheduling delays of a loaded machine)."""
    delay = os.environ.get("MSPRETRAIN_FAULT_SAVE_DELAY")
    if delay:
        seconds, _, only = delay.partition("@")
        wait = env_number("MSPRETRAIN_FAULT_SAVE_DELAY", 0.0, value=seconds or "x")
        if not only or env_number("MSPRETRAIN_FAULT_SAVE_DELAY", 0, kind=int, value=only) == step:
            time.sleep(wait)


def write_weights_only_checkpoint(out_dir: str | Path, tensors: dict[str, np.ndarray], config: Config,
                                  tokenizer_path: str | Path | None = None) -> Path:
    """A checkpoint with weights, config and manifest only (what `convert --from-hf` produces)."""
    return write_checkpoint_dir(Path(out_dir), step=0, model=tensors, optimizer=None,
                                train_state={"step": 0, "weights_only": True}, data_state=None,
                                config=config, tokenizer_path=Path(tokenizer_path) if tokenizer_path else None)


# --------------------------------------------------------------------------- verifying

def manifest_files(ckpt_dir: Path) -> tuple[dict[str, dict[str, Any]] | None, str | None]:
    """(files of the manifest, None) or (None, the reason it cannot be used). Every field is
    type-checked, so callers index the entries without guarding."""
    mpath = ckpt_dir / MANIFEST
    if not mpath.is_file():
        return None, "no manifest.json (the save did not finish)"
    try:
        manifest = read_json_file(mpath, "checkpoint manifest")
    except UserError:  # not a regular file, too large, not UTF-8, not JSON, nested too deep
        return None, "manifest.json is unreadable"
    problem = _manifest_problem(manifest)
    if problem:  # a malformed manifest is one more corrupt checkpoint: the fallback goes on
        return None, f"manifest.json is malformed ({problem})"
    files = manifest["files"]
    for required in (TRAIN_STATE, CONFIG_FILE):
        if required not in files:
            return None, f"manifest lists no {required}"
    weights = model_files_problem(files)  # model.safetensors, or every rank's model-R-of-N (ZeRO-3)
    if weights:
        return None, weights
    return files, None


def _manifest_problem(manifest: Any) -> str | None:
    """What is wrong with a manifest's types, or None. Every field verify and resume read is
    checked here, so a hand-edited manifest is a corrupt checkpoint, never a traceback."""
    if not isinstance(manifest, dict):
        return "not a JSON object"
    step = manifest.get("step", 0)
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        return f"step {step!r} is not a non-negative integer"
    files = manifest.get("files")
    if not isinstance(files, dict):
        return "no `files` object"
    for name, entry in files.items():
        if Path(name).name != name or name in ("", ".", ".."):  # names stay inside the checkpoint dir
            return f"file name {name!r} is not a plain name"
        if not isinstance(entry, dict):
            return f"the entry of {name} is not an object"
        size, digest = entry.get("bytes"), entry.get("sha256")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            return f"{name}: bytes {size!r} is not a size"
        if not isinstance(digest, str) or len(digest) != 64:
            return f"{name}: sha256 {digest!r} is not a SHA-256"
    return None


def _check_sizes(ckpt_dir: Path, files: dict[str, dict[str, Any]]) -> str | None:
    """Existence and size of every file, in sorted-name order: a deleted or truncated file is
    reported after a few stat() calls instead of after hashing tens of GB."""
    for name in sorted(files):
        p = ckpt_dir / name
        if not p.is_file():
            return f"{name} is missing"
        size = p.stat().st_size
        if size != files[name]["bytes"]:
            return f"{name} size mismatch ({size} bytes, manifest says {files[name]['bytes']})"
    return None


def _check_hashes(ckpt_dir: Path, files: dict[str, dict[str, Any]], pool: ThreadPoolExecutor) -> str | None:
    """SHA-256 of every file, hashed concurrently; the first mismatch in sorted-name order.

    Files are started largest first, so the longest hash is not left for last. Once file i is
    known bad, files sorted after i cannot change the answer: their hashing is abandoned.
    """
    names = sorted(files)
    first_bad = [len(names)]  # index of the first mismatch seen so far; a list so threads share it
    lock = threading.Lock()

    def check(i: int) -> None:
        name = names[i]
        try:
            digest = _sha256(ckpt_dir / name, stop=lambda: first_bad[0] < i)
        except _Stop:
            return
        except BaseException:
            first_bad[0] = -1  # an I/O error ends the verify: stop the other threads too
            raise
        if digest != files[name]["sha256"]:
            with lock:
                first_bad[0] = min(first_bad[0], i)

    order = sorted(range(len(names)), key=lambda i: -files[names[i]]["bytes"])
    for fut in [pool.submit(check, i) for i in order]:
        fut.result()  # re-raises I/O errors, as the sequential hash did
    return f"{names[first_bad[0]]} sha256 mismatch" if first_bad[0] < len(names) else None


def _verify(ckpt_dir: Path, deep: bool, pool: ThreadPoolExecutor | None) -> str | None:
    files, reason = manifest_files(ckpt_dir)
    if reason is None:
        reason = _check_sizes(ckpt_dir, files)
    if reason is not None or not deep:
        return reason
    if pool is not None:
        return _check_hashes(ckpt_dir, files, pool)
    with ThreadPoolExecutor(max_workers=min(len(files), _VERIFY_THREADS), thread_name_prefix="verify") as own:
        return _check_hashes(ckpt_dir, files, own)


def verify(ckpt_dir: Path, *, deep: bool = True) -> str | None:
    """None when the checkpoint matches its manifest, else the reason it does not.

    Cheap checks (manifest, existence, sizes) cover every file before any hashing; then the
    files are hashed concurrently. The reason names the first failing file in sorted order.
    """
    return _verify(Path(ckpt_dir), deep, None)


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, dir) of every finished-looking checkpoint dir, oldest first (tmp dirs excluded)."""
    root = RunPaths(run_dir).checkpoints
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = STEP_RE.match(p.name)
        if m and p.is_dir():
            out.append((int(m.group(1)), p))
    return sorted(out)


def move_aside(run_dir: Path) -> list[Path]:
    """`train --restart` over checkpoints that all fail verification: keep them, out of the way.

    `checkpoints/` becomes `checkpoints.failed-<UTC time>/` and `metrics.jsonl` goes into it, so
    the new run neither resumes from nor prunes them and its metrics do not follow the old ones.
    Moving the dir back to `checkpoints/` makes them repairable with `mspretrain recover` again.
    """
    paths = RunPaths(run_dir)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    dest = paths.root / f"{paths.checkpoints.name}.failed-{stamp}"
    n = 1
    while dest.exists():  # two restarts in one second: never merge into an older aside dir
        dest = paths.root / f"{paths.checkpoints.name}.failed-{stamp}-{n}"
        n += 1
    # metrics.jsonl goes into checkpoints/ first, then one rename moves both: a kill between the
    # two left the checkpoints aside and the old metrics in place, and the next `--restart` started
    # from step 0 appending to them (the new run's steps after the old run's)
    if paths.metrics.is_file():
        os.replace(paths.metrics, paths.checkpoints / paths.metrics.name)
    os.replace(paths.checkpoints, dest)
    fsync_path(paths.root)
    return [dest]


def clean_tmp_dirs(run_dir: Path, log: Callable[[str], None] = print) -> None:
    root = RunPaths(run_dir).checkpoints
    if root.is_dir():
        for p in root.glob("*.tmp"):
            log(f"removing unfinished checkpoint {p.name} (left by an interrupted save)")
            shutil.rmtree(p, ignore_errors=True)


def latest_verified(run_dir: Path, log: Callable[[str], None] = print) -> Path | None:
    """Newest checkpoint whose manifest verifies; corrupt ones are reported and skipped."""
    bad: list[tuple[str, str]] = []
    chosen = None
    # one pool for all candidates: falling back past a corrupt checkpoint starts no new threads
    with ThreadPoolExecutor(max_workers=_VERIFY_THREADS, thread_name_prefix="verify") as pool:
        for _step, d in reversed(list_checkpoints(run_dir)):
            reason = _verify(d, True, pool)
            if reason is None:
                chosen = d
                break
            bad.append((d.name, reason))
    for name, reason in bad:
        log(f"checkpoint {name} is corrupt: {reason} — " + (f"using {chosen.name}" if chosen else "no other checkpoint verifies"))
    return chosen


# --------------------------------------------------------------------------- reading

def read_json(path: Path) -> dict[str, Any]:
    fix = "run `mspretrain recover RUN_DIR` to rebuild it"
    if not Path(path).exists():
        raise UserError(f"{path} is missing", fix)
    try:
        return read_json_file(path, "checkpoint state file", fix)
    except UserError as e:
        raise UserError(f"{path} is corrupt ({e.cause})", fix) from None


def _run_meta(run_dir: Path) -> dict[str, Any]:
    p = RunPaths(run_dir).meta
    if p.is_file():
        try:
            meta = read_json_file(p, "run_meta.json")
        except UserError:
            return {}
        return meta if isinstance(meta, dict) else {}
    return {}


def resolve_checkpoint(path: str | Path, log: Callable[[str], None] = lambda s: None) -> CheckpointRef:
    """A RUN_DIR (newest verified checkpoint) or a CKPT_DIR (must verify itself)."""
    p = Path(path)
    if not p.exists():
        raise UserError(f"{p} does not exist", "pass a run dir (mspretrain train --run DIR) or a checkpoint dir")
    if (p / MANIFEST).is_file() or STEP_RE.match(p.name):
        reason = verify(p)
        if reason:
            raise UserError(f"checkpoint {p} does not verify: {reason}", "use another checkpoint (see `mspretrain checkpoints RUN_DIR --verify`)")
        in_run = RunPaths(p.parent.parent).checkpoints == p.parent  # RUN_DIR/checkpoints/step_N
        ckpt, run_dir = p, (p.parent.parent if in_run else None)
    else:
        ckpt = latest_verified(p, log=log)
        if ckpt is None:
            raise UserError(f"{p} holds no verified checkpoint", "train first (mspretrain train ... --run DIR), or pass a checkpoint dir")
        run_dir = p
    m = read_json_file(ckpt / MANIFEST, "checkpoint manifest")
    cfg = cfgmod.load(ckpt / CONFIG_FILE)
    meta = _run_meta(run_dir) if run_dir else {}
    data_dir = Path(meta["data_dir"]) if meta.get("data_dir") else None
    # the checkpoint's own copy first, then the run dir's, then the data dir the run trained on
    cands = [ckpt / name for name in TOKENIZER_FILES]
    if run_dir:
        cands += [RunPaths(run_dir).tokenizer_model, RunPaths(run_dir).tokenizer_json]
    if data_dir:
        cands += [DataPaths(data_dir).tokenizer_model, DataPaths(data_dir).tokenizer_json]
    tok = next((c for c in cands if c.is_file()), None)
    return CheckpointRef(dir=ckpt, step=int(m.get("step", 0)), config=cfg, data_dir=data_dir, tokenizer_path=tok)


def read_model_tensors(ref: CheckpointRef, *, mapped: bool = False) -> dict[str, np.ndarray]:
    """Weights by name as fp32 (runs with fp16 parameters store those as fp16), whole: from
    model.safetensors or joined from the per-rank files of a ZeRO-3 or expert-parallel run
    (model_shards.py).

    mapped: a model.safetensors is mapped, not read (tensor_file.py `mapped_tensors`: read-only
    views in the stored dtype, fp16 ones too), for `train --init-from`, where every rank of a
    host starts from the same file: read whole, each rank held the whole fp32 model (Qwen3-30B-A3B:
    122 GB a rank, ~1 TB on a host of 8) before its cut kept a sixteenth of the experts."""
    if mapped and (ref.dir / MODEL_FILE).is_file():
        from mspretrain.checkpoint.tensor_file import mapped_tensors

        try:
            return mapped_tensors(ref.dir / MODEL_FILE)
        except (ValueError, KeyError, OSError) as exc:
            raise UserError(f"cannot map {MODEL_FILE} in {ref.dir} ({exc})",
                            "resume from another checkpoint (`mspretrain checkpoints RUN --verify` lists them)") from None
    return {k: v.astype(np.float32) if v.dtype == np.float16 else v for k, v in read_whole(ref.dir).items()}


def optimizer_keys(ckpt_dir: Path) -> set[str]:
    """Every tensor name of the optimizer state, over all its files (headers only)."""
    keys: set[str] = set()
    for name in optimizer_files(p.name for p in Path(ckpt_dir).iterdir()):
        with safe_open(str(Path(ckpt_dir) / name), framework="numpy") as f:
            keys.update(f.keys())
    return keys


def read_optimizer_tensors(ref_or_dir: CheckpointRef | Path, keys: set[str] | None = None) -> dict[str, np.ndarray] | None:
    """The optimizer state (None in a weights-only checkpoint), or only `keys` of it: a rank of a
    sharded run reads the tensors it owns from whichever shard holds them, nothing else."""
    d = ref_or_dir.dir if isinstance(ref_or_dir, CheckpointRef) else Path(ref_or_dir)
    names = optimizer_files(p.name for p in d.iterdir())
    if not names:
        return None
    out: dict[str, np.ndarray] = {}
    for name in names:
        with safe_open(str(d / name), framework="numpy") as f:
            for k in f.keys():
                if (keys is None or k in keys) and k not in out:
                    out[k] = f.get_tensor(k)
    return out


# --------------------------------------------------------------------------- retention

def prune(run_dir: Path, keep_last: int, keep_every: int, log: Callable[[str], None] = print) -> list[Path]:
    """Keep the newest `keep_last`, every `keep_every`-th step, and always the newest verified one."""
    ckpts = list_checkpoints(run_dir)
    keep = {s for s, _ in ckpts[-keep_last:]}
    if keep_every:
        keep |= {s for s, _ in ckpts if s % keep_every == 0}
    newest_ok = latest_verified(run_dir, log=lambda s: None)
    removed = []
    for step, d in ckpts:
        if step in keep or d == newest_ok:
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d)
    return removed
