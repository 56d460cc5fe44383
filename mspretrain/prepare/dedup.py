"""Exact and near-duplicate detection, and the per-document hashes that drive the split.

Design choices:
- Exact dedup always: the key is a 128-bit BLAKE2b of the cleaned document (cleaning has
  already normalised whitespace, width and script, so copies differing only in those
  collide). The first occurrence (in input order) is kept. Memory: 16 bytes per document.
- Near dedup (optional): MinHash over character 5-gram shingles (Chinese has no word
  boundaries; 5 characters is about two words) with `datasketch`'s LSH index. Signatures are
  computed in the `prepare` workers; the LSH index lives in the main process. A document is a
  near duplicate when LSH finds any earlier document as a candidate at the threshold, which is
  datasketch's usual use; candidates are not re-verified, so a few borderline pairs around the
  threshold go either way.
- Shingles are hashed vectorised in numpy (a polynomial over code points, MurmurHash3 mix)
  instead of datasketch's per-shingle SHA-1 in Python: ~50x faster, deterministic across
  processes, and the signatures equal datasketch's own when given the same hash function.
- Train/valid split and the tokenizer sample use two uniform numbers mixed from the key and
  the seed: a pure function of (document, seed), independent of input order, file boundaries
  and the number of workers.
"""
from __future__ import annotations

import functools
import hashlib
import os
from dataclasses import dataclass

import numpy as np

NUM_PERM = 128
SHINGLE = 5


def dedup_key(text: str) -> bytes:
    """128-bit key of a cleaned (so already normalised) document."""
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()


def dedup_keys(texts: list[str]) -> bytes:
    """`dedup_key` of each text, concatenated (16 bytes each: one object to pass between processes).
    Written out rather than calling `dedup_key`: a Python call per document was half the cost."""
    blake2b = hashlib.blake2b
    return b"".join([blake2b(t.encode("utf-8"), digest_size=16).digest() for t in texts])


def _splitmix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer: a bijective avalanche mix of 64-bit words (uint64 math wraps)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def split_numbers(keys: bytes, seed: int) -> np.ndarray:
    """(split number, sample number) per 16-byte key: shape (n, 2), uniform in [0, 1).

    Each half of the (already uniform) BLAKE2b key is XORed with a seed-derived word and mixed,
    so a new seed redraws both numbers of every document; vectorised, no per-document Python.
    """
    k = np.frombuffer(keys, dtype="<u8").reshape(-1, 2)
    with np.errstate(over="ignore"):
        salt = _splitmix64(np.array([seed & _M64, (seed + 0x9E3779B97F4A7C15) & _M64], dtype=np.uint64))
        mixed = _splitmix64(k ^ salt)
    return (mixed >> np.uint64(11)).astype(np.float64) * 2.0**-53


def uniforms(key: bytes, seed: int) -> tuple[float, float]:
    """(split number, sample number) of one key: see `split_numbers`."""
    a, b = split_numbers(key, seed)[0]
    return float(a), float(b)


_P = np.uint64(0x100000001B3)  # FNV-1 prime: the base of the polynomial shingle hash
_M64 = 2**64 - 1


def shingles(text: str, k: int = SHINGLE) -> list[str]:
    """Character k-grams of the text without whitespace (the whole text if shorter)."""
    s = "".join(text.split())
    return [s] if len(s) < k else [s[i: i + k] for i in range(len(s) - k + 1)]


def shingle_hash(shingle: str) -> int:
    """32-bit hash of one shingle: polynomial over code points mod 2^64, MurmurHash3 fmix64.
    The scalar reference of what `signatures` computes vectorised (tests feed it to datasketch)."""
    h = 0
    for ch in shingle:
        h = (h * int(_P) + ord(ch)) & _M64
    h ^= h >> 33
    h = (h * 0xFF51AFD7ED558CCD) & _M64
    h ^= h >> 33
    h = (h * 0xC4CEB9FE1A85EC53) & _M64
    h ^= h >> 33
    return h & 0xFFFFFFFF


def _fmix64(h: np.ndarray) -> np.ndarray:
    h = h ^ (h >> np.uint64(33))
    h = h * np.uint64(0xFF51AFD7ED558CCD)
    h = h ^ (h >> np.uint64(33))
    h = h * np.uint64(0xC4CEB9FE1A85EC53)
    return h ^ (h >> np.uint64(33))


