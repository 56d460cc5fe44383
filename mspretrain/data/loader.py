"""Deterministic, exactly resumable, rank-sharded loader over packed token windows, with mixing.

Design choices:
- A sample is a window of `seq_len + 1` tokens over the concatenated documents of a split;
  window i starts at token i * seq_len, so consecutive windows share one token (inputs =
  tokens[:, :-1], targets = tokens[:, 1:]) and no token is padding. The last partial window is
  dropped. Windows are a strided view of the memory-mapped `.bin`: a batch is one vectorised
  row gather, no Python list per batch. `seq_len` is a run-time choice, not baked into the data.
- Order: see `mixing.py`. The global order is a pure function of (seed, epoch, index) and of the
  per-source consumed counts, which are the whole state.
- Data parallel: global sample positions are cut into world micro-batches of `batch_size * world`
  (`world_micro_batch`: one micro-batch of every rank; an optimizer step takes `accumulation` of
  them, `budget.py`); rank r takes positions r, r + w, r + 2w, ... of each (strided, not
  contiguous blocks), so ranks never overlap or skip, and rank r's batch is row r::w of it.
- State is world-independent (global consumed counts; every rank holds the same state, rank 0
  saves it). Resuming on a different number of ranks is allowed: the global order continues at
  the same global sample, only the cut into per-rank batches changes (logged as a note).
- `reset_attention_at_eos` derives document boundaries from the index (`lengths`; every
  document ends with EOS), so positions restart at 0 after each EOS and at the window start.
- Input pipeline: none. The trainer calls `next_batch` between steps: a batch is one gather of
  microseconds against a step of seconds. A `mindspore.dataset.GeneratorDataset` over the same
  source measured 2-3x slower than even a background thread (per-item pipeline overhead;
  docs/benchmarks/loader.md), so it is not used.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from mspretrain.data.manifest import check_data_dir, read_manifest
from mspretrain.data.mixing import epoch_permutation, mix_schedule, normalise, ordinals
from mspretrain.data.shards import IndexedDataset
from mspretrain.errors import UserError

# check_data_dir is re-exported until train/trainer.py, commands/demo.py and tests/eval/test_eval.py
# import it and read_manifest from data.manifest (their owners switch)
__all__ = ["Batch", "Loader", "check_data_dir", "read_manifest", "resolve_sources"]

STATE_VERSION = 1
TOKEN_DTYPES = {"int32": np.int32, "int64": np.int64}


@dataclass
class Batch:
    tokens: np.ndarray  # (B, seq_len + 1) token_dtype; inputs = tokens[:, :-1], targets = tokens[:, 1:]
    positions: np.ndarray | None = None  # (B, seq_len) int32, only with reset_attention_at_eos
    segments: np.ndarray | None = None  # (B, seq_len) int32, only with reset_attention_at_eos


def resolve_sources(data_dir: str | Path | None, sources: tuple | list = ()) -> list[tuple[Path, float]]:
    """The weighted data dirs of `data.sources` ({path, weight}), which must include the `--data` dir
    (it supplies the tokenizer and manifest); with no `data.sources`, the `--data` dir alone."""
    out = []
    for i, s in enumerate(sources):
        if not isinstance(s, dict) or "path" not in s or set(s) - {"path", "weight"}:
            raise UserError(f"data.sources[{i}] = {s!r} is not {{path, weight}}",
                            'write data.sources = [{path = "dir", weight = 0.7}, ...]')
        out.append((Path(s["path"]), float(s.get("weight", 1.0))))
    if not out:
        if data_dir is None:
            raise UserError("no data given", "pass --data DATA_DIR or set data.sources = [{path = ..., weight = ...}]")
        return [(Path(data_dir), 1.0)]
    if data_dir is not None and Path(data_dir).resolve() not in {p.resolve() for p, _ in out}:
        raise UserError(f"data.sources does not list the --data dir {data_dir}",
                        f'add it with its weight, e.g. {{path = "{data_dir}", weight = 0.5}}')
    return out


class _Source:
    """One data dir's split as an (n, seq_len + 1) strided window view plus its epoch orders."""

    def __init__(self, index: int, path: Path, weight: float, split: str, seq_len: int, seed: int,
                 need_docs: bool) -> None:
        self.index, self.path, self.weight, self.seed = index, path, weight, seed
        manifest = read_manifest(path)
        self.fingerprint = manifest["fingerprint"]
        data = IndexedDataset(path / split)
        expected = manifest["tokens"].get(split)
        if expected is not None and int(expected) != data.n_tokens:
            raise UserError(f"{path}/manifest.json says split '{split}' has {expected} tokens but its shards hold "
                            f"{data.n_tokens}", f"re-run `mspretrain prepare ... --out {path}`")
        self.n = (data.n_tokens - 1) // seq_len if data.n_tokens > 0 else 0
        if self.n < 1:
            raise UserError(f"split '{split}' of {path} has {data.n_tokens} tokens, but one sample needs "
                            f"seq_len + 1 = {seq_len + 1}", "lower data.seq_len or prepare more text")
        flat = data.tokens.view(np.ndarray)  # plain ndarray view: memmap subclass overhead per gather
        isz = flat.itemsize
        self.windows = np.lib.stride_tricks.as_strided(flat, shape=(self.n, seq_len + 1),
                                                       strides=(seq_len * isz, isz), writeable=False)
        if need_docs:  # O(documents) int64, only with reset_attention_at_eos
            self.doc_ends = np.cumsum(data.lengths, dtype=np.int64)
        self._perms: dict[int, np.ndarray] = {}

    def perm(self, epoch: int) -> np.ndarray:
        p = self._perms.get(epoch)
        if p is None:
            if len(self._perms) >= 2:  # keep the current and the next epoch only: O(n) memory
                self._perms.pop(min(self._perms))
            p = self._perms[epoch] = epoch_permutation(self.seed, epoch, self.index, self.n)
        return p

    def window_ids(self, ords: np.ndarray) -> np.ndarray:
        """Window index of each global ordinal (ascending) of this source."""
        e0, e1 = int(ords[0]) // self.n, int(ords[-1]) // self.n
        if e0 == e1:
            return self.perm(e0)[ords - e0 * self.n]
        out = np.empty(ords.size, dtype=np.int64)
        epochs = ords // self.n
        for e in range(e0, e1 + 1):  # a batch spans few epochs (several only for tiny sources)
            m = epochs == e
            out[m] = self.perm(e)[ords[m] - e * self.n]
        return out

    def strided_ids(self, first: int, step: int, count: int) -> np.ndarray:
        """Window indices of ordinals first, first + step, ...: a slice of the epoch order when
        they share an epoch (the per-batch hot path: no index arithmetic on arrays)."""
        e0, last = first // self.n, first + step * (count - 1)
        if last // self.n == e0:
            lo = first - e0 * self.n
            return self.perm(e0)[lo : last - e0 * self.n + 1 : step]
        return self.window_ids(first + step * np.arange(count, dtype=np.int64))


