"""`prepare` killed with SIGKILL at unit boundaries of every stage, then run again with the same
command: the data dir must be byte-identical to an uninterrupted run's (the manifest holds no
timestamps, so it is compared whole). A different command or changed inputs against the
half-done work dir are refused in one line, and the work dir is left as it was.

The kill points come from the progress lines of the uninterrupted run
(`MSPRETRAIN_PREPARE_TEST_POINTS`); `MSPRETRAIN_PREPARE_TEST_KILL` makes prepare SIGKILL itself at
one of them, and `MSPRETRAIN_PREPARE_COMMIT_SECONDS=0` commits after every unit, so a kill lands
after a unit's data was written and before its commit (the torn tail a resume must cut off).
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.prepare import PREPARE_ARGS, PREPARE_TEST_ENV, chosen, files_of, killed_then_rerun, make_corpus, points_of
from tests.helpers.prepare import prepare_subprocess as run

ROOT = Path(__file__).resolve().parents[2]


def digest(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, dict[str, bytes], list[str]]:
    """An uninterrupted run: its files, and the unit boundaries it passed (its progress lines)."""
    root = tmp_path_factory.mktemp("resume")
    raw = make_corpus(root / "raw")
    p = run(raw, root / "ref", env={"MSPRETRAIN_PREPARE_TEST_POINTS": "1"})
    assert p.returncode == 0, p.stderr
    points = [ln.split(": ", 1)[1] for ln in p.stderr.splitlines() if ln.startswith("prepare-point: ")]
    return raw, files_of(root / "ref"), points




# cleaning, dedup (resolve, then the replay: counts and the tokenizer sample), tokenizer training,
# encoding (per chunk, in the workers), finalizing the shards, publishing
STAGES = ["pass1 chunk", "dedup part", "dedup resolved", "replay", "trained", "encode", "finalized train", "publish"]


@pytest.mark.sigkill
@pytest.mark.parametrize("stage", STAGES)
def test_kill_and_rerun_is_byte_identical(reference, tmp_path, stage):
    raw, want, points = reference
    at = chosen(points, stage)
    out = tmp_path / "data"
    killed = run(raw, out, env={"MSPRETRAIN_PREPARE_TEST_KILL": at, "MSPRETRAIN_PREPARE_COMMIT_SECONDS": "0"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert (tmp_path / ".data.progress.json").is_file() and not (out / "manifest.json").exists()
    again = run(raw, out, workers=1)  # --workers is not part of the command's identity: the output is the same
    assert again.returncode == 0, again.stderr
    assert files_of(out) == want
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]  # no journal, no work dir left


@pytest.mark.sigkill
def test_external_kill_during_cleaning_with_time_based_commits(reference, tmp_path):
    """A SIGKILL from outside, wherever it lands after the first progress line of pass 1, with
    the default commit interval (no commit before the kill: pass 1 starts again). Should the
    kill come too late, the run's own kill at its last unit boundary stands in for it."""
    raw, want, points = reference
    out = tmp_path / "data"
    e = {k: v for k, v in os.environ.items() if k not in PREPARE_TEST_ENV}
    # The whole run after "pass1 chunk 2" takes ~0.15 s here: a kill sent that late on a loaded
    # machine found it finished (exit 0). The run kills itself at its last unit boundary if the
    # kill from outside has not landed by then, so it never finishes; either kill must resume.
    e.update(PYTHONPATH=str(ROOT), GLOG_v="3", MSPRETRAIN_PREPARE_TEST_POINTS="1", MSPRETRAIN_PREPARE_TEST_KILL=points[-1])
    cmd = [sys.executable, "-m", "mspretrain.cli", "prepare", str(raw), "--out", str(out), "--workers", "2", *PREPARE_ARGS,
           "--vocab-size", "500", "--quiet"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=e, start_new_session=True)
    try:
        for line in proc.stderr:
            if line.startswith("prepare-point: pass1 chunk 2"):
                os.killpg(proc.pid, signal.SIGKILL)
                break
        proc.wait(timeout=300)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    again = run(raw, out)
    assert again.returncode == 0, again.stderr
    assert files_of(out) == want


