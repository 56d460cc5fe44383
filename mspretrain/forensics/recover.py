"""Rebuild `train_state.json` / `data_state.json` of a checkpoint whose weights are intact.

Sources of truth, in order: the step in the directory name; `metrics.jsonl` for the loss
scale and skipped steps at that step; the config for tokens per step (`budget.py`); the loader's order being
a pure function of (seed, position), the data position is `step × global_batch` samples.
The RNG needs no state (training has no stochastic op; init and data order come from the
seed). The spike detector restarts with an empty window: said, not hidden.

Lives in forensics/ (layer 5), not checkpoint/ (layer 3): replaying the loss scale needs
`step/loss_scale` and the data position needs `data/loader`, both read here as a job would.
"""
from __future__ import annotations

import json
from pathlib import Path

from mspretrain import budget
from mspretrain.checkpoint import store
from mspretrain.checkpoint.model_shards import model_files
from mspretrain.config.schema import load as load_config
from mspretrain.errors import UserError
from mspretrain.fsutil import LOG_CAP, atomic_write, jsonl_dicts, read_json_file, read_regular_text
from mspretrain.paths import RunPaths
from mspretrain.step.loss_scale import LossScaler

WEIGHT_FILES = (store.CONFIG_FILE,)  # plus the weight file(s) (ZeRO-3: one per rank) and the optimizer file(s)


def _weights_intact(ckpt: Path) -> str | None:
    """None when model/optimizer/config match the manifest (the states may be broken)."""
    files, reason = store.manifest_files(ckpt)  # a malformed manifest is a reason, not a traceback
    if reason is not None:
        return reason
    optim = store.optimizer_files(files)
    if not optim:
        return "the manifest lists no optimizer state"
    for name in WEIGHT_FILES + tuple(model_files(files)) + tuple(optim):
        if name not in files or not (ckpt / name).is_file():
            return f"{name} is missing"
        if store._sha256(ckpt / name) != files[name]["sha256"]:
            return f"{name} sha256 mismatch"
    return None


def _read_metrics(run_dir: Path, step: int) -> dict[int, dict]:
    """Records of metrics.jsonl by step, up to `step` (later lines of a resumed run win)."""
    out: dict[int, dict] = {}
    path = RunPaths(run_dir).metrics
    if not path.exists():
        return out
    for _, rec in jsonl_dicts(read_regular_text(path, LOG_CAP, "metrics log", errors="replace")):
        if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] <= step:
            out.setdefault(rec["step"], {}).update(rec)
    return out


def _replay_loss_scale(cfg, records: dict[int, dict], step: int) -> LossScaler | None:
    """The scaler after `step` steps, replayed from the per-step skip counts (exact when every step is logged)."""
    scaler = LossScaler.from_config(cfg.precision)
    prev = 0
    for s in range(1, step + 1):
        rec = records.get(s)
        if rec is None or "skipped" not in rec:
            return None
        used = rec.get("loss_scale")
        if used is not None and scaler.mode != "none" and abs(float(used) - scaler.scale) > 1e-6 * scaler.scale:
            return None  # the log disagrees with the replay: do not guess
        skipped = int(rec["skipped"])
        scaler.update(skipped == prev)
        prev = skipped
    return scaler


