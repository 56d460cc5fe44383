"""The names of the files in a run dir and a data dir, written once (layer 0: imports nothing above it).

The names are a contract with scripts and checks outside the project (docs/design.md "Files"):
add new ones, never rename these.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


def step_dir_name(step: int) -> str:
    """`step_NNNNNN`, the checkpoint directory of a step (same as checkpoint/store.step_dir_name)."""
    return f"step_{step:06d}"


@dataclass(frozen=True)
class RunPaths:
    """The files `mspretrain train --run ROOT` writes."""

    root: Path

    def __init__(self, root: str | Path) -> None:
        object.__setattr__(self, "root", Path(root))

    @property
    def config(self) -> Path:
        return self.root / "config.toml"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def tb(self) -> Path:
        return self.root / "tb"

    @property
    def log(self) -> Path:
        return self.root / "train.log"

    @property
    def meta(self) -> Path:
        return self.root / "run_meta.json"

    @property
    def tokenizer_model(self) -> Path:
        return self.root / "tokenizer.model"  # the data dir's tokenizer, copied so that the run stands alone

    @property
    def tokenizer_json(self) -> Path:
        return self.root / "tokenizer.json"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def lock(self) -> Path:
        return self.root / ".mspretrain.lock"

    def step_dir(self, step: int) -> Path:
        return self.checkpoints / step_dir_name(step)


SPLITS = ("train", "valid")


@dataclass(frozen=True)
class DataPaths:
    """The files `mspretrain prepare --out ROOT` writes."""

    root: Path

    def __init__(self, root: str | Path) -> None:
        object.__setattr__(self, "root", Path(root))

    @property
    def manifest(self) -> Path:
        return self.root / "manifest.json"

    @property
    def tokenizer_model(self) -> Path:
        return self.root / "tokenizer.model"

    @property
    def tokenizer_json(self) -> Path:
        return self.root / "tokenizer.json"

    @property
    def tokenizer(self) -> Path | None:
        """The data dir's tokenizer (SentencePiece first, as prepare writes one or the other), or None."""
        return next((p for p in (self.tokenizer_model, self.tokenizer_json) if p.is_file()), None)

    def prefix(self, split: str) -> Path:
        """`ROOT/split`, the prefix the indexed-dataset reader and writer take."""
        return self.root / split

    def bin(self, split: str) -> Path:
        return self.root / f"{split}.bin"

    def idx(self, split: str) -> Path:
        return self.root / f"{split}.idx"

    def files(self) -> list[Path]:
        """Every file `prepare` may write here (it writes one of the two tokenizer files)."""
        return [self.manifest, self.tokenizer_model, self.tokenizer_json,
                *(f(split) for split in SPLITS for f in (self.bin, self.idx))]
