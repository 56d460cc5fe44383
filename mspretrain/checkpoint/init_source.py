"""`train --init-from PATH`: find the weights, check them against the run, grow the vocabulary.

PATH is one of
- an mspretrain checkpoint: a step dir, a run dir (its newest checkpoint that verifies), or what
  `convert --from-hf` writes; it must verify against its manifest (checkpoint/store.py);
- an HF model folder (config.json + *.safetensors), converted in memory (model/init_from.py).
A folder with a manifest.json is a checkpoint; one without it that holds a config.json or weight
files is an HF folder (and is refused in one line if one of the two is missing or bad).
Only the weights are taken: optimizer state, schedule and loss scale start fresh.

When the data dir's tokenizer extends the init model's (model/resize.py), the new embedding and
lm_head rows are initialised from the base tokenizer's split of each new piece; this module is
where the tokenizers are read (data/, layer 2), so the model layer needs none.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from mspretrain.checkpoint import store
from mspretrain.checkpoint.model import resolved_config
from mspretrain.checkpoint.model_shards import model_files
from mspretrain.config.schema import Config, ModelConfig
from mspretrain.errors import UserError
from mspretrain.fsutil import read_json_file
from mspretrain.model.init_from import InitWeights, from_hf_dir, run_model_config
from mspretrain.model.resize import check_extends, resize_vocab
from mspretrain.paths import DataPaths, RunPaths


def load_init(path: str | Path, log: Callable[[str], None] = lambda s: None) -> InitWeights:
    """The weights, config and provenance of PATH; one-line UserError when it is missing or bad."""
    p = Path(path)
    if not p.exists():
        raise UserError(f"--init-from {p} does not exist", "pass a checkpoint (run dir, step dir, `convert --from-hf` output) or an HF model folder")
    if not p.is_dir():
        raise UserError(f"--init-from {p} is a file, not a directory",
                        "pass the folder holding the weights (config.json + *.safetensors, or a checkpoint)")
    looks_hf = (p / "config.json").is_file() or any(p.glob("*.safetensors")) or any(p.glob("*.bin"))
    if looks_hf and not (p / store.MANIFEST).is_file():
        return from_hf_dir(p)  # names what is missing: config.json, safetensors, a bad file
    ref = store.resolve_checkpoint(p, log=log)  # verifies the manifest (SHA-256 of every file)
    tensors = store.read_model_tensors(ref, mapped=True)  # mapped: each rank reads what its cut keeps
    from mspretrain.model.hf import check_weights

    check_weights(tensors, ref.dir)  # a checkpoint saved after a NaN step verifies, but cannot train
    model_cfg = resolved_config(ref, tensors).model  # the shape load_model and export give these weights
    manifest = read_json_file(ref.dir / store.MANIFEST, "checkpoint manifest")
    # verified just now; the weights are one file, or one per rank of a ZeRO-3 run
    files = {name: manifest["files"][name]["sha256"] for name in model_files(manifest["files"])}
    return InitWeights(path=p, kind="checkpoint", source_dir=ref.dir, config=model_cfg, tensors=tensors, files=files,
                       tokenizer_path=ref.tokenizer_path)


def pieces(tok: Any) -> list[str]:
    """Every piece of a data/tokenizer.py Tokenizer, by id."""
    if tok._sp is not None:
        return [tok._sp.IdToPiece(i) for i in range(tok.vocab_size)]
    return [tok._hf.id_to_token(i) for i in range(tok.vocab_size)]


def base_splits(base_tok: Any, new_tok: Any, start: int) -> list[list[int]]:
    """For each new piece (ids start..): the base tokenizer's ids for the piece's text. The text is
    the new tokenizer's decode of that one id (SentencePiece's '▁' becomes a space there)."""
    return [list(base_tok.encode(new_tok.decode([i]))) for i in range(start, new_tok.vocab_size)]


@dataclass(frozen=True)
class InitPlan:
    """What the trainer needs: the run's model config, the tensors to load before step 0, and the
    record for run_meta.json ({"path", "kind", "dir", "files", "resized"})."""

    model: ModelConfig
    tensors: dict[str, np.ndarray]
    meta: dict[str, Any]


def plan_init(init: InitWeights, own: ModelConfig, data_tokenizer: Path, explicit: set[str] | None = None) -> InitPlan:
    """Check `init` against the training config's model keys and the data dir's tokenizer, and
    grow its vocabulary to the data dir's when that tokenizer extends the init model's."""
    from mspretrain.data.tokenizer import Tokenizer

    data_tok = Tokenizer.load(data_tokenizer)
    base_vocab = init.config.vocab_size
    data_vocab = data_tok.vocab_size
    if init.tokenizer_path is not None and data_vocab == Tokenizer.load(init.tokenizer_path).vocab_size < base_vocab:
        data_vocab = base_vocab  # the init model's own tokenizer on a padded embedding (Qwen's): keep every row
    model = run_model_config(own, init.config, data_vocab, explicit)
    resized: dict[str, Any] | None = None
    tensors = init.tensors
    if init.tokenizer_path is not None:
        base_tok = Tokenizer.load(init.tokenizer_path)
        check_extends(pieces(base_tok), pieces(data_tok))
        if data_tok.vocab_size > base_vocab:
            unusable = {i for i in base_tok.special_ids().values() if i >= 0}
            tensors, resized = resize_vocab(init.tensors, data_tok.vocab_size, base_splits(base_tok, data_tok, base_vocab), unusable)
    elif data_tok.vocab_size > base_vocab:
        raise UserError(f"the init weights at {init.path} come without a tokenizer, so the {data_tok.vocab_size - base_vocab} new pieces "
                        "of the data dir's tokenizer cannot be initialised from their base-tokenizer split",
                        "put the init model's tokenizer.model (or tokenizer.json) next to its weights")
    else:  # refused, not warned: another tokenizer of the same size trains every embedding row on the wrong piece
        raise UserError(f"the init weights at {init.path} come without a tokenizer, so nothing shows that the data dir's "
                        f"tokenizer ({data_tokenizer}, {data_tok.vocab_size} pieces) is the one they were trained with "
                        "(a different tokenizer of the same size would silently train each embedding on another piece)",
                        "put the init model's tokenizer.model (or tokenizer.json) next to its weights")
    meta = dict(init.provenance(), resized=resized)
    return InitPlan(model=model, tensors=tensors, meta=meta)


def _upcycled(init: InitWeights, cfg: Config, tok: Path, explicit: set[str] | None,
              log: Callable[[str], None]) -> tuple[Config, Callable[[Any], None], dict[str, Any]]:
    """`train --init-from DENSE --upcycle`: the dense checkpoint is checked against the config's model
    seen as dense (its MoE keys aside), then becomes the MoE model: experts copied from each dense
    MLP, routers the run's seeded ones (model/upcycle.py)."""
    from mspretrain.model.upcycle import MOE_KEYS, as_dense, check_upcycle, fresh_names, upcycle, with_experts

    plan = plan_init(init, as_dense(cfg.model), tok, None if explicit is None else explicit - set(MOE_KEYS) - {"family"})
    moe = with_experts(plan.model, cfg.model)
    check_upcycle(plan.model, moe)
    box = {"tensors": plan.tensors}

    def init_weights(model: Any) -> None:
        from mspretrain.model.decoder import load_numpy, state_numpy

        fresh = set(fresh_names(moe))
        routers = {k: v.copy() for k, v in state_numpy(model).items() if k in fresh}
        load_numpy(model, upcycle(box.pop("tensors"), plan.model, moe, routers))

    log(f"upcycling {init.kind} {init.source_dir} into {moe.num_experts} experts, {moe.experts_per_token} per token "
        f"(experts copied from the dense MLPs, routers from the run seed)")
    return replace(cfg, model=moe), init_weights, dict(plan.meta, upcycled={"num_experts": moe.num_experts,
                                                                             "experts_per_token": moe.experts_per_token})


