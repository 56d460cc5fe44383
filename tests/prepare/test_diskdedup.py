"""Dedup with its state on disk (`diskdedup`) against the in-memory reference it replaced:
`dedup.ExactDedup` and datasketch's `MinHashLSH` used greedily in input order (`dedup.NearDedup`)."""
from __future__ import annotations

import numpy as np
import pytest

from mspretrain.prepare import dedup, diskdedup
from tests.helpers.prepare import dedup_corpus, dedup_reference


@pytest.mark.parametrize("threshold", [0.5, 0.8])
def test_disk_dedup_decides_like_the_in_memory_indexes(tmp_path, monkeypatch, threshold):
    monkeypatch.setattr(diskdedup, "PART_BYTES", 4096)  # many partition files
    monkeypatch.setattr(diskdedup, "BUFFER_BYTES", 2048)  # many flushes
    docs = dedup_corpus(1500, seed=threshold == 0.8)
    want_exact, want_near = dedup_reference(docs, threshold)
    assert want_exact.sum() > 50 and want_near.sum() > 50  # the corpus exercises both
    dd = diskdedup.DiskDedup(tmp_path / "dd", 200_000, dedup.LshSettings.make(threshold, 1234))
    assert dd.exact.parts > 8 and dd.near.parts > 8
    bands, rows = dd.bands, dd.rows
    for lo in range(0, len(docs), 97):  # chunks in input order, as the workers hand them over
        part = docs[lo: lo + 97]
        dd.add(dedup.dedup_keys(part), dedup.band_keys(dedup.signatures(part, seed=3), bands, rows))
    dd.resolve()
    exact, near = dd.dropped(0, len(docs))
    np.testing.assert_array_equal(exact, want_exact)
    np.testing.assert_array_equal(near, want_near)
    got_e, got_n = dd.dropped(100, 300)
    np.testing.assert_array_equal(got_e, want_exact[100:300])
    np.testing.assert_array_equal(got_n, want_near[100:300])
    assert not list((tmp_path / "dd").iterdir())  # partition files are removed once read


def test_records_placed_by_workers_and_resolve_by_path_change_nothing(tmp_path, monkeypatch):
    """prepare's local path: workers group each chunk's records by partition file
    (`chunk_records`), the main process reserves their places (`reserve`), a worker writes them
    there (`place_records`, chunks out of order here) and workers sort the partitions reading the
    files (`resolve(by_path=True)`). The partition files are byte for byte those of the
    main-process path (`add`), and so are the decisions."""
    monkeypatch.setattr(diskdedup, "PART_BYTES", 4096)
    monkeypatch.setattr(diskdedup, "BUFFER_BYTES", 2048)
    docs = dedup_corpus(1500, seed=5)
    want_exact, want_near = dedup_reference(docs, 0.6)
    assert want_exact.sum() > 50 and want_near.sum() > 50
    dds = {mode: diskdedup.DiskDedup(tmp_path / mode, 200_000, dedup.LshSettings.make(0.6, 1234)) for mode in ("main", "workers")}
    w = dds["workers"]
    tasks = []
    for i, lo in enumerate(range(0, len(docs), 97)):
        part = docs[lo: lo + 97]
        keys, bands = dedup.dedup_keys(part), dedup.band_keys(dedup.signatures(part, seed=3), w.bands, w.rows)
        dds["main"].add(keys, np.array(bands, copy=True))
        e, ec, b, bc = diskdedup.chunk_records(keys, bands, w.exact.parts, w.near.parts)
        path = tmp_path / f"chunk{i}.dd"
        with open(path, "wb") as f:
            np.save(f, e)
            np.save(f, b)
        base, *places = w.reserve(len(part), ec, bc)
        tasks.append((str(path), base, places))
    for task in tasks[::-1]:  # the last chunk's records first: every write goes to its reserved place
        diskdedup.place_records(task)
    assert not list(tmp_path.glob("chunk*.dd"))
    for dd in dds.values():
        dd.state()
    files = sorted(p.name for p in (tmp_path / "main").iterdir())
    assert len(files) > 16 and files == sorted(p.name for p in (tmp_path / "workers").iterdir())
    for name in files:
        assert (tmp_path / "main" / name).read_bytes() == (tmp_path / "workers" / name).read_bytes(), name
    dds["main"].resolve()
    dds["workers"].resolve(map, remove=False, by_path=True)
    for dd in dds.values():
        exact, near = dd.dropped(0, len(docs))
        np.testing.assert_array_equal(exact, want_exact)
        np.testing.assert_array_equal(near, want_near)


