"""Loader: coverage per epoch (1, 2, 3 ranks), determinism, exact resume, mixing, EOS layout, errors.

Data dirs are built with ShardWriter + a hand-written manifest (tests/helpers/datadirs.py `make_dir`). Token values are unique
positions (token[i] = i + offset), so a window identifies itself by its first token, and the
expected windows come from slicing the raw `.bin` file, independently of the loader's views.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from mspretrain.data.loader import Batch, Loader, resolve_sources
from mspretrain.data.manifest import read_manifest
from mspretrain.data.mixing import consumed_after, mix_schedule, normalise
from mspretrain.errors import UserError
from tests.helpers.datadirs import EOS, SEQ, counting_dir, loader, make_dir, raw_windows


def take(ld: Loader, k: int) -> list[Batch]:
    return [ld.next_batch() for _ in range(k)]


def same(a: list[Batch], b: list[Batch]) -> bool:
    def eq(x, y):
        return (x is None and y is None) or (x is not None and y is not None and x.dtype == y.dtype and np.array_equal(x, y))
    return len(a) == len(b) and all(eq(x.tokens, y.tokens) and eq(x.positions, y.positions)
                                    and eq(x.segments, y.segments) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return counting_dir(tmp_path_factory.mktemp("loader"), "a", 23 * SEQ + 5)  # 23 windows


def global_order(d: Path, world: int, steps: int, batch: int = 4, **kw) -> np.ndarray:
    """Rows of all ranks re-interleaved into the global order (rank r owns positions r, r+w, ...)."""
    per_rank = [np.concatenate([b.tokens for b in take(loader(d, rank=r, world=world, batch_size=batch, **kw), steps)])
                for r in range(world)]
    out = np.empty((steps * batch * world, SEQ + 1), dtype=per_rank[0].dtype)
    for r in range(world):
        out[r::world] = per_rank[r]
    return out


@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_window_once_per_epoch(data, world):
    ref = raw_windows(data)
    n = len(ref)
    steps = -(-n // (4 * world))  # enough steps to cover one epoch
    order = global_order(data, world, steps)
    epoch0 = order[:n]
    ids = epoch0[:, 0] // SEQ
    assert sorted(ids.tolist()) == list(range(n))  # each window exactly once: union is all, no overlap
    np.testing.assert_array_equal(epoch0, ref[ids])  # and each is the right tokens
    assert not np.array_equal(ids, np.arange(n))  # actually shuffled
    # The global order does not depend on how it is cut into ranks.
    np.testing.assert_array_equal(order, global_order(data, 1, steps, batch=4 * world)[: len(order)])


def test_ranks_disjoint_within_epoch(data):
    n = len(raw_windows(data))
    seen = [set((np.concatenate([b.tokens for b in take(loader(data, rank=r, world=3, batch_size=2), n // 6)])[:, 0]
                 // SEQ).tolist()) for r in range(3)]
    assert all(not (seen[i] & seen[j]) for i in range(3) for j in range(i + 1, 3))


def test_seed_determines_order(data):
    assert same(take(loader(data), 12), take(loader(data), 12))
    assert not same(take(loader(data), 12), take(loader(data, seed=8), 12))
    first, second = take(loader(data, batch_size=23), 2)  # epoch 0 vs epoch 1: both full, different order
    assert sorted(first.tokens[:, 0]) == sorted(second.tokens[:, 0])
    assert not np.array_equal(first.tokens, second.tokens)


def roundtrip(state: dict) -> dict:
    return json.loads(json.dumps(state))  # what data_state.json holds


@pytest.mark.parametrize("k", [0, 3, 5, 11])  # 23 windows / 4 per batch: k = 5, 11 straddle epochs
def test_resume_exact_single_source(data, k):
    ref = loader(data)
    take(ref, k)
    state = roundtrip(ref.state())
    assert state["sources"][0]["consumed"] == 4 * k and state["sources"][0]["epoch"] == 4 * k // 23
    fresh = loader(data)
    fresh.load_state(state)
    assert same(take(fresh, 20), take(ref, 20))  # 20 batches = 80 samples: several epoch boundaries


def test_resume_exact_with_mixing_ranks_and_eos(tmp_path):
    a = counting_dir(tmp_path, "a", 40 * SEQ + 1)
    b = counting_dir(tmp_path, "b", 9 * SEQ + 3, offset=30000)  # small: many epochs in 20 batches
    srcs = [(a, 0.7), (b, 0.3)]
    for rank in (0, 1):
        kw = dict(sources=srcs, rank=rank, world=2, batch_size=3, reset_attention_at_eos=True)
        ref = loader(None, **kw)
        take(ref, 7)
        state = roundtrip(ref.state())
        fresh = loader(None, **kw)
        fresh.load_state(state)
        assert same(take(fresh, 20), take(ref, 20))
    assert state["sources"][1]["epoch"] >= 1  # the small source did wrap


def test_resume_on_a_different_world_size(tmp_path):
    a, b = counting_dir(tmp_path, "a", 40 * SEQ + 1), counting_dir(tmp_path, "b", 17 * SEQ + 1, offset=30000)
    srcs = [(a, 0.6), (b, 0.4)]
    ranks = [loader(None, sources=srcs, rank=r, world=2, batch_size=3) for r in range(2)]
    for ld in ranks:
        take(ld, 5)
    assert ranks[0].state()["sources"] == ranks[1].state()["sources"]  # every rank holds the same state
    notes = []
    single = loader(None, sources=srcs, batch_size=6, log=notes.append)
    single.load_state(roundtrip(ranks[0].state()))
    assert any("2" in n and "ranks" in n for n in notes)
    nxt = [ld.next_batch().tokens for ld in ranks]
    expected = np.empty((6, SEQ + 1), dtype=nxt[0].dtype)
    expected[0::2], expected[1::2] = nxt
    np.testing.assert_array_equal(single.next_batch().tokens, expected)


def test_mixing_proportions_and_epochs(tmp_path):
    dirs = [counting_dir(tmp_path, f"s{i}", n * SEQ + 1, offset=20000 * i) for i, n in enumerate([50, 31, 17])]
    weights = [0.5, 0.3, 0.2]
    ld = loader(None, sources=list(zip(dirs, weights)), batch_size=40)
    toks = np.concatenate([b.tokens for b in take(ld, 250)])  # 10,000 samples
    share = np.bincount(toks[:, 0] // 20000, minlength=3) / len(toks)
    np.testing.assert_allclose(share, weights, atol=0.01 * min(weights))  # within 1 % (relative)
    st = ld.state()["sources"]
    assert [s["consumed"] // s["samples_per_epoch"] for s in st] == [s["epoch"] for s in st]
    assert [s["epoch"] for s in st] == [5000 // 50, 3000 // 31, 2000 // 17]  # own epoch counter each
    for i, d in enumerate(dirs):  # every sample of every source is one of its true windows
        ref = raw_windows(d)
        mine = toks[toks[:, 0] // 20000 == i]
        ids = (mine[:, 0] - 20000 * i) // SEQ
        np.testing.assert_array_equal(mine, ref[ids])
        n = len(ref)
        for e in range(3):  # each source's own epochs: every window once, in a fresh order each epoch
            assert sorted(ids[e * n : (e + 1) * n].tolist()) == list(range(n))
    alone = np.concatenate([b.tokens for b in take(loader(dirs[0], batch_size=50), 3)])
    np.testing.assert_array_equal(toks[toks[:, 0] // 20000 == 0][:150], alone)  # source 0 keeps its own order


def test_mix_schedule_is_independent_of_chunking():
    probs = normalise([0.7, 0.2, 0.1])
    def run(sizes: list[int]) -> np.ndarray:
        c, out = np.zeros(3, dtype=np.int64), []
        for size in sizes:
            out.append(mix_schedule(c, probs, size))
            c += np.bincount(out[-1], minlength=3)
        return np.concatenate(out)

    one, chunked = run([1] * 300), run([7, 1, 50, 13, 229])
    np.testing.assert_array_equal(one, chunked)
    counts = np.cumsum(np.eye(3, dtype=np.int64)[one], axis=0)  # (300, 3) running counts
    g = np.arange(1, 301)[:, None]
    assert np.abs(counts - probs[None, :] * g).max() <= 1.0  # never more than one sample off its share


def test_consumed_after_matches_the_schedule():
    for weights in ([0.7, 0.2, 0.1], [1.0, 1.0], [0.013, 5.0, 2.5, 0.4]):
        probs = normalise(weights)
        sched = mix_schedule(np.zeros(len(weights), dtype=np.int64), probs, 5000)
        for total in (0, 1, 2, 3, 17, 999, 4096, 5000):
            np.testing.assert_array_equal(consumed_after(probs, total),
                                          np.bincount(sched[:total], minlength=len(weights)))


def test_changed_data_dir_refused_then_allowed(tmp_path):
    d = counting_dir(tmp_path, "a", 23 * SEQ + 5)
    ref = loader(d)
    take(ref, 4)
    state = roundtrip(ref.state())
    manifest = json.loads((d / "manifest.json").read_text())
    manifest["fingerprint"] = "fp-new"
    (d / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(UserError) as e:
        loader(d).load_state(state)
    assert "fp-a" in e.value.cause and "fp-new" in e.value.cause and "\n" not in str(e.value)
    assert "--allow-data-change" in e.value.fix
    warnings = []
    fresh = loader(d, log=warnings.append)
    fresh.load_state(state, allow_data_change=True)
    assert any("fp-a" in w and "fp-new" in w for w in warnings)
    assert same(take(fresh, 3), take(ref, 3))  # position kept


def test_resume_refuses_other_seed_and_weights(data, tmp_path):
    state = loader(data).state()
    with pytest.raises(UserError, match="seed 7"):
        loader(data, seed=9).load_state(state)
    b = counting_dir(tmp_path, "b", 30 * SEQ + 1)
    st2 = loader(None, sources=[(data, 1.0), (b, 1.0)]).state()
    with pytest.raises(UserError, match="weight"):
        loader(None, sources=[(data, 1.0), (b, 2.0)]).load_state(st2)
    with pytest.raises(UserError, match="sources"):
        loader(data).load_state(st2)


def eos_reference(inputs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Megatron-style reset: position restarts at 0 after each EOS; segment counts EOS seen so far."""
    pos, seg = np.zeros(inputs.shape, np.int32), np.zeros(inputs.shape, np.int32)
    for b, row in enumerate(inputs):
        p = s = 0
        for t, tok in enumerate(row):
            pos[b, t], seg[b, t] = p, s
            p, s = (0, s + 1) if tok == EOS else (p + 1, s)
    return pos, seg


