"""The cache dir's files (`$MSPRETRAIN_CACHE`) and the Ascend version files doctor reads are read
with the special-file and size guards of the other readers: a FIFO, a link to
/dev/zero, a directory or an oversized file under a cache name is a cache miss (rebuilt), in
bounded time and memory, never a hang or gigabytes."""
from __future__ import annotations

import os
import resource
import threading
import time

import numpy as np
import pytest


def _hostile(path, kind: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "zero":
        path.symlink_to("/dev/zero")
    elif kind == "dir":
        path.mkdir()
    elif kind == "huge":
        with open(path, "wb") as f:
            f.truncate(3 << 30)  # sparse: 3 GB to read, no disk
    elif kind == "deep":
        path.write_text("[" * 200000)


def _bounded(fn):
    """fn() within 20 s and 200 MB of extra peak memory (a hang or /dev/zero fails it)."""
    box: dict = {}
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = threading.Thread(target=lambda: box.setdefault("v", fn()), daemon=True)
    t0 = time.monotonic()
    t.start()
    t.join(20)
    assert not t.is_alive(), "hung"
    assert time.monotonic() - t0 < 20
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0 < 200 * 1024
    return box.get("v")


@pytest.mark.parametrize("kind", ["fifo", "zero", "dir", "huge", "deep"])
def test_the_cached_cpu_peak_is_a_miss_not_a_hang(tmp_path, monkeypatch, kind):
    from mspretrain.monitor import mfu

    _hostile(tmp_path / "cpu_peak_tflops.json", kind)
    monkeypatch.setattr(mfu, "measure_cpu_peak_tflops", lambda seconds=0.0: 1.25)
    assert _bounded(lambda: mfu.cpu_peak_tflops(tmp_path)) == 1.25


@pytest.mark.parametrize("kind", ["fifo", "zero", "dir", "huge"])
def test_the_cached_character_table_is_a_miss_not_a_hang(tmp_path, monkeypatch, kind):
    from mspretrain.prepare import clean

    monkeypatch.setenv("MSPRETRAIN_CACHE", str(tmp_path))
    builder = lambda: np.arange(0x110000, dtype=np.uint32).astype(np.uint8)  # noqa: E731
    clean._cached_table(builder)
    (cached,) = tmp_path.glob("char_table-*.bin")
    cached.unlink()
    _hostile(cached, kind)
    got = _bounded(lambda: clean._cached_table(builder))
    np.testing.assert_array_equal(got, builder())


@pytest.mark.parametrize("kind", ["fifo", "zero", "huge"])
def test_an_ascend_version_file_that_is_not_a_file_is_unknown(tmp_path, kind):
    from mspretrain.preflight.doctor import _version_of

    _hostile(tmp_path / "version.info", kind)
    assert _bounded(lambda: _version_of(tmp_path / "version.info")) is None
    (tmp_path / "ok.info").write_text("Version=8.0.RC3\n")
    assert _version_of(tmp_path / "ok.info") == "8.0.RC3"
