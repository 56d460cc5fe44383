"""Weights to start a new run from (`train --init-from PATH`, issue 20 item 1): the model layer's
part — what an init source is, how an HF model folder becomes one, and whether the training
config's own model keys agree with it.

Reading an mspretrain checkpoint (a run dir or a step dir, verified against its manifest) needs
checkpoint/ (layer 3), so that part and the choice between the two kinds of PATH live in
checkpoint/init_source.py; this module imports nothing above the model layer.

An HF folder is converted in memory with model/hf.py's own functions, the ones
`convert --from-hf` uses, so initialising from the folder and from its converted checkpoint give
the same tensors bit for bit (tests/model/test_init_from.py).
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

from mspretrain.config.schema import ModelConfig
from mspretrain.errors import UserError
from mspretrain.fsutil import sha256_file

# Keys that describe no weight and no computation of the init model: how a *fresh* model would be
# initialised, and how ffn_dim would be derived when it is 0 (the init model's ffn_dim is known).
NOT_ARCHITECTURE = frozenset({"init_std", "multiple_of"})


@dataclass(frozen=True)
class InitWeights:
    """The model config, the tensors (our names, fp32) and where they came from."""

    path: Path  # what the user passed
    kind: str  # "checkpoint" | "hf"
    source_dir: Path  # the checkpoint dir or HF folder actually read
    config: ModelConfig  # resolved
    tensors: dict[str, np.ndarray]
    files: dict[str, str]  # weight file name -> SHA-256 (provenance for run_meta.json and the report)
    tokenizer_path: Path | None  # the init model's tokenizer, when the source has one

    def provenance(self) -> dict[str, Any]:
        """{"path", "kind", "dir", "files": {name: sha256}} for run_meta.json's "init_from"."""
        return {"path": str(self.path), "kind": self.kind, "dir": str(self.source_dir), "files": dict(self.files)}


def from_hf_dir(path: str | Path) -> InitWeights:
    """An HF model folder of a family in mspretrain/families.py (config.json + *.safetensors): converted in memory, as `convert --from-hf` does."""
    from mspretrain.model.hf import read_hf_dir, weight_files

    d = Path(path)
    model_cfg, tensors, tok = read_hf_dir(d)  # every malformed input is one UserError there
    files = {f.name: sha256_file(f) for f in weight_files(d)}
    return InitWeights(path=d, kind="hf", source_dir=d, config=model_cfg, tensors=tensors, files=files, tokenizer_path=tok)


def set_model_keys(own: ModelConfig) -> dict[str, Any]:
    """The model keys the training config sets: those away from their default (0 = automatic
    included). A key left at its default is taken from the init model, not compared."""
    default = ModelConfig()
    return {f.name: getattr(own, f.name) for f in fields(ModelConfig)
            if f.name not in NOT_ARCHITECTURE and getattr(own, f.name) != getattr(default, f.name)}


def run_model_config(own: ModelConfig, init: ModelConfig, data_vocab: int,
                     explicit: set[str] | None = None, source: str = "the init weights") -> ModelConfig:
    """The model config of a run initialised from `init`: the init model's architecture, with the
    data dir's vocabulary (larger: the embedding grows, see model/resize.py; smaller: refused).

    `own`'s keys (those `explicit` names, else those away from their defaults) must agree with
    `init`: the first disagreement is refused in one line naming the key and both values
    (`source` says what `init` is in that line). Its
    vocab_size is the data dir's business (the trainer checks it against the data dir)."""
    keys = set_model_keys(own) if explicit is None else {k: getattr(own, k) for k in explicit if k not in NOT_ARCHITECTURE}
    for key in sorted(keys):
        if key == "vocab_size":
            continue
        mine, theirs = getattr(own, key), getattr(init, key)
        if mine != theirs:
            raise UserError(f"model.{key} = {mine!r} in the training config, but {source} has {theirs!r}",
                            f"drop model.{key} from the config (it comes from {source}), or set model.{key}={theirs!r}")
    if data_vocab < init.vocab_size:
        raise UserError(f"the data dir's tokenizer has {data_vocab} pieces, fewer than the init model's {init.vocab_size}: "
                        "shrinking the vocabulary is refused",
                        "prepare the data with the init model's tokenizer or an extension of it (mspretrain tokenizer extend)")
    return replace(init, vocab_size=data_vocab)
