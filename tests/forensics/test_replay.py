"""`mspretrain replay`: an unchanged replay is the run itself, bit for bit; dropping the planted bad
document removes the spike it caused; every refusal is one line with exit code 2; RUN is never
written. The run (tests/forensics/planted.py) is trained once and shared with tests/forensics/test_spike.py."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from mspretrain.errors import UserError
from tests.forensics.planted import SPIKE_STEP, STEPS, losses, planted_run
from tests.helpers.cli import cli


@pytest.fixture(scope="module")
def planted(tmp_path_factory, tiny_data) -> tuple[Path, Path, int]:
    run, data = planted_run(tmp_path_factory, tiny_data)
    return run, data, json.loads((run.parent / "DONE").read_text())["bad_doc"]


def _snapshot(run: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(run)): (p.stat().st_size, p.stat().st_mtime_ns) for p in run.rglob("*") if p.is_file()}


@pytest.mark.slow  # a 20-step replay run (~16 s of CPU): end to end
def test_unchanged_replay_of_20_steps_is_bit_exact(planted, capsys, tmp_path):
    run, _, _ = planted
    before = _snapshot(run)
    code, out, err = cli(capsys, "replay", str(run), "--from-step", "2", "--steps", "20", "--out", str(tmp_path / "s"))
    assert code == 0, err
    assert "reproduced steps 3..22 bit for bit" in out
    # against the run's own log, read here independently of forensics/replay: the scratch run's metrics
    want, got = losses(run), losses(tmp_path / "s")
    assert [got[s] for s in range(3, 23)] == [want[s] for s in range(3, 23)]
    assert _snapshot(run) == before, "replay wrote into the run dir"


def test_drop_docs_removes_the_spike(planted, capsys):
    run, _, bad = planted
    code, out, err = cli(capsys, "replay", str(run), "--from-step", str(SPIKE_STEP - 2), "--steps", "3",
                          "--drop-docs", str(bad))
    assert code == 0, err
    rows = {int(line.split()[0]): line.split() for line in out.splitlines() if line.strip()[:1].isdigit()}
    assert sorted(rows) == [SPIKE_STEP - 1, SPIKE_STEP, SPIKE_STEP + 1], out
    orig = losses(run)
    # the step before holds no bad sample: the wrapper left its batch alone, so it is still exact
    assert float(rows[SPIKE_STEP - 1][3]) == 0.0
    # the spike step: the original was flagged; without the document its loss is in the normal range
    assert "spike in the run" in " ".join(rows[SPIKE_STEP]) and "spike in the replay" not in " ".join(rows[SPIKE_STEP])
    mean = np.mean([orig[s] for s in range(SPIKE_STEP - 10, SPIKE_STEP)])  # the detector's rolling mean
    replayed = float(rows[SPIKE_STEP][2])
    assert replayed < mean + 0.3 < orig[SPIKE_STEP], (replayed, mean, orig[SPIKE_STEP])
    assert f"step {SPIKE_STEP}, sample 2" in out and f"step {SPIKE_STEP}, sample 3" in out  # the 2 bad samples, swapped
    assert "replaced by the next sample of the plan" in out  # the rule is said


def test_drop_docs_loader_swaps_only_overlapping_samples(planted):
    """The wrapper against the plain loader and the plan, without MindSpore: rows that overlap the
    dropped document become the plan's next clean samples after the replay; the others are untouched."""
    from mspretrain.config import schema as cfgmod
    from mspretrain.data.loader import Loader
    from mspretrain.data.shards import IndexedDataset
    from mspretrain.forensics.drop_docs import DropDocsLoader
    from mspretrain.monitor.batch_log import plan_for

    run, data, bad = planted
    cfg = cfgmod.load(run / "config.toml")
    seq = cfg.data.seq_len
    make = lambda: Loader([(data, 1.0)], split="train", seq_len=seq, batch_size=4, seed=cfg.train.seed, log=lambda s: None)
    plain, wrapped = make(), make()
    plan = plan_for(plain)
    end = [4 * STEPS]
    drop = DropDocsLoader(wrapped, plan=plan, sources=[data], docs=[(0, bad)], end=end, first_step=1, accum=1)
    ds = IndexedDataset(data / "train")
    bad_end = int(np.cumsum(ds.lengths)[bad])
    bad_start = bad_end - int(ds.lengths[bad])
    touches = lambda w: w * seq <= bad_end - 1 and w * seq + seq >= bad_start
    cursor = list(end)
    for step in range(1, STEPS + 1):
        want, got = plain.next_batch().tokens, drop.next_batch().tokens
        ids = plan.batch([4 * (step - 1)], 4)[:, 1]
        for row, w in enumerate(ids):
            if not touches(int(w)):
                assert np.array_equal(got[row], want[row])
                continue
            while touches(int(plan.batch(cursor, 1)[0, 1])):
                cursor = plan.advance(cursor, 1)
            sub = int(plan.batch(cursor, 1)[0, 1])
            cursor = plan.advance(cursor, 1)
            assert np.array_equal(got[row], ds.tokens[sub * seq:sub * seq + seq + 1])
    assert [s.step for s in drop.swaps].count(SPIKE_STEP) == 2
    assert drop.state() == plain.state()  # the position is the loader's own
    # naming every document leaves no clean sample: refused at once (no endless search)
    every = [(0, d) for d in range(len(ds.lengths))]
    with pytest.raises(UserError, match="drops every sample"):
        DropDocsLoader(make(), plan=plan, sources=[data], docs=every, end=end, first_step=1, accum=1)


