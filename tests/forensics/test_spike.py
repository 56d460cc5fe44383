"""`mspretrain spike`: the planted bad document (tests/forensics/planted.py) is ranked first among the
documents of the step it spiked, with its input file and offset; the spike record the detector
wrote names the same batch; refusals are one line with exit code 2."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.forensics.planted import SEED, SPIKE_STEP, planted_run
from tests.helpers.cli import cli


@pytest.fixture(scope="module")
def planted(tmp_path_factory, tiny_data) -> tuple[Path, Path, int]:
    run, data = planted_run(tmp_path_factory, tiny_data)
    return run, data, json.loads((run.parent / "DONE").read_text())["bad_doc"]


@pytest.fixture(scope="module")
def analysis(planted):
    from mspretrain.forensics.spike import analyse

    return analyse(planted[0], SPIKE_STEP)


def test_the_planted_batch_is_where_the_plan_puts_it(planted):
    """The fixture's premise, checked from the plan: step SPIKE_STEP is the first batch with bad
    windows (2 of 4), and the detector flagged it."""
    from mspretrain.data.order import SamplePlan
    from mspretrain.data.shards import IndexedDataset
    from mspretrain.monitor.spike_record import doc_ends, window_docs

    run, data, bad = planted
    ends = doc_ends(data)
    n = (IndexedDataset(data / "train").n_tokens - 1) // 32
    plan = SamplePlan((n,), (1.0,), seed=SEED)
    has_bad = [sum(bad in window_docs(ends, 32, int(w)) for w in plan.batch([4 * (s - 1)], 4)[:, 1]) for s in range(1, 25)]
    assert has_bad[SPIKE_STEP - 1] == 2 and not any(has_bad[:SPIKE_STEP - 1]), has_bad
    flagged = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines() if '"spike"' in x]
    assert flagged == [SPIKE_STEP]


def test_spike_record_names_the_batch(planted):
    from mspretrain.data.order import batch_hash

    run, _, bad = planted
    assert sorted(p.name for p in (run / "spikes").iterdir()) == [f"step_{SPIKE_STEP:06d}.json"]
    rec = json.loads((run / "spikes" / f"step_{SPIKE_STEP:06d}.json").read_text())
    logged = [json.loads(x) for x in (run / "batches.jsonl").read_text().splitlines()]
    line = next(r for r in logged if r.get("step") == SPIKE_STEP)
    assert rec["pos"] == line["pos"] and rec["hash"] == line["hash"]
    windows = [s["window"] for s in rec["samples"]]
    assert len(windows) == 4 and [s["rank"] for s in rec["samples"]] == [0] * 4
    assert sum(bad in s["documents"] for s in rec["samples"]) == 2
    assert rec["hash"] == batch_hash(np.array([[0, w] for w in windows]))
    # each sample's loss as the step computed it: the bad samples are the two worst
    worst = sorted(rec["samples"], key=lambda x: -x["loss"])[:2]
    assert all(bad in x["documents"] for x in worst)


def test_spike_ranks_the_planted_document_first(planted, analysis):
    run, _, bad = planted
    a = analysis
    top = a.doc_parts[0]
    assert (top.source, top.ident) == (0, bad), [(p.ident, p.loss) for p in a.doc_parts]
    assert top.z > 5 and top.loss > max(p.loss for p in a.doc_parts[1:]) + 2
    # the excesses add up to the spike: the step's loss above the detector's rolling mean
    assert sum(p.excess for p in a.doc_parts) == pytest.approx(a.batch_loss - a.reference, abs=1e-6)
    assert top.excess > 0.8 * (a.batch_loss - a.reference)
    # the forward at the replayed weights gives the loss the compiled step logged
    assert a.batch_loss == pytest.approx(a.logged["loss"], rel=1e-5)
    assert a.replay.first_difference() is None and a.replay.end == SPIKE_STEP - 1
    # the bad samples are the two most costly, and the origin index points at bad.txt, offset 0
    worst = sorted(a.sample_parts, key=lambda p: -p.loss)[:2]
    rec = json.loads((run / "spikes" / f"step_{SPIKE_STEP:06d}.json").read_text())
    assert [x["loss"] for x in rec["samples"]] == pytest.approx([p.loss for p in a.sample_parts], rel=1e-5)
    assert all(bad in a.samples[p.ident]["documents"] for p in worst)
    info = a.docs[(0, bad)]
    assert Path(info["file"]).name == "bad.txt" and info["offset"] == 0 and info["text"].startswith("龘龘")
    # per-group gradient norms: every replayed step and the spike step; their total is the logged grad norm
    assert sorted(a.groups) == list(range(a.replay.start + 1, SPIKE_STEP + 1))
    assert a.groups[SPIKE_STEP]["total"] == pytest.approx(a.logged["grad_norm"], rel=1e-3)
    med = np.median([a.groups[s]["embeddings"] for s in a.groups if s < SPIKE_STEP])
    assert a.groups[SPIKE_STEP]["embeddings"] > 3 * med


def test_spike_output(planted, analysis):
    from mspretrain.forensics.spike import format_analysis

    run, _, bad = planted
    text = format_analysis(analysis)
    assert f"step {SPIKE_STEP} of {run}" in text and "(flagged as a spike)" in text
    rows = text.split("documents ranked")[1].splitlines()
    assert rows[2].split()[:2] == ["1", str(bad)] and "bad.txt:0" in rows[2]
    assert "gradient norm by parameter group" in text and "embeddings" in text


def test_report_links_the_spike_record(planted, tmp_path):
    from mspretrain.forensics.report import build_report

    run = tmp_path / "run"  # the report writes its PNGs into the run dir: a copy, not the shared run
    shutil.copytree(planted[0], run, ignore=shutil.ignore_patterns("checkpoints"))
    page = build_report(run, tmp_path / "report.html").read_text(encoding="utf-8")
    assert f'spikes/step_{SPIKE_STEP:06d}.json</a>' in page and f"--step {SPIKE_STEP}</code>" in page


def test_spike_after_the_fact_and_refusals(planted, capsys, tmp_path):
    run, _, bad = planted
    code, out, err = cli(capsys, "spike", str(run), "--step", str(SPIKE_STEP), "--no-replay")
    assert code == 0, err
    assert f"{bad}  " in out and "bad.txt:0" in out
    # without a replay the losses are the spike record's, as the step computed them
    assert "as the step computed it (spike record" in out
    table = out.split("text\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert sorted(float(row.split()[5]) > 7 for row in table) == [False, False, True, True], table
    # the spike record alone (batches.jsonl gone) still names the batch
    copy = tmp_path / "run"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("checkpoints"))
    (copy / "batches.jsonl").unlink()
    code, out2, err = cli(capsys, "spike", str(copy), "--step", str(SPIKE_STEP), "--no-replay")
    assert code == 0 and out2.replace(str(copy), str(run)) == out, err
    for args, words in [
        ([str(copy), "--step", "3", "--no-replay"], "no batches.jsonl"),
        ([str(run), "--step", "99", "--no-replay"], "step 99 is out of range"),
        ([str(run), "--step", "0"], "steps count from 1"),
        ([str(run), "--step", "2"], "no verified checkpoint at or before step 1"),
        ([str(tmp_path), "--step", "2"], "not a run dir"),
    ]:
        code, _, err = cli(capsys, "spike", *args)
        assert code == 2 and words in err and err.count("\n") == 2, (args, err)


def test_history_takes_the_oldest_checkpoint_when_none_is_old_enough(planted, tmp_path):
    """--history 8 before step 13 with only steps 8, 10 and 12 kept: replay from step 8 (4 steps
    of history), not from step 12 (none), which the newest-first fallback gave."""
    from mspretrain.forensics.replay import history_checkpoint

    run, _, _ = planted
    assert history_checkpoint(run, 12, 8).name == "step_000002"  # the documented case: >= 8 steps
    copy = tmp_path / "run"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns(*[f"step_{s:06d}" for s in range(2, 8, 2)],
                                                             *[f"step_{s:06d}" for s in range(14, 25, 2)]))
    assert history_checkpoint(copy, 13, 8).name == "step_000008"