class Loader:
    """Per-rank micro-batches of packed windows; see the module docstring for the contract."""

    def __init__(self, sources: list[tuple[str | Path, float]], *, split: str, seq_len: int, batch_size: int,
                 seed: int, rank: int = 0, world: int = 1, reset_attention_at_eos: bool = False,
                 token_dtype: str = "int32", log: Callable[[str], None] = print) -> None:
        if not sources:
            raise UserError("no data sources given", "pass --data DATA_DIR or set data.sources")
        if batch_size <= 0:
            raise UserError(f"batch size must be ≥ 1, got {batch_size}", "set train.micro_batch / train.global_batch ≥ 1")
        if seq_len <= 0:
            raise UserError(f"data.seq_len must be ≥ 1, got {seq_len}", "set data.seq_len to e.g. 2048")
        if world <= 0 or not 0 <= rank < world:
            raise UserError(f"rank {rank} is not in a world of {world} ranks", "launch with msrun or set rank < world")
        if seed < 0:
            raise UserError(f"seed must be ≥ 0, got {seed}", "set train.seed to a non-negative integer")
        if token_dtype not in TOKEN_DTYPES:
            raise UserError(f"data.token_dtype = {token_dtype!r} is not one of {sorted(TOKEN_DTYPES)}",
                            "use int32 (default) or int64 (the Ascend gather workaround)")
        paths = [Path(p) for p, _ in sources]
        if len({p.resolve() for p in paths}) != len(paths):
            raise UserError("the same data dir is listed twice in the sources", "list each dir once and set its weight")
        weights = []
        for p, w in sources:
            try:
                weights.append(float(w))
            except (TypeError, ValueError):
                weights.append(math.nan)
            if not (math.isfinite(weights[-1]) and weights[-1] > 0):
                raise UserError(f"weight of source {p} is {w!r}; weights must be finite and > 0",
                                "give every data.sources entry a positive weight (or drop it)")
        self.split, self.seq_len, self.batch_size, self.seed = split, seq_len, batch_size, seed
        self.rank, self.world, self.log = rank, world, log
        self.reset_attention_at_eos = reset_attention_at_eos
        self.token_dtype = np.dtype(TOKEN_DTYPES[token_dtype])
        self._sources = [_Source(i, p, w, split, seq_len, seed, reset_attention_at_eos)
                         for i, (p, w) in enumerate(zip(paths, weights))]
        self._probs = normalise([s.weight for s in self._sources])
        self._consumed = [0] * len(self._sources)  # global samples taken per source, all ranks together
        self._t = np.arange(seq_len, dtype=np.int32)
        self.samples_per_epoch: dict[str, int] = {str(s.path): s.n for s in self._sources}

    @property
    def world_micro_batch(self) -> int:
        """Samples one `next_batch` takes over all ranks: one micro-batch of every rank. Not
        train.global_batch, the samples of one optimizer step (that many x the accumulation)."""
        return self.batch_size * self.world

    def next_batch(self) -> Batch:
        c = self._consumed
        if len(self._sources) == 1:  # hot path: no schedule, ordinals c + rank + world * i
            src = self._sources[0]
            ids = src.strided_ids(c[0] + self.rank, self.world, self.batch_size)
            c[0] += self.world_micro_batch
            tokens = src.windows[ids].astype(self.token_dtype, copy=False)  # (B, seq_len + 1)
            parts = [(src, slice(None), ids)]
        else:
            counts = np.asarray(c, dtype=np.int64)
            sched = mix_schedule(counts, self._probs, self.world_micro_batch)  # (B * world,) source per position
            ords_all = ordinals(sched, counts)
            src_of, ords = sched[self.rank :: self.world], ords_all[self.rank :: self.world]
            c[:] = (counts + np.bincount(sched, minlength=counts.size)).tolist()
            tokens = np.empty((self.batch_size, self.seq_len + 1), dtype=self.token_dtype)
            parts = []
            for j in np.unique(src_of):
                rows = np.flatnonzero(src_of == j)
                src = self._sources[j]
                ids = src.window_ids(ords[rows])
                tokens[rows] = src.windows[ids]
                parts.append((src, rows, ids))
        if not self.reset_attention_at_eos:
            return Batch(tokens)
        positions = np.empty((self.batch_size, self.seq_len), dtype=np.int32)
        segments = np.empty((self.batch_size, self.seq_len), dtype=np.int32)
        for src, rows, ids in parts:
            positions[rows], segments[rows] = self._doc_layout(src, ids)
        return Batch(tokens, positions, segments)

    def _doc_layout(self, src: _Source, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(positions, segments) of the inputs of windows `ids`, from the index's document ends.

        Only the few documents starting inside each window are looked up (2 binary searches per
        window), then a (b, seq_len) start mask is cumulated: O(b * seq_len), no per-token search.
        """
        start = ids.astype(np.int64) * self.seq_len  # (b,) first token of each window
        lo = np.searchsorted(src.doc_ends, start, side="right")  # document holding the first input
        hi = np.searchsorted(src.doc_ends, start + self.seq_len - 1, side="right")  # ... the last input
        n_new = hi - lo  # documents starting inside each window, after its first token
        row = np.repeat(np.arange(ids.size), n_new)  # (k,) ragged: window of each document start
        doc = np.arange(row.size) + np.repeat(lo - (np.cumsum(n_new) - n_new), n_new)  # lo..hi-1 per window
        off = (src.doc_ends[doc] - start[row]).astype(np.int32)  # (k,) offset of each start in its window
        prev = np.zeros_like(off)  # offset of the previous start in the same window (0: window start)
        prev[1:] = off[:-1]
        prev[1:][row[1:] != row[:-1]] = 0
        new_doc = np.zeros((2, ids.size, self.seq_len), dtype=np.int32)  # (2, b, seq_len) start marks, jumps
        new_doc[0, row, off] = 1
        new_doc[1, row, off] = off - prev
        segments, seg_start = np.cumsum(new_doc, axis=2, dtype=np.int32)  # cumsum, not maximum.accumulate: SIMD
        return self._t - seg_start, segments

    # ---- state ---------------------------------------------------------------------------------
    def state(self) -> dict:
        return self.state_at(tuple(self._consumed))

    def state_at(self, consumed: tuple[int, ...]) -> dict:
        """State dict for given per-source consumed counts (used by `prefetch`, which runs ahead)."""
        return {
            "version": STATE_VERSION, "seed": self.seed, "split": self.split, "seq_len": self.seq_len,
            "world": self.world, "batch_size": self.batch_size, "samples": int(sum(consumed)),
            "sources": [{"path": str(s.path), "weight": s.weight, "fingerprint": s.fingerprint,
                         "consumed": int(c), "epoch": int(c) // s.n, "samples_per_epoch": s.n}
                        for s, c in zip(self._sources, consumed)],
        }

    def load_state(self, state: dict, *, allow_data_change: bool = False) -> None:
        """Continue exactly where `state` was taken; a changed data dir is refused unless allowed."""
        fix_ckpt = "resume from a checkpoint written by this version of mspretrain"
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION or not isinstance(state.get("sources"), list):
            raise UserError(f"data state is not a version-{STATE_VERSION} loader state", fix_ckpt)
        saved = state["sources"]
        if len(saved) != len(self._sources):
            raise UserError(f"the checkpoint's data state has {len(saved)} sources, this run has {len(self._sources)}",
                            "use the same data.sources as the checkpointed run")
        if state.get("seed") != self.seed:
            raise UserError(f"the checkpoint's data order used seed {state.get('seed')}, this run uses {self.seed}",
                            f"set train.seed={state.get('seed')} to resume this run")
        if state.get("split") != self.split:
            raise UserError(f"the checkpoint read split '{state.get('split')}', this loader reads '{self.split}'",
                            "resume the train split with the train loader")
        changes = []
        for s, d in zip(self._sources, saved):
            if d.get("fingerprint") != s.fingerprint:
                changes.append(f"data dir {s.path} changed since the checkpoint: fingerprint {d.get('fingerprint')} "
                               f"in the checkpoint, {s.fingerprint} now")
            if d.get("weight") != s.weight:
                changes.append(f"weight of {s.path} changed from {d.get('weight')} to {s.weight}")
        if state.get("seq_len") != self.seq_len:
            changes.append(f"seq_len changed from {state.get('seq_len')} to {self.seq_len} (sample counts are kept)")
        if changes and not allow_data_change:
            raise UserError(changes[0], "use the original data and settings, or pass --allow-data-change to keep "
                                        "the position on the new data")
        for msg in changes:
            self.log(f"warning: {msg}; continuing at the saved position (--allow-data-change)")
        if state.get("world") != self.world:
            self.log(f"note: resuming on {self.world} ranks (checkpoint: {state.get('world')}); the global "
                     f"sample order continues at sample {state.get('samples')}")
        counts = [d.get("consumed") for d in saved]
        if not all(isinstance(c, int) and c >= 0 for c in counts):
            raise UserError(f"data state has invalid consumed counts {counts}", fix_ckpt)
        self._consumed[:] = counts