def test_exact_only_keeps_first_occurrence(tmp_path):
    docs = ["甲乙丙", "丁戊", "甲乙丙", "己", "丁戊", "甲乙丙"]
    dd = diskdedup.DiskDedup(tmp_path / "dd", 100, None)
    dd.add(dedup.dedup_keys(docs[:4]), None)
    dd.add(dedup.dedup_keys(docs[4:]), None)
    dd.resolve()
    exact, near = dd.dropped(0, 6)
    assert exact.tolist() == [False, False, True, False, True, True] and not near.any()


def test_band_keys_separate_bands_and_values():
    sigs = dedup.signatures(["春风明月江南山水", "春风明月江南山水", "千里万家门前桥边"], seed=1)
    k = dedup.band_keys(sigs, 9, 13)
    assert k.shape == (3, 9) and k.dtype == np.uint64
    assert (k[0] == k[1]).all() and not (k[0] == k[2]).any()
    assert len(set(k[0].tolist())) == 9  # equal values in two bands still give two keys
    same = np.tile(sigs[:1, :13], (1, 9))
    assert len(set(dedup.band_keys(same, 9, 13)[0].tolist())) == 9


def test_c_minhash_equals_numpy(monkeypatch):
    if dedup._c_minhash() is None:
        pytest.skip("the optional C extension is not built")
    docs = dedup_corpus(300, seed=5) + ["短", "", "春风"]
    fast = dedup.signatures(docs, seed=7)
    monkeypatch.setenv("MSPRETRAIN_MINHASH", "numpy")
    dedup._c_minhash.cache_clear()
    try:
        slow = dedup.signatures(docs, seed=7)
    finally:
        monkeypatch.delenv("MSPRETRAIN_MINHASH")
        dedup._c_minhash.cache_clear()
    np.testing.assert_array_equal(fast, slow)


def test_lsh_params_and_permutations_equal_datasketch():
    # drawn here so that prepare never imports datasketch (and scipy); must stay datasketch's
    from datasketch import MinHash
    from datasketch.lsh import _optimal_param

    for t in (0.3, 0.5, 0.65, 0.7, 0.8, 0.85, 0.9, 0.95):
        assert dedup.lsh_params(t) == _optimal_param(t, dedup.NUM_PERM, 0.5, 0.5)
    for seed in (0, 7):
        a, b = dedup._permutations(seed, dedup.NUM_PERM)
        want_a, want_b = MinHash(num_perm=dedup.NUM_PERM, seed=seed).permutations
        np.testing.assert_array_equal(a, want_a)
        np.testing.assert_array_equal(b, want_b)


def test_resolve_interrupted_sorts_again_only_the_undecided_partitions(tmp_path, monkeypatch):
    """prepare's dedup stage after a kill: each partition's result was saved as it came
    (`resolve(decided=...)`); the second resolve sends out only the partitions without one, and
    its decisions are those of the reference."""
    monkeypatch.setattr(diskdedup, "PART_BYTES", 4096)
    monkeypatch.setattr(diskdedup, "BUFFER_BYTES", 2048)
    docs = dedup_corpus(1500, seed=7)
    want_exact, want_near = dedup_reference(docs, 0.6)
    assert want_exact.sum() > 50 and want_near.sum() > 50
    dd = diskdedup.DiskDedup(tmp_path / "dd", 200_000, dedup.LshSettings.make(0.6, 1234))
    for lo in range(0, len(docs), 97):
        part = docs[lo: lo + 97]
        dd.add(dedup.dedup_keys(part), dedup.band_keys(dedup.signatures(part, seed=3), dd.bands, dd.rows))
    state = dd.state()
    n_exact, n_band = len(dd.exact.existing()), len(dd.near.existing())
    assert n_exact > 8 and n_band > 8

    class Killed(Exception):
        pass

    seen: list[str] = []

    def decided(name: str) -> None:
        seen.append(name)
        if len(seen) == n_exact + 3:  # all exact partitions and 3 band partitions saved
            raise Killed

    with pytest.raises(Killed):
        dd.resolve(map, remove=False, by_path=True, decided=decided)
    again = diskdedup.DiskDedup(tmp_path / "dd", 200_000, dedup.LshSettings.make(0.6, 1234))
    again.restore(state)
    assert again.decided_count() == (n_exact + 3, n_exact + n_band)
    sent: list = []

    def counting_map(fn, items):
        return map(fn, (sent.append(it) or it for it in items))

    redone: list[str] = []
    again.resolve(counting_map, remove=False, by_path=True, decided=redone.append)
    assert len(sent) == n_band - 3 and redone == [f"band.{i:04d}" for i in range(dd.near.parts)
                                                  if (tmp_path / "dd" / f"band.{i:04d}").exists()][3:]
    exact, near = again.dropped(0, len(docs))
    np.testing.assert_array_equal(exact, want_exact)
    np.testing.assert_array_equal(near, want_near)