def _shingle_hashes(texts: list[str], k: int = SHINGLE) -> tuple[np.ndarray, np.ndarray]:
    """(uint32 hashes of every shingle of every text, shingles per text), vectorised: one UTF-32
    encode of the whole chunk, a polynomial over k shifted views, and an index gather."""
    stripped = ["".join(t.split()) for t in texts]
    lens = np.fromiter(map(len, stripped), dtype=np.int64, count=len(stripped))
    cps = np.frombuffer("".join(stripped).encode("utf-32-le"), dtype=np.uint32).astype(np.uint64)
    n_windows = max(cps.size - k + 1, 0)
    windows = np.zeros(n_windows, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(k):  # h = (((c0 P + c1) P + c2) P + ...) mod 2^64
            windows = windows * _P + cps[j: j + n_windows]
    counts = np.where(lens >= k, lens - k + 1, 1)
    starts = np.cumsum(lens) - lens
    first = np.cumsum(counts) - counts
    doc_of = np.repeat(np.arange(len(texts)), counts)
    idx = starts[doc_of] + np.arange(int(counts.sum())) - first[doc_of]  # window start of each shingle
    short = lens < k
    hashes = np.empty(int(counts.sum()), dtype=np.uint64)
    long_rows = ~short[doc_of]
    hashes[long_rows] = _fmix64(windows[idx[long_rows]])
    hashes[first[short]] = [shingle_hash(stripped[i]) for i in np.flatnonzero(short)]
    return (hashes & np.uint64(0xFFFFFFFF)).astype(np.uint32), counts


@functools.lru_cache(maxsize=1)
def _c_minhash():
    """The C MinHash (optional extension), or None: then numpy computes the same signatures.
    `MSPRETRAIN_MINHASH=numpy` switches it off (the tests compare both paths)."""
    if os.environ.get("MSPRETRAIN_MINHASH") == "numpy":
        return None
    try:
        from mspretrain.prepare import _minhash
    except ImportError:
        return None
    return _minhash


@functools.lru_cache(maxsize=4)
def _permutations(seed: int, num_perm: int) -> tuple[np.ndarray, np.ndarray]:
    """datasketch's affine32 permutations (`MinHash(num_perm, seed).permutations`: odd `a`,
    any `b`, from `np.random.RandomState(seed)`), drawn here so that neither the workers nor
    the main process import datasketch, which imports scipy (seconds of start-up, ~40 MB)."""
    gen = np.random.RandomState(seed)
    a = gen.randint(0, 1 << 31, num_perm, dtype=np.uint32) * np.uint32(2) + np.uint32(1)
    b = gen.randint(0, 1 << 32, num_perm, dtype=np.uint32)
    return a, b


def _fmix32(h: np.ndarray) -> np.ndarray:
    """MurmurHash3's 32-bit finalizer (datasketch pre-mixes with it; uint32 math wraps)."""
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> np.uint32(16))


