"""The 64-bit hashing the quality classifier's features share (quality.py: character n-grams;
words.py: jieba words): a multiplier and splitmix64's finaliser, vectorised over numpy arrays."""
from __future__ import annotations

import numpy as np

_MULT = np.uint64(0x9E3779B97F4A7C15)  # golden-ratio constant: spreads codepoints over 64 bits
_M1 = np.uint64(0xBF58476D1CE4E5B9)  # splitmix64's finaliser constants
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(h: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: the low bits of a hash then depend on all its input bits."""
    with np.errstate(over="ignore"):
        h = (h ^ (h >> np.uint64(30))) * _M1
        h = (h ^ (h >> np.uint64(27))) * _M2
    return h ^ (h >> np.uint64(31))
