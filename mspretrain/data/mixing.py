"""Sample order as a pure function of integers: per-epoch permutations and the mixing schedule.

Design choices:
- The order of one source in epoch e is `PCG64([seed, epoch, source_index])`'s permutation of
  its windows. Nothing else is random, so the whole position of a run is "how many samples of
  each source were consumed": the state to resume is a handful of integers. The trade-off is
  O(windows) memory per cached epoch (int32 when it fits: 4 bytes per window, ~120 MB for a
  30 M-window corpus), in exchange for a true uniform shuffle instead of a block shuffle.
- Mixing is stride scheduling: the k-th sample of source j is due at time (k + 0.5) / p_j,
  where p_j is its normalised weight, and the global order is all sources' due times merged
  (ties go to the lower source index). Taking the next n events from any consumed-count state
  is a vectorised sort of n candidates per source, and the merged order is one fixed sequence,
  so cutting it into batches of any size (any world size) yields the same samples. After g
  samples every source has p_j * g ± 1 of them, far inside the 1 % the issue asks for, and a
  changed weight (under --allow-data-change) self-corrects from the saved counts.
"""
from __future__ import annotations

import numpy as np


def epoch_permutation(seed: int, epoch: int, source_index: int, n: int) -> np.ndarray:
    """The order of the `n` windows of one source in one epoch (identical on every rank)."""
    perm = np.random.Generator(np.random.PCG64([seed, epoch, source_index])).permutation(n)
    # Halve the resident size for every corpus below 2**31 windows (all realistic ones).
    return perm.astype(np.int32) if n < 2**31 else perm


def normalise(weights: list[float]) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    return w / w.sum()


def mix_schedule(consumed: np.ndarray, probs: np.ndarray, count: int) -> np.ndarray:
    """Source index of each of the next `count` global samples, given per-source consumed counts.

    A pure function of (consumed, probs, count): the same counts give the same continuation.
    """
    k = consumed[:, None] + np.arange(count, dtype=np.int64)[None, :]  # (J, count) next ordinals
    due = ((k + 0.5) / probs[:, None]).ravel()  # (J * count,) due times, source-major
    # Stable sort on a source-major layout: equal due times go to the lower source index.
    return np.argsort(due, kind="stable")[:count] // count


def ordinals(schedule: np.ndarray, consumed: np.ndarray) -> np.ndarray:
    """For each scheduled sample, its running index within its own source (global count)."""
    counts = np.bincount(schedule, minlength=consumed.size)
    first = np.cumsum(counts) - counts  # where each source's run starts in the grouped order
    out = np.empty(schedule.size, dtype=np.int64)
    out[np.argsort(schedule, kind="stable")] = np.arange(schedule.size) + np.repeat(consumed - first, counts)
    return out


def consumed_after(probs: np.ndarray, total: int) -> np.ndarray:
    """Per-source counts after the first `total` mixed samples, in O(sources) (for rebuilding a
    lost data state from the step number without scheduling millions of samples).

    The samples due at or before a time T form a prefix of the merged order; pick T a few samples
    short of `total`, count each source's due times <= T exactly (same float expression as
    `mix_schedule`), then schedule the short remainder.
    """
    n_src = probs.size
    t = float(max(total - n_src, 0))
    counts = np.zeros(n_src, dtype=np.int64)
    for j, p in enumerate(probs.tolist()):
        k = max(int(np.floor(t * p - 0.5)) + 1, 0)  # estimate of #{k >= 0: (k + 0.5) / p <= t}
        while k > 0 and (k - 1 + 0.5) / p > t:
            k -= 1
        while (k + 0.5) / p <= t:
            k += 1
        counts[j] = k
    rest = total - int(counts.sum())
    if rest > 0:
        counts += np.bincount(mix_schedule(counts, probs, rest), minlength=n_src)
    return counts
