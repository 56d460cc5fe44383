"""The global sample plan (`data/order.py`) names exactly the windows the loader serves, on any
world size, across epochs and with mixing: checked against the raw `.bin` bytes."""
from __future__ import annotations

import numpy as np
import pytest

from mspretrain.data.order import SamplePlan, batch_hash
from tests.helpers.datadirs import SEQ, counting_dir, loader, raw_windows


def _check(srcs, world: int, batch: int, steps: int) -> None:
    ranks = [loader(None, sources=srcs, rank=r, world=world, batch_size=batch) for r in range(world)]
    raw = [raw_windows(d) for d, _ in srcs]
    plan = SamplePlan(tuple(len(w) for w in raw), tuple(w for _, w in srcs), seed=7)
    pos = [0] * len(srcs)
    for _ in range(steps):
        assert [s["consumed"] for s in ranks[0].state()["sources"]] == pos
        ids = plan.batch(pos, batch * world)
        for r, ld in enumerate(ranks):
            got = ld.next_batch().tokens.astype(np.int64)
            want = np.stack([raw[j][w] for j, w in ids[r::world]])
            np.testing.assert_array_equal(got, want)
        pos = plan.advance(pos, batch * world)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_single_source_across_epochs(tmp_path, world):
    a = counting_dir(tmp_path, "a", 23 * SEQ + 5)  # 23 windows: a batch of 6 crosses epochs
    _check([(a, 1.0)], world, batch=2, steps=12)


@pytest.mark.parametrize("world", [1, 2])
def test_mixed_sources(tmp_path, world):
    a = counting_dir(tmp_path, "a", 40 * SEQ + 1)
    b = counting_dir(tmp_path, "b", 9 * SEQ + 3, offset=30000)  # wraps many times
    _check([(a, 0.7), (b, 0.3)], world, batch=3, steps=15)


def test_hash_names_the_batch():
    plan = SamplePlan((23,), (1.0,), seed=7)
    h = batch_hash(plan.batch([0], 4))
    assert h == batch_hash(plan.batch([0], 4)) and len(h) == 16
    assert h != batch_hash(plan.batch([4], 4))
    assert h != batch_hash(SamplePlan((23,), (1.0,), seed=8).batch([0], 4))