def explicit_model_keys(config_path: str | Path | None, overrides: Sequence[str] = (), preset: bool = False) -> set[str]:
    """The model keys the user wrote: the config file's [model] table and `model.*` overrides (every
    key with --model PRESET). Only these are compared with the init weights; the rest come from them."""
    from mspretrain.config import schema as cfgmod

    if preset:
        return {f.name for f in fields(ModelConfig)}
    keys: set[str] = set()
    if config_path is not None:  # already parsed once by config.load: valid TOML
        raw = cfgmod.tomllib.loads(Path(config_path).read_text(encoding="utf-8"))
        if isinstance(raw.get("model"), dict):
            keys |= set(raw["model"])
    for text in overrides:
        section, name, _ = cfgmod.parse_override(text)
        if section == "model":
            keys.add(name)
    return keys


def init_for_run(path: str | Path | None, cfg: Config, data_dir: str | Path, run_dir: str | Path, *,
                 explicit: set[str] | None = None, allow_config_change: bool = False,
                 log: Callable[[str], None] = print, upcycle: bool = False,
                 ) -> tuple[Config, Callable[[Any], None] | None, dict[str, Any] | None]:
    """What `train [--init-from PATH]` settles before the trainer is built: (the config to train
    with, the `init_weights(model)` hook that loads the weights before step 0, the record for
    run_meta.json's "init_from").

    - A new run dir with PATH: the model config from the init weights, hook and record.
    - A run dir that already has checkpoints resumes: PATH on it is refused unless
      `allow_config_change` (then it is not used). A run that began from init weights resumes with
      its saved model config (the config file need not repeat the init model's keys; those it
      writes must agree) and keeps its record; no hook.
    - Neither: `cfg` unchanged, (cfg, None, None)."""
    from mspretrain.config import schema as cfgmod

    run_dir, data_dir = Path(run_dir), Path(data_dir)
    existing = store.list_checkpoints(run_dir)
    if existing:
        if path is not None and not allow_config_change:
            raise UserError(f"--init-from on {run_dir}, which already has checkpoints (newest {existing[-1][1].name}): that run dir resumes",
                            "give the new run its own --run dir, or pass --allow-config-change to resume this run "
                            "(the --init-from weights are then not used)")
        meta_path = RunPaths(run_dir).meta
        try:
            record = read_json_file(meta_path, "run_meta.json").get("init_from") if meta_path.exists() else None
        except (UserError, AttributeError):
            record = None
        if path is None and not isinstance(record, dict):
            return cfg, None, None  # an ordinary run: the trainer resumes it as it always has
        saved = RunPaths(run_dir).config
        model = cfgmod.load(saved if saved.is_file() else existing[-1][1] / "config.toml").model
        model = run_model_config(cfg.model, model, model.vocab_size, explicit, source=f"the run in {run_dir}")
        if path is not None:
            log(f"--init-from {path}: {run_dir} has checkpoints, so it resumes (with --allow-config-change); the init weights are not used")
        return replace(cfg, model=model), None, record if isinstance(record, dict) else None
    if path is None:
        return cfg, None, None
    tok = DataPaths(data_dir).tokenizer
    if tok is None:
        raise UserError(f"data dir {data_dir} has no tokenizer.model or tokenizer.json", "pass the output of `mspretrain prepare` as --data")
    init = load_init(path, log=log)
    if upcycle:  # a dense checkpoint into the config's MoE model (model/upcycle.py)
        return _upcycled(init, cfg, tok, explicit, log)
    plan = plan_init(init, cfg.model, tok, explicit)
    box = {"tensors": plan.tensors}

    def init_weights(model: Any) -> None:
        from mspretrain.model.decoder import load_numpy
        from mspretrain.model.lazy import load_when_read, undrawn

        tensors = box.pop("tensors")  # pop: the host copy (or mapping) is freed once the model holds it
        if undrawn(model):  # built for a cut on an NPU: each weight read when the cut reads it
            load_when_read(model, tensors)
        else:
            load_numpy(model, tensors)

    resized = plan.meta["resized"]
    log(f"initialising from {init.kind} {init.source_dir}: {len(plan.tensors)} tensors, vocab {init.config.vocab_size}"
        + (f" -> {resized['vocab']} ({resized['split_mean']} new rows from base splits, {resized['overall_mean']} from the overall mean)"
           if resized else ""))
    return replace(cfg, model=plan.model), init_weights, plan.meta