def signatures(texts: list[str], seed: int, num_perm: int = NUM_PERM, perms: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """MinHash signatures, shape (len(texts), num_perm), uint32.

    The same numbers as `datasketch.MinHash(num_perm, seed, hashfunc=shingle_hash)` updated
    with `shingles(text)`, computed for a whole chunk of documents at once in numpy
    (datasketch's per-document Python work was ~50x slower here).
    """
    a, b = perms if perms is not None else _permutations(seed, num_perm)  # `perms`: given, as in the workers
    if not texts:
        return np.empty((0, num_perm), dtype=np.uint32)
    hv, counts = _shingle_hashes(texts)
    hv = _fmix32(hv)
    fast = _c_minhash()
    if fast is not None:  # the same numbers in one pass (mspretrain/prepare/_minhash.c)
        bounds = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        raw = fast.signatures(np.ascontiguousarray(hv), bounds, np.ascontiguousarray(a), np.ascontiguousarray(b))
        return np.frombuffer(raw, dtype=np.uint32).reshape(len(texts), num_perm)
    starts = np.cumsum(counts) - counts
    out = np.empty((len(texts), num_perm), dtype=np.uint32)
    lo = 0
    while lo < len(texts):  # blocks of whole documents keep (num_perm, shingles) near 16 MB
        hi = max(int(np.searchsorted(starts, starts[lo] + 32768)), lo + 1)
        block = a[:, None] * hv[None, starts[lo]: starts[hi - 1] + counts[hi - 1]] + b[:, None]  # (num_perm, shingles)
        out[lo:hi] = np.minimum.reduceat(block, starts[lo:hi] - starts[lo], axis=1).T  # (docs, num_perm)
        lo = hi
    return out


@functools.lru_cache(maxsize=8)
def lsh_params(threshold: float, num_perm: int = NUM_PERM) -> tuple[int, int]:
    """(bands, rows per band) that datasketch's `MinHashLSH(threshold, num_perm)` picks: the
    pair minimising false positive + false negative probability mass (weights 0.5 / 0.5), in
    its search order. The integrands are polynomials of degree b*r <= num_perm, so Gauss-Legendre
    with num_perm nodes integrates them exactly (datasketch uses scipy's `quad`; the tests check
    the two agree over a grid of thresholds)."""
    x, w = np.polynomial.legendre.leggauss(num_perm)

    def integral(f, lo: float, hi: float) -> float:
        s = (hi - lo) / 2 * x + (hi + lo) / 2
        return float((hi - lo) / 2 * np.dot(w, f(s)))

    best, opt = float("inf"), (0, 0)
    for b in range(1, num_perm + 1):
        for r in range(1, num_perm // b + 1):
            fp = integral(lambda s, b=b, r=r: 1 - (1 - s ** float(r)) ** float(b), 0.0, threshold)
            fn = integral(lambda s, b=b, r=r: 1 - (1 - (1 - s ** float(r)) ** float(b)), threshold, 1.0)
            err = fp * 0.5 + fn * 0.5
            if err < best:
                best, opt = err, (b, r)
    return opt


def band_keys(sigs: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """(n, bands) uint64: a hash of each LSH band's `rows` MinHash values and the band's number
    (datasketch's bands are `sig[i * rows: (i + 1) * rows]`); see `diskdedup` on collisions."""
    n = sigs.shape[0]
    v = sigs[:, : bands * rows].astype(np.uint64).reshape(n, bands, rows)
    with np.errstate(over="ignore"):
        h = np.broadcast_to(_splitmix64(np.arange(1, bands + 1, dtype=np.uint64)), (n, bands)).copy()
        for j in range(rows):
            h = _splitmix64(h * _P + v[:, :, j])
    return h


@dataclass(frozen=True, eq=False)
class LshSettings:
    """Near dedup's MinHash-LSH settings, built once (`of`) from the config and handed to
    whatever needs them: the workers (signatures, band keys), the dedup partitions on disk
    (`diskdedup.DiskDedup`: one band-key record per band) and the manifest (`publish.dedup_info`).
    The permutations are drawn by the main process: datasketch (and the scipy it imports) stays
    out of the workers (`_permutations`)."""

    threshold: float
    seed: int
    bands: int
    rows: int
    a: np.ndarray  # datasketch's affine permutations (`_permutations`)
    b: np.ndarray
    num_perm: int = NUM_PERM

    @classmethod
    def of(cls, cfg) -> LshSettings | None:
        """The settings of `cfg` (a `PrepareConfig`), or None without near dedup."""
        return cls.make(cfg.near_dedup_threshold, cfg.seed) if cfg.near_dedup else None

    @classmethod
    def make(cls, threshold: float, seed: int) -> LshSettings:
        return cls(threshold, seed, *lsh_params(threshold), *_permutations(seed, NUM_PERM))

    def band_keys(self, texts: list[str]) -> np.ndarray:
        """(n, bands) LSH band keys of the texts' MinHash signatures."""
        return band_keys(signatures(texts, self.seed, self.num_perm, perms=(self.a, self.b)), self.bands, self.rows)


class ExactDedup:
    """Remembers keys; `seen(key)` is True for every occurrence after the first."""

    def __init__(self) -> None:
        self._keys: set[bytes] = set()

    def seen(self, key: bytes) -> bool:
        if key in self._keys:
            return True
        self._keys.add(key)
        return False

    def fresh(self, keys: bytes) -> list[bool]:
        """`not seen(key)` for each 16-byte key of `keys`, in order, in one comprehension
        (the main process of `prepare` runs this for every document)."""
        known, add = self._keys, self._keys.add
        # `add` returns None, so `not add(k)` is True: a key not yet known is fresh, and known now.
        return [k not in known and not add(k) for k in [keys[i: i + 16] for i in range(0, len(keys), 16)]]


class NearDedup:
    """MinHash-LSH index; `seen(sig)` is True when an earlier document is a near duplicate."""

    def __init__(self, threshold: float, seed: int, num_perm: int = NUM_PERM) -> None:
        from datasketch import MinHashLSH

        self.seed = seed
        self._lsh = MinHashLSH(threshold=threshold, num_perm=num_perm)
        self._n = 0

    def seen(self, sig: np.ndarray) -> bool:
        from datasketch import LeanMinHash

        m = LeanMinHash(seed=self.seed, hashvalues=sig, scheme="affine32")
        if self._lsh.query(m):
            return True
        self._lsh.insert(self._n, m, check_duplication=False)
        self._n += 1
        return False