def recover(run_dir: Path, step: int | None = None) -> list[str]:
    from mspretrain.data.loader import Loader, resolve_sources
    from mspretrain.data.mixing import consumed_after, normalise

    run_dir = Path(run_dir)
    ckpts = store.list_checkpoints(run_dir)
    if step is not None:
        ckpts = [(s, d) for s, d in ckpts if s == step]
        if not ckpts:
            raise UserError(f"{run_dir} has no checkpoint for step {step}", "see `mspretrain checkpoints RUN_DIR`")
    chosen, problems = None, []
    for s, d in reversed(ckpts):
        reason = _weights_intact(d)
        if reason is None:
            chosen = (s, d)
            break
        problems.append(f"{d.name}: weights not usable ({reason})")
    if chosen is None:
        raise UserError(f"no checkpoint in {run_dir} has intact weights" + (f" ({problems[0]})" if problems else ""),
                        "nothing to recover from: start a new run")
    s, d = chosen
    report = problems[:]
    if store.verify(d) is None:
        return report + [f"{d.name} verifies: nothing to recover"]
    cfg = load_config(d / store.CONFIG_FILE)
    meta_path = RunPaths(run_dir).meta
    meta = read_json_file(meta_path, "run_meta.json") if meta_path.exists() else {}
    world = meta.get("world_size", 1) if isinstance(meta, dict) else 1
    if not isinstance(world, int) or not 1 <= world <= 1 << 20:
        raise UserError(f"{meta_path} holds world_size {world!r}, not a rank count", "fix or remove run_meta.json's world_size")
    records = _read_metrics(run_dir, s)
    m: dict = {}
    for k in sorted(records):
        m.update(records[k])
    rebuilt, guessed = [], []
    writes: dict[str, str] = {}  # file name -> text: written together once nothing can refuse any more

    ts_ok = _json_ok(d / store.TRAIN_STATE)
    if not ts_ok:
        tokens = budget.tokens_after(cfg, s)
        skipped = int(m.get("skipped", 0))
        ts = {"step": s, "applied_steps": s - skipped, "tokens_seen": tokens, "skipped_steps": skipped,
              "rng": {"seed": cfg.train.seed, "note": "reseeded deterministically from the run seed"},
              "world_size": world, "recovered": True}
        scaler = _replay_loss_scale(cfg, records, s)
        if scaler is not None:
            ts["loss_scale"] = scaler.state()
            rebuilt.append(f"loss scale {scaler.scale:g} (replayed over the {s} steps of metrics.jsonl)")
        elif m.get("loss_scale") is not None:
            ts["loss_scale"] = {"scale": float(m["loss_scale"]), "good_steps": 0, "warming": False}
            guessed.append(f"loss scale {m['loss_scale']:g}: the last logged value; its growth counter restarts")
        else:
            guessed.append("loss scale: not in metrics.jsonl, the config's initial scale will be used")
        writes[store.TRAIN_STATE] = json.dumps(ts, indent=1, sort_keys=True)
        rebuilt.append(f"{store.TRAIN_STATE}: step {s}, {tokens:,} tokens seen, {skipped} skipped steps")
        guessed.append("spike detector window: restarts empty")

    if not _json_ok(d / store.DATA_STATE):
        data_dir = meta.get("data_dir")
        if not data_dir or not Path(data_dir).is_dir():
            raise UserError(f"cannot rebuild data_state.json: the run's data dir {data_dir!r} is not available",
                            "restore the data dir (run_meta.json names it) and run recover again")
        sources = resolve_sources(data_dir, cfg.data.sources)
        # the loader's world is the data-parallel ranks (train/build.py: dp_size = world / tp)
        dp = max(1, world // cfg.parallel.tp)
        mb, _ = budget.micro_batches(cfg, dp)
        loader = Loader(sources, split="train", seq_len=cfg.data.seq_len, batch_size=mb, seed=cfg.train.seed,
                        rank=0, world=dp, reset_attention_at_eos=cfg.data.reset_attention_at_eos,
                        token_dtype=cfg.data.token_dtype, log=lambda x: None)
        total = s * cfg.train.global_batch
        consumed = tuple(int(c) for c in consumed_after(normalise([w for _, w in sources]), total))
        writes[store.DATA_STATE] = json.dumps(loader.state_at(consumed), indent=1, sort_keys=True)
        rebuilt.append(f"{store.DATA_STATE}: {total:,} samples consumed (step {s} x global batch {cfg.train.global_batch})")

    manifest = _read_manifest(d)
    for name, text in writes.items():
        atomic_write(d / name, text)
    _rewrite_manifest(d, manifest)
    if not rebuilt:
        rebuilt.append("manifest.json (the state files were readable; their hashes were refreshed)")
    return report + [f"recovered {d.name}:"] + [f"  rebuilt {r}" for r in rebuilt] + [f"  note: {g}" for g in guessed] + [
        f"{d.name} verifies again; `mspretrain train` on {run_dir} resumes from it"]


def _json_ok(path: Path) -> bool:
    try:
        return isinstance(read_json_file(path, path.name), dict)
    except UserError:
        return False


def _read_manifest(d: Path) -> dict:
    """The checkpoint's manifest, read before anything is written (a bad one refuses the recovery)."""
    manifest = read_json_file(d / store.MANIFEST, "the checkpoint's manifest", "the checkpoint's manifest is damaged: recover another --step")
    if not isinstance(manifest, dict):
        raise UserError(f"{d / store.MANIFEST} is not a JSON object", "recover another --step")
    return manifest


def _rewrite_manifest(d: Path, manifest: dict) -> None:
    mpath = d / store.MANIFEST
    files = {}
    for p in sorted(d.iterdir()):
        if p.name != store.MANIFEST and p.is_file():
            files[p.name] = {"sha256": store._sha256(p), "bytes": p.stat().st_size}
    manifest["files"] = files
    manifest["recovered"] = True
    atomic_write(mpath, json.dumps(manifest, indent=1, sort_keys=True))
