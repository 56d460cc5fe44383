"""Which samples a global batch holds, as a pure function of the loader's position.

The loader (`loader.py`) serves each rank its share of a global batch; nothing there says which
samples the *whole* batch held, and no rank sees the others' rows. This module answers it from
integers only: the per-source window counts, the mixing weights, the seed and the per-source
consumed counts before the batch. It uses the same pieces as the loader (`mixing.py`), so the
answer is the loader's own plan, on any world size (the global order does not depend on how it
is cut into ranks).

Used by the trainer's per-step batch record (a hash of the ids, `batch_log.py`), by `audit`,
which recomputes every logged batch from step 1, and by `spike`, which lists a step's samples.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

from mspretrain.data.mixing import epoch_permutation, mix_schedule, normalise, ordinals


@dataclass
class SamplePlan:
    """The global sample order of a run's train split: `windows[j]` samples in source j."""

    windows: tuple[int, ...]
    weights: tuple[float, ...]
    seed: int
    # (source, epoch) -> permutation; the current and next epoch of each source are kept, as in
    # the loader, so a per-step call costs a slice, not an O(windows) shuffle
    _perms: dict[tuple[int, int], np.ndarray] = field(default_factory=dict, repr=False, compare=False)

    def perm(self, source: int, epoch: int) -> np.ndarray:
        key = (source, epoch)
        if key not in self._perms:
            mine = sorted(k for k in self._perms if k[0] == source)
            if len(mine) >= 2:
                self._perms.pop(mine[0])
            self._perms[key] = epoch_permutation(self.seed, epoch, source, self.windows[source])
        return self._perms[key]

    def batch(self, consumed: list[int] | tuple[int, ...], count: int) -> np.ndarray:
        """(count, 2) int64: (source index, window index) of the next `count` global samples from
        the per-source `consumed` counts, in global order (position p goes to rank p % world)."""
        counts = np.asarray(consumed, dtype=np.int64)
        if len(self.windows) == 1:
            src = np.zeros(count, dtype=np.int64)
            ords = counts[0] + np.arange(count, dtype=np.int64)
        else:
            src = mix_schedule(counts, normalise(list(self.weights)), count)
            ords = ordinals(src, counts)
        out = np.empty((count, 2), dtype=np.int64)
        out[:, 0] = src
        for j in np.unique(src):
            rows = np.flatnonzero(src == j)
            n = self.windows[j]
            epochs = ords[rows] // n
            for e in np.unique(epochs):  # a batch spans one epoch, two at a boundary
                m = rows[epochs == e]
                out[m, 1] = self.perm(int(j), int(e))[ords[m] - e * n]
        return out

    def advance(self, consumed: list[int] | tuple[int, ...], count: int) -> list[int]:
        """Per-source consumed counts after the next `count` global samples."""
        ids = self.batch(consumed, count)
        return [int(c) + int(np.sum(ids[:, 0] == j)) for j, c in enumerate(consumed)]


def batch_hash(ids: np.ndarray) -> str:
    """16 hex digits identifying a global batch's samples (order included)."""
    return hashlib.sha256(np.ascontiguousarray(ids, dtype="<i8").tobytes()).hexdigest()[:16]