def test_refusals_are_one_line(planted, capsys, tmp_path):
    run, _, _ = planted
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    cases = [
        (["--from-step", "1", "--steps", "3"], "no verified checkpoint at or before step 1"),
        (["--from-step", "20", "--steps", "10"], "step 30 is out of range"),
        (["--from-step", "4", "--steps", "0"], "argument --steps: 0 is outside"),
        (["--from-step", "4", "--steps", "2", "--out", str(busy)], "already holds other files"),
        (["--from-step", "4", "--steps", "2", "--out", str(run / "scratch")], "inside the run"),
        (["--from-step", "4", "--steps", "2", "--drop-docs", "x"], "is not a document id"),
        (["--from-step", "4", "--steps", "2", "--lr-scale", "0"], "must be a positive finite number"),
        (["--from-step", "4", "--steps", "2", "--lr-scale", "inf"], "must be a positive finite number"),
        (["--from-step", "4", "--steps", "2", "--lr-scale", "nan"], "must be a positive finite number"),
        (["--from-step", "4", "--steps", "2", "--loss-scale", "inf"], "must be a positive finite number"),
    ]
    for args, words in cases:
        code, out, err = cli(capsys, "replay", str(run), *args)
        assert code == 2 and words in err, (args, err)
        assert err.count("\n") == 2 and "Traceback" not in err  # error: ... / hint: ...
    assert (busy / "keep.txt").read_text() == "mine" and list(busy.iterdir()) == [busy / "keep.txt"]
    assert not (run / "scratch").exists()
    code, _, err = cli(capsys, "replay", str(tmp_path), "--from-step", "2", "--steps", "2")
    assert code == 2 and "not a run dir" in err


def test_a_full_disk_for_the_scratch_dir_is_one_line(planted, capsys, tmp_path, monkeypatch):
    """The starting checkpoint copied into --out on a full disk, and a scratch dir
    that cannot be made, are one line each; the run is not touched."""
    import errno
    import os
    import shutil

    run, _, _ = planted
    before = _snapshot(run)

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "link", lambda *a: (_ for _ in ()).throw(OSError(errno.EXDEV, "cross-device link")))
    monkeypatch.setattr(shutil, "copy2", full)
    code, _, err = cli(capsys, "replay", str(run), "--from-step", "4", "--steps", "2", "--out", str(tmp_path / "s1"))
    assert code == 2 and "No space left on device" in err and "free disk space" in err, err
    assert err.count("\n") == 2 and "Traceback" not in err
    monkeypatch.setattr(Path, "mkdir", full)
    code, _, err = cli(capsys, "replay", str(run), "--from-step", "4", "--steps", "2", "--out", str(tmp_path / "s2"))
    assert code == 2 and "replay's scratch dir" in err and err.count("\n") == 2, err
    monkeypatch.undo()
    assert _snapshot(run) == before


def test_comparison_names_the_first_difference_and_other_worlds():
    """The verdicts of format_replay on hand-made results: it can say 'NOT reproduced', and on another
    world size it compares to 1e-5 and says why."""
    from mspretrain.forensics.replay import Interventions, Replay, Row, format_replay

    rows = [Row(step=s, original=5.0 + s, replayed=5.0 + s, grad_norm=1.0, lr=1e-3) for s in range(3, 7)]
    r = Replay(run=Path("/r"), scratch=None, requested=2, start=2, end=6, world_original=1, world=1,
               changes=Interventions(), rows=rows)
    assert "reproduced steps 3..6 bit for bit" in format_replay(r)
    rows[2].replayed = np.nextafter(rows[2].original, 99.0)  # one bit off at step 5
    assert "NOT reproduced: step 5 differs first" in format_replay(r)
    r.world_original = 2
    text = format_replay(r)
    assert "bit-exact" not in text and "1e-05 (relative)" in text and "reproduced steps 3..6 to 1e-05" in text
    rows[3].replayed = rows[3].original * (1 + 1e-4)
    assert "NOT reproduced: step 6 differs first" in format_replay(r)


def test_precision_lr_and_loss_scale_interventions(planted, capsys, tmp_path):
    """--dtype fp16 --loss-scale 1024 --lr-scale 0.5: the scratch run's own batches.jsonl shows each
    step ran at half the original lr and at the given scale, in fp16; the losses are shown side by side."""
    from mspretrain.config import schema as cfgmod

    run, _, _ = planted
    scratch = tmp_path / "s"
    code, out, err = cli(capsys, "replay", str(run), "--from-step", "12", "--steps", "2", "--dtype", "fp16",
                          "--loss-scale", "1024", "--lr-scale", "0.5", "--out", str(scratch))
    assert code == 0, err
    assert "interventions: precision.dtype = fp16; lr x 0.5; loss scale 1024" in out
    rows = {int(line.split()[0]): line.split() for line in out.splitlines() if line.strip()[:1].isdigit()}
    assert sorted(rows) == [13, 14], out
    # fp16 compute changes even the first step's loss (taken before any update); exact values from the scratch log
    orig_loss, new_loss = losses(run), losses(scratch)
    assert all(new_loss[s] != orig_loss[s] for s in (13, 14)) and abs(new_loss[13] - orig_loss[13]) < 0.05
    assert cfgmod.load(scratch / "config.toml").precision.dtype == "fp16"
    read = lambda p: {r["step"]: r for r in map(json.loads, p.read_text().splitlines()) if "step" in r}
    orig, new = read(run / "batches.jsonl"), read(scratch / "batches.jsonl")
    for s in (13, 14):
        assert new[s]["lr"] == pytest.approx(0.5 * orig[s]["lr"], rel=1e-12) and new[s]["pos"] == orig[s]["pos"]
        assert new[s]["scale"] == 1024.0 and orig[s]["scale"] == 1.0