@pytest.mark.sigkill
def test_other_command_or_inputs_against_a_half_done_work_dir_are_refused(reference, tmp_path):
    raw0, want, _ = reference
    raw = tmp_path / "raw"
    raw.mkdir()
    for p in raw0.iterdir():
        (raw / p.name).write_bytes(p.read_bytes())
        os.utime(raw / p.name, ns=(p.stat().st_atime_ns, p.stat().st_mtime_ns))
    out = tmp_path / "data"
    work, journal = tmp_path / ".data.partial", tmp_path / ".data.progress.json"
    killed = run(raw, out, env={"MSPRETRAIN_PREPARE_TEST_KILL": "replay 2"})
    assert killed.returncode == -signal.SIGKILL
    before = {**digest(work), "journal": hashlib.sha256(journal.read_bytes()).hexdigest()}

    def refused(p: subprocess.CompletedProcess, what: str) -> None:
        lines = p.stderr.strip().splitlines()
        assert p.returncode == 2 and len(lines) == 2, p.stderr
        assert lines[0].startswith("error: ") and what in lines[0] and lines[1].startswith("hint: ")
        assert "rerun the original command" in lines[1] and str(work) in lines[1]
        assert {**digest(work), "journal": hashlib.sha256(journal.read_bytes()).hexdigest()} == before
        assert not out.exists()

    refused(run(raw, out, "--vocab-size", "600"), "prepare.vocab_size was 500, now 600")
    refused(run(raw, out, "prepare.min_chars=3"), "prepare.min_chars")
    f = raw / "p2.txt"
    stat = f.stat()
    f.write_bytes(f.read_bytes() + "新的一行诗句在这里\n".encode())
    refused(run(raw, out), "input file")
    f.write_bytes(f.read_bytes()[: stat.st_size])
    os.utime(f, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    (raw / "t.txt").write_text("多了一个文件\n", encoding="utf-8")
    refused(run(raw, out), "files")
    (raw / "t.txt").unlink()
    # the original command and inputs again: resumed, and the same bytes as the uninterrupted run
    again = run(raw, out)
    assert again.returncode == 0, again.stderr
    got = files_of(out)
    manifest = json.loads(got.pop("manifest.json"))
    ref = json.loads(want["manifest.json"])
    assert {k: v for k, v in got.items()} == {k: v for k, v in want.items() if k != "manifest.json"}
    # the inputs live in another dir here: only their names in the manifest differ
    assert json.dumps(manifest).replace(str(raw), "RAW") == json.dumps(ref).replace(str(raw0), "RAW")


@pytest.mark.sigkill
@pytest.mark.parametrize("stage", ["pass1 chunk", "replay", "finalized train"])
def test_kill_with_a_given_tokenizer_is_byte_identical(reference, tmp_path, stage):
    """One pass: the workers clean and tokenize, the replay writes the shards (no pass 2)."""
    raw, want, _ = reference
    tok = tmp_path / "tokenizer.model"
    tok.write_bytes(want["tokenizer.model"])
    extra = ("--tokenizer", str(tok))
    ref = run(raw, tmp_path / "ref", *extra, env={"MSPRETRAIN_PREPARE_TEST_POINTS": "1"})
    assert ref.returncode == 0, ref.stderr
    at = chosen([ln.split(": ", 1)[1] for ln in ref.stderr.splitlines() if ln.startswith("prepare-point: ")], stage)
    out = tmp_path / "data"
    killed = run(raw, out, *extra, env={"MSPRETRAIN_PREPARE_TEST_KILL": at, "MSPRETRAIN_PREPARE_COMMIT_SECONDS": "0"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    again = run(raw, out, *extra, workers=1)
    assert again.returncode == 0, again.stderr
    assert files_of(out) == files_of(tmp_path / "ref")




@pytest.mark.sigkill
@pytest.mark.parametrize("valid", ["0.1", "0.0001"])
def test_a_killed_replay_resumes_after_its_last_committed_chunk(reference, tmp_path, valid):
    """With a given tokenizer and local workers the replay commits per chunk: killed in its middle
    (or, valid 0.0001, after its last chunk, while it moves a train document to the empty valid
    split), the rerun places only the chunks after the commit, and the bytes are the same."""
    raw, want, _ = reference
    tok = tmp_path / "tokenizer.model"
    tok.write_bytes(want["tokenizer.model"])
    extra = ("--tokenizer", str(tok), "--valid-fraction", valid)
    ref = run(raw, tmp_path / "ref", *extra, env={"MSPRETRAIN_PREPARE_TEST_POINTS": "1"})
    assert ref.returncode == 0, ref.stderr
    replays = [p for p in points_of(ref) if p.startswith("replay ") and p != "replay moved"]
    assert len(replays) >= 4, replays  # a multi-chunk replay
    at = "replay moved" if valid == "0.0001" else replays[len(replays) // 2]
    assert at in points_of(ref)
    out = tmp_path / "data"
    got = killed_then_rerun(raw, out, at, *extra)
    assert files_of(out) == files_of(tmp_path / "ref")
    redone = [p for p in got if p.startswith("replay ") and p != "replay moved"]
    # the chunk killed before its commit is the only one placed again (none after the last chunk)
    assert redone == ([] if at == "replay moved" else replays[replays.index(at):]), redone
    assert not any(p.startswith("pass1") for p in got)


@pytest.mark.sigkill
@pytest.mark.parametrize("through_main", [False, True], ids=["pieces", "through main"])
@pytest.mark.parametrize("sample", [None, "3000"])
def test_a_killed_replay_of_a_trained_tokenizer_run_resumes_after_its_last_committed_chunk(reference, tmp_path, sample,
                                                                                          through_main):
    """The replay of a trained-tokenizer run, which chooses the tokenizer sample: through the main
    process (documents through `Sink.take`, the sample's texts in its log) or from pass 1's chunk
    files (`stage_replay.ReplaySample`: the sample as references, its heap saved per commit). Killed in its
    middle, the rerun takes only the chunks after the commit and trains the same tokenizer. A
    3,000-character sample makes documents leave the sample as others come; by default every
    document stays in it. Both paths give the uninterrupted run's bytes (the reference ran the
    per-chunk path)."""
    raw, want, points = reference
    extra = () if sample is None else (f"prepare.tokenizer_sample_chars={sample}",)
    if sample is not None:
        ref = run(raw, tmp_path / "ref", *extra, env={"MSPRETRAIN_PREPARE_TEST_POINTS": "1"})
        assert ref.returncode == 0, ref.stderr
        want, points = files_of(tmp_path / "ref"), points_of(ref)
    replays = [p for p in points if p.startswith("replay ")]
    assert len(replays) >= 4, replays
    at = replays[len(replays) // 2]
    out = tmp_path / "data"
    got = killed_then_rerun(raw, out, at, *extra, through_main=through_main)
    assert files_of(out) == want
    assert [p for p in got if p.startswith("replay ")] == replays[replays.index(at):]
    assert not any(p.startswith("pass1") for p in got)


@pytest.mark.sigkill
@pytest.mark.parametrize("valid", ["0.1", "0.0001"])
def test_a_killed_encode_of_a_trained_tokenizer_run_resumes_after_its_last_committed_chunk(reference, tmp_path, valid):
    """The encode stage of a trained-tokenizer run with pass 1's chunks in files (the workers
    encode each chunk's kept texts and place its pieces): killed in its middle (or, valid 0.0001,
    after its last chunk, while it moves a train document to the empty valid split), the rerun
    encodes only the chunks after the commit, trains nothing again, and the bytes are the same."""
    raw, want, points = reference
    extra = ("--valid-fraction", valid, "prepare.tokenizer_sample_chars=3000")
    ref = run(raw, tmp_path / "ref", *extra, env={"MSPRETRAIN_PREPARE_TEST_POINTS": "1"})
    assert ref.returncode == 0, ref.stderr
    encodes = [p for p in points_of(ref) if p.startswith("encode ") and p != "encode moved"]
    assert len(encodes) >= 4, encodes
    at = "encode moved" if valid == "0.0001" else encodes[len(encodes) // 2]
    assert at in points_of(ref)
    out = tmp_path / "data"
    got = killed_then_rerun(raw, out, at, *extra)
    assert files_of(out) == files_of(tmp_path / "ref")
    assert [p for p in got if p.startswith("encode ") and p != "encode moved"] == (
        [] if at == "encode moved" else encodes[encodes.index(at):])
    assert not any(p.startswith(("pass1", "replay", "trained")) for p in got)


@pytest.mark.sigkill
def test_a_killed_dedup_sorts_again_only_the_undecided_partitions(reference, tmp_path):
    """Each dedup partition's result is saved as it comes: killed after the first, the rerun
    sorts only the others (its points name them; no cleaning again) and the bytes are the same."""
    raw, want, points = reference
    parts = [p for p in points if p.startswith("dedup part ")]
    assert len(parts) >= 2, points  # exact and band partitions (near dedup is on)
    out = tmp_path / "data"
    killed = run(raw, out, env={"MSPRETRAIN_PREPARE_TEST_KILL": parts[0]})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    again = run(raw, out, workers=1, env={"MSPRETRAIN_PREPARE_TEST_POINTS": "1"})
    assert again.returncode == 0, again.stderr
    assert files_of(out) == want
    got = points_of(again)
    assert [p for p in got if p.startswith("dedup part ")] == parts[1:]
    assert not any(p.startswith("pass1") for p in got)


@pytest.mark.parametrize("renamed", [(), (".bin",), (".bin", ".idx")])
def test_a_shard_writer_finishes_after_a_kill_inside_finalize(tmp_path, renamed):
    """`finalize` killed after the index was written and some of its renames were made:
    `finish_resumed` from the committed state gives the files an uninterrupted finalize gives."""
    import numpy as np

    from mspretrain.data.shards import ShardWriter

    docs = [np.arange(n, dtype=np.int64) + n for n in (3, 1, 7, 2)]
    ref = ShardWriter(tmp_path / "ref", np.uint16)
    ref.add_many(docs)
    ref.finalize(fsync=False)
    w = ShardWriter(tmp_path / "s", np.uint16)
    w.add_many(docs[:3])
    state = dict(w.state())
    w.add_many(docs[3:])  # after the commit: must not survive
    w.close()
    assert ShardWriter.finish_resumed(tmp_path / "s", np.uint16, state, fsync=False) is not None
    short = ShardWriter(tmp_path / "short", np.uint16)
    short.add_many(docs[:3])
    short.finalize(fsync=False)
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"s{ext}").read_bytes() == (tmp_path / f"short{ext}").read_bytes()
    # a kill inside a later finalize of that same state: some renames made, the length file kept
    (tmp_path / "s.len.tmp").write_bytes(np.array([3, 1, 7], dtype=np.int32).tobytes())
    for ext in (".bin", ".idx"):
        if ext not in renamed:
            (tmp_path / f"s{ext}").rename(tmp_path / f"s{ext}.tmp")
    assert ShardWriter.finish_resumed(tmp_path / "s", np.uint16, state, fsync=False) is not None
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"s{ext}").read_bytes() == (tmp_path / f"short{ext}").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("s.")) == ["s.bin", "s.idx"]
    # finished: nothing left to do
    assert ShardWriter.finish_resumed(tmp_path / "s", np.uint16, state, fsync=False) is None


def test_the_refusal_names_the_first_difference(tmp_path):
    from mspretrain.config.schema import PrepareConfig
    from mspretrain.prepare.resume import difference, fingerprint

    f = tmp_path / "a.txt"
    f.write_text("一二三\n", encoding="utf-8")
    base = fingerprint(["in"], [f], ["in/a.txt"], PrepareConfig(), ("tok.model", "aa"), None)
    assert difference(base, fingerprint(["in"], [f], ["in/a.txt"], PrepareConfig(), ("tok.model", "aa"), None)) is None
    cases = [
        (fingerprint(["in"], [f], ["in/a.txt"], PrepareConfig(min_chars=3), ("tok.model", "aa"), None), "prepare.min_chars was"),
        (fingerprint(["in"], [f], ["in/a.txt"], PrepareConfig(), ("tok.model", "bb"), None), "the tokenizer tok.model changed"),
        (fingerprint(["in"], [f], ["in/a.txt"], PrepareConfig(), ("tok.model", "aa"), 64), "--seq-len was null, now 64"),
        (fingerprint(["in2"], [f], ["in/a.txt"], PrepareConfig(), ("tok.model", "aa"), None), "INPUT was"),
        (fingerprint(["in"], [f], ["in/b.txt"], PrepareConfig(), ("tok.model", "aa"), None), "input file in/a.txt is now in/b.txt"),
    ]
    for fp, want in cases:
        assert want in difference(base, fp)
    f.write_text("一二三四\n", encoding="utf-8")
    assert "input file in/a.txt changed (size" in difference(base, fingerprint(["in"], [f], ["in/a.txt"], PrepareConfig(),
                                                                               ("tok.model", "aa"), None))


@pytest.mark.sigkill
def test_kill_inside_a_file_by_file_publish_starts_over_and_keeps_your_files(reference, tmp_path):
    """`--overwrite` into a data dir that holds a file of yours publishes file by file; a kill
    after some files moved cannot be resumed from the work dir (it is half empty): the rerun
    says so, builds it again, and the result is the uninterrupted one, with your file kept."""
    raw, want, _ = reference
    out = tmp_path / "data"
    assert run(raw, out).returncode == 0
    (out / "notes.txt").write_text("mine", encoding="utf-8")
    code = ("import os, sys\nfrom pathlib import Path\nfrom mspretrain.prepare import publish\nfrom mspretrain.cli import main\n"
            "real, n = publish.os.replace, [0]\n"
            "def replace(a, b):\n    n[0] += Path(b).parent.name == 'data'\n    if n[0] == 3:\n        os._exit(9)\n    real(a, b)\n"
            "publish.os.replace = replace\nsys.exit(main(sys.argv[1:]))\n")
    args = ["prepare", str(raw), "--out", str(out), "--workers", "2", *PREPARE_ARGS, "--vocab-size", "500", "--overwrite", "--quiet"]
    e = {k: v for k, v in os.environ.items() if k not in PREPARE_TEST_ENV}
    e.update(PYTHONPATH=str(ROOT), GLOG_v="3")
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=e, timeout=300)
    assert r.returncode == 9, r.stderr
    again = run(raw, out, "--overwrite")
    assert again.returncode == 0, again.stderr
    got = files_of(out)
    assert got.pop("notes.txt") == b"mine" and got == want
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]


@pytest.mark.sigkill
def test_a_work_dir_damaged_after_the_kill_is_refused_in_one_line_then_started_over(reference, tmp_path):
    """A shard file that lost committed bytes after the kill is not padded with zeros (which
    would pass for tokens): the rerun stops with one line, and the next run starts over."""
    raw, want, points = reference
    out = tmp_path / "data"
    killed = run(raw, out, env={"MSPRETRAIN_PREPARE_TEST_KILL": chosen(points, "encode"), "MSPRETRAIN_PREPARE_COMMIT_SECONDS": "0"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    journal = json.loads((tmp_path / ".data.progress.json").read_text())
    assert journal["stage"] == "encode" and journal["encode"]["writers"]["train"]["tokens"] > 0
    (tmp_path / ".data.partial" / "train.bin.tmp").write_bytes(b"")  # lost
    again = run(raw, out)
    assert again.returncode == 2
    lines = again.stderr.strip().splitlines()
    assert len(lines) == 2 and "fewer than" in lines[0] and "damaged" in lines[0] and lines[1].startswith("hint:"), again.stderr
    assert "Traceback" not in again.stderr
    third = run(raw, out)
    assert third.returncode == 0, third.stderr
    assert files_of(out) == want


@pytest.mark.sigkill
def test_a_worker_killed_mid_run_ends_prepare_in_one_line_and_the_rerun_resumes(reference, tmp_path):
    """A pool worker SIGKILLed (the out-of-memory killer's way) while it holds a work item: CPython's
    pool would replace it and wait for that item forever. prepare ends in one line, exit 2, and the
    same command resumes to the uninterrupted run's bytes."""
    raw, want, _ = reference
    out = tmp_path / "data"
    died = run(raw, out, env={"MSPRETRAIN_PREPARE_TEST_WORKER_KILL": "3", "MSPRETRAIN_PREPARE_COMMIT_SECONDS": "0"})
    assert died.returncode == 2, died.stderr
    err = died.stderr.strip().splitlines()
    assert err[0].startswith("error: a prepare worker process (pid ") and "killed by signal 9" in err[0], died.stderr
    assert "run the same command again" in died.stderr and "Traceback" not in died.stderr
    assert not (out / "manifest.json").exists() and (tmp_path / ".data.progress.json").is_file()  # kept, as after a kill -9
    again = run(raw, out)
    assert again.returncode == 0, again.stderr
    assert files_of(out) == want