def test_positions_and_segments_at_eos(tmp_path):
    rng = np.random.default_rng(0)
    lengths = [5, 1, 3, 12, 2, 9, 1, 1, 20, 4, 7]  # includes EOS-only documents and docs longer than a window
    docs = [np.append(rng.integers(4, 1000, size=n - 1), EOS) for n in lengths]
    d = make_dir(tmp_path, "eos", docs, vocab=1000)
    ld = loader(d, batch_size=3, reset_attention_at_eos=True)
    n = ld.samples_per_epoch[str(d)]
    for b in take(ld, -(-n // 3)):
        pos, seg = eos_reference(b.tokens[:, :-1])
        np.testing.assert_array_equal(b.positions, pos)
        np.testing.assert_array_equal(b.segments, seg)
        assert b.positions.dtype == np.int32 and b.segments.dtype == np.int32
        assert b.positions.shape == (3, SEQ)
    assert loader(d).next_batch().positions is None


def test_token_dtype(data):
    assert loader(data).next_batch().tokens.dtype == np.int32
    got = loader(data, token_dtype="int64").next_batch().tokens
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, loader(data).next_batch().tokens)  # the same ids, only wider


def test_bad_inputs(tmp_path, data):
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="manifest.json") as e:
        loader(tmp_path / "empty")
    assert "mspretrain prepare" in e.value.fix
    with pytest.raises(UserError, match="does not exist"):
        read_manifest(tmp_path / "nope")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "manifest.json").write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON"):
        read_manifest(tmp_path / "bad")
    (tmp_path / "bad" / "manifest.json").write_text(json.dumps({"fingerprint": "x", "tokens": {}}))
    with pytest.raises(UserError, match="vocab_size"):
        read_manifest(tmp_path / "bad")
    (tmp_path / "bad" / "manifest.json").write_text(json.dumps({"fingerprint": "x", "tokens": {}, "vocab_size": 9,
                                                                "special_ids": {}}))
    with pytest.raises(UserError, match="missing"):  # manifest but no shards
        loader(tmp_path / "bad")
    small = make_dir(tmp_path, "small", [np.arange(4, 9)])
    with pytest.raises(UserError, match="has 5 tokens, but one sample needs seq_len \\+ 1 = 9"):
        loader(small)
    for kw, msg in [(dict(batch_size=0), "batch size"), (dict(token_dtype="float32"), "token_dtype"),
                    (dict(rank=2, world=2), "rank"), (dict(seq_len=0), "seq_len")]:
        with pytest.raises(UserError, match=msg):
            loader(data, **kw)
    for w in (0.0, -1.0, float("nan")):
        with pytest.raises(UserError, match="weight"):
            loader(None, sources=[(data, w)])
    with pytest.raises(UserError, match="twice"):
        loader(None, sources=[(data, 1.0), (data, 1.0)])
    stale = make_dir(tmp_path, "stale", [np.arange(4, 100)])
    m = json.loads((stale / "manifest.json").read_text())
    m["tokens"]["train"] = 5
    (stale / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(UserError, match="says split 'train' has 5 tokens"):
        loader(stale)


def test_seq_len_differs_from_prepare_is_fine(tmp_path):
    d = make_dir(tmp_path, "s", [np.arange(4, 200)], extra={"seq_len": 2048})
    assert loader(d).samples_per_epoch[str(d)] == (196 - 1) // SEQ


def test_resolve_sources(tmp_path):
    assert resolve_sources(tmp_path) == [(tmp_path, 1.0)]
    assert resolve_sources(None, ({"path": "a", "weight": 0.3},)) == [(Path("a"), 0.3)]
    assert resolve_sources("a", ({"path": "a", "weight": 0.3}, {"path": "b", "weight": 0.7})) == [(Path("a"), 0.3), (Path("b"), 0.7)]
    with pytest.raises(UserError, match="does not list the --data dir"):
        resolve_sources("d", ({"path": "a", "weight": 0.3},))
    with pytest.raises(UserError, match="data.sources"):
        resolve_sources(None, ({"dir": "a"},))
    with pytest.raises(UserError, match="no data"):
        resolve_sources(None, ())
