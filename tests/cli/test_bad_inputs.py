"""Bad inputs: nothing the user has is ever lost, and no input crashes a command.

Every refusal goes through `mspretrain.cli.main` and must be exactly one `error:` line plus one
`hint:` line, exit code 2, no traceback, and must leave the user's files byte for byte as they
were. (The run-dir lock and the all-checkpoints-corrupt refusal are in test_lock.py; the
safetensors / config.json fuzzing is in test_fuzz_readers.py. Refusals that must leave a run dir or an
output dir exactly as it was are in test_refusals.py and test_outputs.py.)

The inputs: prepare --overwrite and report --out on what they did not write, config floats,
the data dir's tokenizer and ids, crashes that become one line, resource bombs, messages that
say what happened, numbers that cannot run, and run files that are special files; then every numeric flag of every command, every
integer config key, hostile sizes, and special files where a command reads a path."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import shutil
from pathlib import Path

import numpy as np
import pytest

from mspretrain.cli import main
from mspretrain.config import schema as cfgmod
from mspretrain.config.sections.base import hints
from mspretrain.errors import UserError
from tests.conftest import ROOT, TINY, make_poems
from tests.helpers.cli import cli, refused


def tree(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


# --------------------------------------------------------------------------- prepare --overwrite

PREP = ["--vocab-size", "400", "--workers", "1", "--quiet", "prepare.valid_fraction=0.1", "prepare.min_chars=4"]


@pytest.fixture(scope="module")
def poems_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("poems")
    (d / "a.txt").write_text("\n\n".join(make_poems(150, seed=11)) + "\n", encoding="utf-8")
    return d


@pytest.fixture(scope="module")
def prepared(poems_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("prep") / "data"
    assert main(["prepare", str(poems_dir), "--out", str(out), *PREP]) == 0
    return out


def test_prepare_manifest_lists_its_outputs(prepared):
    m = json.loads((prepared / "manifest.json").read_text())
    assert sorted(m["outputs"]) == sorted(p.name for p in prepared.iterdir())


@pytest.mark.parametrize("where", ["file", "dir", "glob", "out_itself"])
def test_prepare_refuses_inputs_inside_out(prepared, poems_dir, tmp_path, capsys, where):
    out = tmp_path / "data"
    shutil.copytree(prepared, out)
    (out / "sub").mkdir()
    shutil.copy(poems_dir / "a.txt", out / "sub" / "corpus.txt")
    before = tree(out)
    arg = {"file": out / "sub" / "corpus.txt", "dir": out / "sub", "glob": f"{out}/**/*.txt", "out_itself": out}[where]
    err = refused(capsys, "prepare", arg, "--out", out, "--overwrite", *PREP)
    assert "inside --out" in err
    assert tree(out) == before


def test_prepare_overwrite_replaces_only_what_prepare_wrote(prepared, poems_dir, tmp_path, capsys):
    out = tmp_path / "data"
    shutil.copytree(prepared, out)
    (out / "notes.md").write_text("my notes", encoding="utf-8")
    (out / "runs").mkdir()
    (out / "runs" / "keep.bin").write_bytes(b"\x00\x01")
    (out / "train.bin").write_bytes(b"garbage")  # listed in the manifest: prepare's to replace
    assert main(["prepare", str(poems_dir), "--out", str(out), "--overwrite", *PREP]) == 0
    assert (out / "notes.md").read_text(encoding="utf-8") == "my notes"
    assert (out / "runs" / "keep.bin").read_bytes() == b"\x00\x01"
    assert (out / "train.bin").read_bytes() == (prepared / "train.bin").read_bytes()
    assert json.loads((out / "manifest.json").read_text()) == json.loads((prepared / "manifest.json").read_text())
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no .partial / .old left


@pytest.mark.parametrize("case", ["unlisted_name", "no_manifest", "bad_manifest", "out_is_file"])
def test_prepare_overwrite_refuses_to_replace_a_file_it_did_not_write(prepared, poems_dir, tmp_path, capsys, case):
    out = tmp_path / "data"
    if case == "out_is_file":
        out.write_text("a file", encoding="utf-8")
        before = {"": out.read_bytes()}
    else:
        shutil.copytree(prepared, out)
        if case == "unlisted_name":  # a name prepare could write, but the manifest does not list it
            (out / "tokenizer.json").write_text("{\"mine\": 1}", encoding="utf-8")
        elif case == "no_manifest":
            (out / "manifest.json").unlink()
        else:
            (out / "manifest.json").write_text("{not json", encoding="utf-8")
        before = tree(out)
    refused(capsys, "prepare", poems_dir, "--out", out, "--overwrite", *PREP)
    assert (tree(out) if out.is_dir() else {"": out.read_bytes()}) == before


# --------------------------------------------------------------------------- report --out

@pytest.fixture
def run_dir(tmp_path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text("[train]\nmax_steps = 3\n", encoding="utf-8")
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 5.0 - s}) + "\n" for s in (1, 2, 3)))
    return run


@pytest.mark.parametrize("target", ["config.toml", "metrics.jsonl", "other.html", "dir"])
def test_report_out_never_replaces_a_file_it_did_not_write(run_dir, tmp_path, capsys, target):
    if target == "other.html":
        out = tmp_path / "other.html"
        out.write_text("<html><title>my page</title></html>", encoding="utf-8")
    elif target == "dir":
        out = tmp_path / "somedir"
        out.mkdir()
    else:
        out = run_dir / target
    before = tree(tmp_path)
    refused(capsys, "report", run_dir, "--out", out)
    assert tree(tmp_path) == before


def test_report_out_writes_new_files_and_replaces_earlier_reports(run_dir, tmp_path, capsys):
    out = tmp_path / "r.html"
    assert main(["report", str(run_dir), "--out", str(out)]) == 0
    first = out.read_bytes()
    assert b"<title>mspretrain report" in first
    assert main(["report", str(run_dir), "--out", str(out)]) == 0  # an earlier report: replaced
    assert b"<title>mspretrain report" in out.read_bytes()
    assert main(["report", str(run_dir)]) == 0  # the default place, twice
    assert main(["report", str(run_dir)]) == 0
    assert not [p for p in tmp_path.rglob(".*.tmp")]


# --------------------------------------------------------------------------- config floats

def _float_keys() -> list[str]:
    """Every float key of the schema, including keys added after this test was written."""
    from dataclasses import fields

    from mspretrain.config.schema import Config

    base = Config()
    return [f"{s.name}.{f.name}" for s in fields(Config) for f in fields(getattr(base, s.name))
            if isinstance(getattr(getattr(base, s.name), f.name), float)]


def test_every_float_key_refuses_nan_and_inf():
    from mspretrain.config import schema as cfgmod
    from mspretrain.errors import UserError

    keys = _float_keys()
    assert {"optim.weight_decay", "optim.z_loss", "optim.grad_clip", "spike.threshold", "model.rope_theta",
            "device.peak_tflops"} <= set(keys)
    for key in keys:
        for bad in ("nan", "inf", "-inf"):
            with pytest.raises(UserError) as exc:  # each section checks itself when it is loaded
                cfgmod.load(None, [f"{key}={bad}", "train.max_steps=10"])
            assert key in exc.value.cause, (key, bad, exc.value.cause)


@pytest.mark.parametrize("override", ["optim.weight_decay=-0.1", "optim.z_loss=-1e-4", "optim.grad_clip=-1",
                                      "spike.threshold=-0.3", "spike.grad_norm_factor=0", "model.rope_theta=-10000",
                                      "device.peak_tflops=-312", "precision.scale_warmup_to=-1", "precision.init_scale=0",
                                      "cost.price_per_device_hour=-2"])
def test_float_keys_out_of_their_range(override):
    from mspretrain.config import schema as cfgmod
    from mspretrain.errors import UserError

    with pytest.raises(UserError) as exc:
        cfgmod.validate(cfgmod.load(None, [override, "train.max_steps=10"]))
    assert override.split("=")[0] in exc.value.cause


@pytest.mark.parametrize("override", ["optim.weight_decay=nan", "optim.z_loss=inf", "spike.threshold=nan",
                                      "model.rope_theta=inf", "optim.grad_clip=nan"])
def test_train_refuses_nonfinite_config_before_touching_the_run(tiny_data, tmp_path, capsys, override):
    run = tmp_path / "run"
    refused(capsys, "train", "--config", TINY, "--data", tiny_data, "--run", run, "--quiet", override)
    assert not run.exists()


def test_nonfinite_data_source_weight(tmp_path):
    from dataclasses import replace

    from mspretrain.config import schema as cfgmod
    from mspretrain.errors import UserError

    for w in (float("nan"), float("inf"), -1.0, 0.0, True):
        cfg = cfgmod.load(None, ["train.max_steps=10"])
        with pytest.raises(UserError):  # the data section checks itself when it is built
            replace(cfg.data, sources=({"path": "a", "weight": w},))


# --------------------------------------------------------------------------- the data dir's tokenizer and ids

def _data_copy(tiny_data: Path, tmp_path: Path) -> Path:
    d = tmp_path / "data"
    shutil.copytree(tiny_data, d)
    return d


def _train_refused(capsys, data: Path, tmp_path: Path) -> str:
    run = tmp_path / "run"
    err = refused(capsys, "train", "--config", TINY, "--data", data, "--run", run, "--quiet", "train.max_steps=3")
    assert not run.exists()
    return err


def test_replaced_tokenizer_of_the_same_size_is_refused(tiny_data, poems_dir, tmp_path, capsys):
    d = _data_copy(tiny_data, tmp_path)
    other = tmp_path / "other"  # another tokenizer with the same vocabulary size, trained on other text
    vocab = json.loads((d / "manifest.json").read_text())["vocab_size"]
    assert main(["prepare", str(poems_dir), "--out", str(other), "--vocab-size", str(vocab), "--workers", "1", "--quiet",
                 "prepare.min_chars=4"]) == 0
    assert (other / "tokenizer.model").read_bytes() != (d / "tokenizer.model").read_bytes()
    shutil.copy(other / "tokenizer.model", d / "tokenizer.model")
    assert "SHA-256" in _train_refused(capsys, d, tmp_path)


@pytest.mark.parametrize("vocab", [100, 300, 1])
def test_edited_manifest_vocab_below_the_ids_is_refused(tiny_data, tmp_path, capsys, vocab):
    from mspretrain.data.manifest import check_data_dir
    from mspretrain.errors import UserError

    d = _data_copy(tiny_data, tmp_path)
    m = json.loads((d / "manifest.json").read_text())
    m["vocab_size"] = vocab
    (d / "manifest.json").write_text(json.dumps(m))
    (d / "tokenizer.model").unlink()  # so the check that fires is the shards' largest id
    err = _train_refused(capsys, d, tmp_path)
    assert "token id" in err and f"vocab_size {vocab}" in err
    with pytest.raises(UserError):
        check_data_dir(d, m)


def test_edited_manifest_vocab_disagreeing_with_the_tokenizer(tiny_data, tmp_path, capsys):
    d = _data_copy(tiny_data, tmp_path)
    m = json.loads((d / "manifest.json").read_text())
    m["vocab_size"] += 7  # above every id, so only the tokenizer comparison can catch it
    (d / "manifest.json").write_text(json.dumps(m))
    assert "pieces" in _train_refused(capsys, d, tmp_path)


def test_intact_data_dir_passes_the_check(tiny_data):
    from mspretrain.data.manifest import check_data_dir, read_manifest

    check_data_dir(tiny_data, read_manifest(tiny_data))


# --------------------------------------------------------------------------- crashes become one line

def test_prepare_file_too_large_is_one_line_and_publishes_nothing(poems_dir, tmp_path):
    """EFBIG for real: RLIMIT_FSIZE in a child process (SIGXFSZ ignored, so write() fails)."""
    import subprocess
    import sys

    code = ("import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
            "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096)); "
            "from mspretrain.cli import main; sys.exit(main(sys.argv[1:]))")
    out = tmp_path / "data"
    # -B: with RLIMIT_FSIZE a first import would write .pyc files cut at 4096 bytes (CPython does not
    # check the length of that write), and every later import of those modules fails
    r = subprocess.run([sys.executable, "-B", "-c", code, "prepare", str(poems_dir), "--out", str(out), *PREP],
                       cwd=ROOT, capture_output=True, text=True, env={"GLOG_v": "3", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("error: ") and "File too large" in lines[0], r.stderr
    assert lines[1].startswith("hint: ") and "Traceback" not in r.stderr
    assert not out.exists() and not any(p.name.startswith(".") for p in tmp_path.iterdir())


@pytest.mark.parametrize("err", ["ENOSPC", "EDQUOT", "EROFS"])
def test_prepare_disk_errors_are_one_line(poems_dir, tmp_path, capsys, monkeypatch, err):
    import errno
    import os

    from mspretrain.data.shards import ShardWriter
    from mspretrain.prepare.sink import Sink

    code = getattr(errno, err)
    calls = []

    def full(self, *a, **k):
        calls.append(1)
        raise OSError(code, os.strerror(code), str(tmp_path / ".data.partial" / "train.bin"))

    # where the shards grow: the replay through the sink, or the places the per-chunk path reserves
    monkeypatch.setattr(Sink, "take", full)
    monkeypatch.setattr(ShardWriter, "reserve", full)
    out = tmp_path / "data"
    assert os.strerror(code) in refused(capsys, "prepare", poems_dir, "--out", out, *PREP)
    assert calls  # the error came from a write, not from something earlier
    assert not out.exists() and not (tmp_path / ".data.partial").exists()


@pytest.mark.parametrize("edit", ["bytes_str", "sha_int", "files_list", "step_str", "manifest_list", "name_escapes", "entry_null"])
def test_malformed_checkpoint_manifest_is_a_corrupt_checkpoint(reference_run, tmp_path, capsys, edit):
    from mspretrain.checkpoint import store

    run = tmp_path / "run"
    shutil.copytree(reference_run, run)
    newest = store.list_checkpoints(run)[-1][1]
    mpath = newest / "manifest.json"
    m = json.loads(mpath.read_text())
    if edit == "bytes_str":
        m["files"]["model.safetensors"]["bytes"] = "123"
    elif edit == "sha_int":
        m["files"]["config.toml"]["sha256"] = 5
    elif edit == "files_list":
        m["files"] = list(m["files"])
    elif edit == "step_str":
        m["step"] = "eight"
    elif edit == "manifest_list":
        m = [m]
    elif edit == "name_escapes":
        m["files"]["../../config.toml"] = m["files"].pop("config.toml")
    else:
        m["files"]["train_state.json"] = None
    mpath.write_text(json.dumps(m))
    reason = store.verify(newest)
    assert reason and "malformed" in reason
    # the fallback that train and eval use goes on to the previous checkpoint
    chosen = store.latest_verified(run, log=lambda s: None)
    assert chosen is not None and chosen.name < newest.name
    assert store.resolve_checkpoint(run).dir == chosen
    rc = main(["checkpoints", str(run), "--verify"])
    out, err = capsys.readouterr()
    assert rc == 1 and "Traceback" not in err and f"{newest.name}" in out and "CORRUPT: manifest.json is malformed" in out
    refused(capsys, "generate", newest, "--prompt", "春")  # the malformed dir named itself: one line


@pytest.mark.parametrize("manifest", [{}, {"documents": 5, "tokens": "many"}, {"vocab_size": "x", "inputs": 3},
                                      {"files": [1], "chars_per_token": "?", "warnings": "w"}])
def test_inspect_tolerates_manifests_lacking_keys(tiny_data, tmp_path, capsys, manifest):
    d = _data_copy(tiny_data, tmp_path)
    (d / "manifest.json").write_text(json.dumps(manifest))
    assert main(["prepare", "--inspect", str(d)]) == 0
    out = capsys.readouterr().out
    assert "data dir" in out and "[train #0" in out
    (d / "manifest.json").write_text("[1, 2]")
    refused(capsys, "prepare", "--inspect", d)


@pytest.mark.parametrize("flags", [["--temperature", "nan"], ["--temperature", "inf"], ["--repetition-penalty", "nan"],
                                   ["--repetition-penalty=-inf"], ["--top-p", "nan"]])
def test_generate_nonfinite_sampling_is_one_line(tmp_path, capsys, flags):
    run = tmp_path / "run"
    run.mkdir()
    refused(capsys, "generate", run, "--prompt", "春", *flags)


@pytest.mark.parametrize("line", ['{"step": 1, "loss": "abc"}', '{"step": 1, "loss": [1]}', '{"step": Infinity, "loss": 1}',
                                  '{"step": 1, "tokens": 1e400}', '{"step": 1e300, "loss": 2}', '{"step": 1, "mem_mb": -1e308, "lr": 1e308}',
                                  '{"step": 1, "loss": 1' + "0" * 400 + '}'])
def test_report_survives_non_numeric_metrics(run_dir, tmp_path, capsys, line):
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(line + "\n")
    assert main(["report", str(run_dir), "--out", str(tmp_path / "r.html")]) == 0
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("meta", ["{bad", "[1, 2]", '"text"', '{"world_size": "x"}', '{"hardware": 5, "data_dir": 7}'])
def test_report_survives_a_malformed_run_meta(run_dir, tmp_path, capsys, meta):
    (run_dir / "run_meta.json").write_text(meta)
    assert main(["report", str(run_dir), "--out", str(tmp_path / "r.html")]) == 0
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("overrides", [["model.max_seq_len=1000000000"], ["train.global_batch=10000000"],
                                       ["data.seq_len=200000", "model.max_seq_len=200000"], ["model.dim=65536", "model.n_heads=64"]])
def test_train_refuses_what_cannot_fit_in_memory_before_compute(tiny_data, tmp_path, capsys, overrides):
    run = tmp_path / "run"
    err = refused(capsys, "train", "--config", TINY, "--data", tiny_data, "--run", run, "--quiet", "train.max_steps=3", *overrides)
    assert "GB of memory" in err and "plan" in err


def test_fits_refuses_above_physical_and_warns_above_available(tiny_cfg):
    from dataclasses import replace

    from mspretrain.config.schema import resolve_model
    from mspretrain.errors import UserError
    from mspretrain.preflight.fits import GB, check_fits, estimate_bytes

    cfg = replace(tiny_cfg, model=resolve_model(tiny_cfg.model, 512))
    need = estimate_bytes(cfg, 1)
    said: list[str] = []
    check_fits(cfg, 1, "cpu", log=said.append, memory=(64 * GB, 32 * GB))
    assert not said
    check_fits(cfg, 1, "cpu", log=said.append, memory=(64 * GB, need - 1))
    assert said and said[0].startswith("warning:")
    with pytest.raises(UserError):
        check_fits(cfg, 1, "cpu", log=said.append, memory=(need - 1, None))
    check_fits(cfg, 1, "ascend", memory=(1, 1))  # host RAM is not the limit on Ascend


def test_fits_counts_every_rank_on_this_host(tiny_cfg):
    """Two msrun ranks on one CPU host each build the model: the host needs twice one process."""
    from dataclasses import replace

    from mspretrain.config.schema import resolve_model
    from mspretrain.errors import UserError
    from mspretrain.preflight.fits import LOCAL_RANKS_ENV, check_fits, estimate_bytes, local_ranks

    cfg = replace(tiny_cfg, model=resolve_model(tiny_cfg.model, 512))
    one = estimate_bytes(cfg, 2)
    check_fits(cfg, 2, "cpu", memory=(2 * one + 1, None), local=2)
    with pytest.raises(UserError, match="2 ranks on this host"):
        check_fits(cfg, 2, "cpu", memory=(2 * one - 1, None), local=2)
    check_fits(cfg, 2, "cpu", memory=(2 * one - 1, None), local=1)  # the other rank is on another node
    assert local_ranks(2, {}) == 2  # a bare msrun on CPU: every rank is here
    assert local_ranks(8, {LOCAL_RANKS_ENV: "4"}) == 4  # launch --nproc 4 --nodes 2
    assert local_ranks(2, {LOCAL_RANKS_ENV: "9"}) == 2
    with pytest.raises(UserError, match=LOCAL_RANKS_ENV):  # a bad value is one line, not silently the world
        local_ranks(2, {LOCAL_RANKS_ENV: "x"})


@pytest.mark.parametrize("what", ["bin_file", "corpus_file"])
def test_data_that_is_a_file_says_so(tiny_data, tmp_path, capsys, what):
    data = tiny_data / "train.bin" if what == "bin_file" else tmp_path / "corpus.txt"
    if what == "corpus_file":
        data.write_text("春眠不觉晓", encoding="utf-8")
    err = refused(capsys, "train", "--config", TINY, "--data", data, "--run", tmp_path / "run", "--quiet", "train.max_steps=3")
    assert "is a file" in err and "does not exist" not in err


# --------------------------------------------------------------------------- resource bombs

def test_workers_are_capped_at_the_cores(poems_dir, tmp_path, capsys):
    import os

    cores = len(os.sched_getaffinity(0))
    for n in (100000, cores + 1):
        out = tmp_path / f"d{n}"
        assert main(["prepare", str(poems_dir), "--out", str(out), *[a for a in PREP if a not in ("--workers", "1", "--quiet")],
                     "--workers", str(n)]) == 0
        text = capsys.readouterr().out
        assert f"warning: --workers {n} is more than the {cores} cores" in text
        assert f"with {cores} worker" in text


def test_recursive_glob_does_not_follow_symlink_loops(tmp_path):
    import subprocess
    import sys

    d = tmp_path / "corpus" / "a"
    d.mkdir(parents=True)
    (d / "x.txt").write_text("春眠不觉晓，处处闻啼鸟。", encoding="utf-8")
    (d / "up").symlink_to("..")          # a loop through the parent
    (d / "self").symlink_to(".")         # and one onto itself
    code = ("import sys; from mspretrain.prepare.sources import discover; "
            "print([str(p) for p in discover(sys.argv[1:])])")
    r = subprocess.run([sys.executable, "-c", code, f"{tmp_path}/corpus/**/*.txt", f"{tmp_path}/corpus/*/*.txt"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert eval(r.stdout) == [str(d / "x.txt")]


def test_diagnose_streams_a_long_log_in_bounded_memory(tmp_path):
    import tracemalloc

    from mspretrain.forensics.diagnose import diagnose

    log = tmp_path / "worker_0.log"
    with open(log, "w", encoding="utf-8") as f:
        for i in range(1, 60_001):  # ~6 MB of progress lines, a step time on every one
            f.write(f"2026-12-01 08:00:00 step {i}/999999 | loss 4.{i % 97:04d} | lr 3.00e-04 | gnorm 0.{i % 89:03d} | "
                    f"{12000 + i % 999:,} tok/s | mfu 1.2% | eta 1h00m\n")
        f.write("RuntimeError: Allocate memory failed on device 0\n")
    tracemalloc.start()
    findings = diagnose(log)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert [f.kind for f in findings] == ["oom"] and findings[0].line == 60_001
    assert peak < 3 << 20, peak  # 0.5 MB of step times as floats; a tuple per line was ~20 MB


@pytest.mark.parametrize("port", ["70000", "0", "-1", "65536"])
def test_dashboard_port_out_of_range(tmp_path, capsys, port):
    refused(capsys, "dashboard", tmp_path, f"--port={port}")


# --------------------------------------------------------------------------- messages that say what happened

def _mixed_lines(n: int) -> list[tuple[str, str]]:
    utf = ["春眠不觉晓，处处闻啼鸟。", "夜来风雨声，花落知多少。", "白日依山尽，黄河入海流。"]
    gbk = ["床前明月光，疑是地上霜。", "举头望明月，低头思故乡。"]
    return [(f"{i}{gbk[i % 2]}", "gbk") if i % 3 == 0 else (f"{i}{utf[i % 3]}", "utf-8") for i in range(n)]


@pytest.mark.parametrize("bad_lines", [0, 2])
def test_a_file_mixing_gbk_and_utf8_lines_is_read_line_by_line(tmp_path, bad_lines):
    from mspretrain.prepare import sources

    lines = _mixed_lines(300)
    raw = [t.encode(enc) for t, enc in lines]
    for k in range(bad_lines):
        raw.insert(100 + k, b"\xff\xfe\x81 damaged")
    p = tmp_path / "mixed.txt"
    p.write_bytes(b"\n".join(raw) + b"\n")
    stats, warns = sources.SourceStats(), []
    docs = [d for b in sources.iter_file_batches(p, doc_per_line=True, stats=stats, warn=warns.append) for d in b]
    expected = [t for t, _ in lines]  # the reference: each line decoded with the encoding it was written in
    assert [d for d in docs if "damaged" not in d] == expected
    assert dict(stats.by_encoding) == {"utf-8+gb18030": 1} and not stats.skipped
    assert any("100 lines read as GB18030" in w for w in warns), warns
    assert any(f"{bad_lines} lines fit neither" in w for w in warns) == bool(bad_lines)


def test_prepare_reads_a_mixed_file_instead_of_calling_it_binary(tmp_path, capsys):
    p = tmp_path / "mixed.txt"
    p.write_bytes(b"\n".join(t.encode(enc) for t, enc in _mixed_lines(600)) + b"\n")
    out = tmp_path / "data"
    assert main(["prepare", str(p), "--out", str(out), "--doc-per-line", "--vocab-size", "340", "--workers", "1", "--quiet",
                 "prepare.valid_fraction=0.1", "prepare.min_chars=4"]) == 0
    m = json.loads((out / "manifest.json").read_text())
    assert m["files"]["by_encoding"] == {"utf-8+gb18030": 1} and m["documents_in"] == 600


@pytest.mark.parametrize("files", [{"a.txt": b"", "b.txt": b"\x89PNG\r\n\x1a\n" + bytes(range(256))},
                                   {"only.txt": b"\x00\x01\x02" * 100},
                                   {"x.jsonl": b"", "y.txt": b"   \n\n", "z.txt": b"%PDF-1.4 ..."}])
def test_all_inputs_skipped_says_so(tmp_path, capsys, files):
    d = tmp_path / "in"
    d.mkdir()
    for name, data in files.items():
        (d / name).write_bytes(data)
    err = refused(capsys, "prepare", d, "--out", tmp_path / "o", *PREP)
    first, hint = err.strip().splitlines()
    assert f"all {len(files)} input file" in first and "were skipped" in first and "dropped: none" not in first
    assert "--text-field" not in hint


# (a small .zst is one zstd block: cut anywhere, nothing of it decodes, so there is nothing to keep)
@pytest.mark.parametrize("suffix,n_lines", [(".gz", 300), (".gz", 30000), (".zst", 30000)])
def test_truncated_compressed_file_keeps_the_lines_before_the_damage(tmp_path, n_lines, suffix):
    import gzip

    import zstandard

    from mspretrain.prepare import sources

    lines = [f"第{i}行，春眠不觉晓，处处闻啼鸟，夜来风雨声。" for i in range(n_lines)]
    raw = ("\n".join(lines) + "\n").encode()
    comp = gzip.compress(raw) if suffix == ".gz" else zstandard.ZstdCompressor().compress(raw)
    p = tmp_path / f"t{suffix}"
    p.write_bytes(comp[: len(comp) * 2 // 3])
    stats, warns = sources.SourceStats(), []
    got: list[str] = []
    for b in sources.iter_file_batches(p, doc_per_line=True, stats=stats, warn=warns.append, raw=True):
        got += sources.decode_raw(b)[0] if isinstance(b, sources.RawLines) else b
    known = set(lines)
    whole = [g for g in got if g in known]
    assert len(whole) >= len(lines) // 3, (len(whole), len(lines))  # most of the 2/3 that is there
    assert whole == lines[:len(whole)]


def test_eval_without_a_verified_checkpoint_does_not_say_fresh_start(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "checkpoints" / "step_000010").mkdir(parents=True)  # a save that never finished
    rc = main(["eval", str(run)])
    out, err = capsys.readouterr()
    assert rc == 2 and "fresh start" not in out + err and "no verified checkpoint" in err


@pytest.mark.sigkill
def test_prepare_workers_die_with_a_killed_parent_without_tracebacks(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    def stat(pid: int) -> list[str]:
        """/proc/PID/stat after the command name, read once ([] once the process is reaped: an
        exists() then an open() raised FileNotFoundError for a worker reaped in between)."""
        try:
            return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            return []

    def alive(pids: dict[int, str]) -> list[int]:
        # not a zombie, and still the same process (its start time): not a later one given its PID
        return [c for c, started in pids.items() if (f := stat(c)) and f[0] != "Z" and f[19] == started]

    src = tmp_path / "big.txt"
    src.write_text("\n\n".join(make_poems(2000, seed=9) * 20) + "\n", encoding="utf-8")
    proc = subprocess.Popen([sys.executable, "-m", "mspretrain.cli", "prepare", str(src), "--out", str(tmp_path / "o"),
                             "--workers", "2", "--vocab-size", "400", "prepare.min_chars=4"],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, GLOG_v="3"))
    children: list[int] = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(children) < 2 and proc.poll() is None:
        try:
            children = [int(c) for c in open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()]
        except OSError:
            pass
        time.sleep(0.05)
    if len(children) < 2:
        # prepare of this input runs for many seconds with its 2 workers: not seeing them is a
        # failure (no workers, or none started in 120 s), not a reason to skip the check
        proc.kill()
        proc.wait(timeout=30)
        pytest.fail(f"prepare's 2 workers were never seen (prepare's exit code: {proc.returncode})")
    started = {c: f[19] for c in children if (f := stat(c))}
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and alive(started):
        time.sleep(0.1)
    left = alive(started)
    for c in left:  # a worker that outlived its parent holds the stderr pipe open: reading would hang
        os.kill(c, signal.SIGKILL)
    assert not left, left
    err = proc.stderr.read()
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


# --------------------------------------------------------------------------- numbers that cannot run or would allocate without bound
# (refused in one line before anything runs; no model is built)

@pytest.mark.parametrize("argv, words", [
    (["plan", "--config", str(TINY), "optim.lr=1e308"], "optim.lr = 1e+308 is above the limit"),
    (["plan", "--config", str(TINY), "optim.lr=nan"], "optim.lr"),
    (["plan", "--config", str(TINY), "model.n_layers=1e8"], "model.n_layers"),
    (["plan", "--config", str(TINY), "--tokens", "nan"], "--tokens nan"),
    (["plan", "--config", str(TINY), "--tokens", "-1"], "--tokens -1"),
    (["plan", "--config", str(TINY), "--tokens-per-s", "-5", "--tokens", "1e6"], "--tokens-per-s -5"),
    (["plan", "--config", str(TINY), "--device-mem-gb", "inf"], "--device-mem-gb inf"),
    (["eval", "no-such-run", "--batch-size", "100000000"], "--batch-size 100000000 must be between 1 and"),
    (["eval", "no-such-run", "--choices", "x.csv", "--batch-size", "100000000"], "--batch-size 100000000 must be between 1 and"),
])
def test_numbers_that_cannot_run_are_one_line(capsys, argv, words):
    code, _, err = cli(capsys, *argv)
    assert code == 2 and words in err, err
    assert err.startswith("error: ") and err.count("\n") == 2 and "Traceback" not in err


def test_device_mem_gb_wins_for_an_ascend_config(capsys):
    """--device-mem-gb was ignored for Ascend configs (the 910B's 58 GB was used): a 910B4 has 32."""
    cfg = str(ROOT / "configs" / "llama2-7b-910b.toml")
    code, out, _ = cli(capsys, "plan", "--config", cfg, "--devices", "8", "--device-mem-gb", "32", "--json")
    assert code == 0 and json.loads(out)["device_mem_gb"] == 32.0
    code, out, _ = cli(capsys, "plan", "--config", cfg, "--devices", "8", "--json")
    assert code == 0 and json.loads(out)["device_mem_gb"] != 32.0


# --------------------------------------------------------------------------- run files that are /dev/zero, a FIFO, or damaged
# (every reader command ends at once with a result or one error: / hint: pair, never past its size cap or in a hang;
# in-process against the session's `reference_run`, each case replacing one file of a copy)

FILES = ["metrics.jsonl", "train.log", "run_meta.json", "batches.jsonl", "heartbeat/rank_00000.json",
         "checkpoints/step_000003/train_state.json"]


def _commands(run: Path, out: Path) -> list[list[str]]:
    return [["report", str(run), "--out", str(out / "report")], ["diagnose", str(run)], ["audit", str(run)],
            ["spike", str(run), "--step", "2", "--no-replay"], ["recover", str(run)]]


def _max_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@pytest.mark.parametrize("name", FILES)
@pytest.mark.parametrize("kind", ["devzero", "fifo"])
def test_special_run_files_end_every_reader_in_one_line(reference_run, tmp_path, capsys, name, kind):
    run = tmp_path / "run"
    shutil.copytree(reference_run, run, symlinks=True)
    target = run / name
    target.parent.mkdir(parents=True, exist_ok=True)
    target.unlink(missing_ok=True)
    if kind == "devzero":
        target.symlink_to("/dev/zero")
    else:
        os.mkfifo(target)
    before = _max_rss_mb()
    for argv in _commands(run, tmp_path):
        code = main(argv)
        err = capsys.readouterr().err
        assert code in (0, 1, 2), (argv, code, err)
        assert "Traceback" not in err, (argv, err)
        if code == 2:
            lines = err.strip().splitlines()
            assert len(lines) == 2 and lines[0].startswith("error:") and lines[1].startswith("hint:"), (argv, err)
    assert _max_rss_mb() - before < 1024, "a reader read far past its cap"


def test_replay_refuses_a_special_metrics_file(reference_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(reference_run, run, symlinks=True)
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").symlink_to("/dev/zero")
    assert main(["replay", str(run), "--from-step", "1", "--steps", "1"]) == 2
    assert "not a regular file" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["audit", "diagnose", "recover", "checkpoints"])
def test_commands_that_read_no_config_refuse_overrides(reference_run, capsys, command):
    """Commands that read no config refuse section.key=value overrides in one line (`mspretrain --help`
    promises them only to those that take them)."""
    assert main([command, str(reference_run), "train.max_steps=5"]) == 2
    err = capsys.readouterr().err
    assert "takes no section.key=value overrides" in err and err.count("\n") == 2


def test_quickstart_creates_my_text_with_the_walkthroughs_own_lines():
    root = Path(__file__).resolve().parents[2]
    quick = (root / "docs" / "quickstart.md").read_text(encoding="utf-8")
    block = quick.split("## 1. Your own text", 1)[1].split("```bash\n", 1)[1].split("\n```", 1)[0]
    assert block.startswith("mkdir -p my-text") and block in (root / "scripts" / "walkthrough.sh").read_text(encoding="utf-8")


# =========================================================================== numbers that cannot run, hostile sizes, special files
# (each checked at the class level: every numeric flag of every command, every integer
# config key, every path a command reads). Refused in one `error:` line (exit 2) before anything runs.

def _one_line(code: int, err: str) -> None:
    """Exit 2, a first line `error: ...`, at most a hint after it, no traceback."""
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines and lines[0].startswith("error: ") and len(lines) <= 2 and "Traceback" not in err, err


# ----------------------------------------------------------------------------- numeric flags

# The smallest argv each command accepts, so that a numeric flag's value is the only thing wrong;
# the paths do not exist, so a command that does not check its numbers first names a path instead.
SKELETON = {
    "prepare": ["prepare", "no-such-corpus", "--out", "no-such-out"],
    "train": ["train", "--config", str(TINY), "--data", "no-such-data", "--run", "no-such-run"],
    "eval": ["eval", "no-such-run"],
    "generate": ["generate", "no-such-run", "--prompt", "a"],
    "tokenizer": ["tokenizer", "extend", "no-such.model", "--train", "no-such-corpus", "--out", "no-such-out"],
    "recover": ["recover", "no-such-run"],
    "average": ["average", "no-such-run", "--steps", "1"],
    "plan": ["plan", "--config", str(TINY)],
    "launch": ["launch", "--nproc", "1", "--dry-run"],
    "diagnose": ["diagnose", "no-such-run"],
    "spike": ["spike", "no-such-run", "--step", "1", "--no-replay"],
    "replay": ["replay", "no-such-run", "--from-step", "0", "--steps", "1"],
    "dashboard": ["dashboard", "no-such-run"],
    "quality": ["quality", "train", "--positive", "no-such-good", "--negative", "no-such-bad", "--out", "no-such.npz"],
}
TAIL = {"launch": ["--", "plan"]}


def _numeric_flags() -> list[tuple[str, str, bool]]:
    """(command, --flag, is_int) for every option of every command that takes a number."""
    from mspretrain.cli import COMMANDS, build_parser

    found = []
    for name in COMMANDS:
        sub = next(a for a in build_parser(name)._actions if isinstance(a, argparse._SubParsersAction)).choices[name]
        parsers = [sub]
        for a in sub._actions:  # `tokenizer extend` is a sub-subcommand
            if isinstance(a, argparse._SubParsersAction):
                parsers += list(a.choices.values())
        for p in parsers:
            for a in p._actions:
                kind = getattr(a.type, "__name__", "")
                if a.option_strings and kind in ("int", "float"):
                    found.append((name, a.option_strings[0], kind == "int"))
    return found


NUMERIC = _numeric_flags()


def test_every_numeric_flag_is_found():
    """The enumeration below is not empty by accident (a renamed type would hide every flag)."""
    assert len(NUMERIC) >= 38 and {c for c, _, _ in NUMERIC} == set(SKELETON), sorted({c for c, _, _ in NUMERIC})


@pytest.mark.parametrize("command, flag, is_int", NUMERIC, ids=[f"{c}{f}" for c, f, _ in NUMERIC])
def test_every_numeric_flag_refuses_absurd_values(capsys, command, flag, is_int):
    """Beyond 64 bits, negative, NaN, inf, 1e300: refused in one line naming the flag, before the
    command reads anything. Found by the hostile pass: `generate --seed -1` and
    `--temperature 1e-320` ended in numpy tracebacks after loading the model, `prepare
    --vocab-size 1000000000000` in a SentencePiece traceback, `launch --master-port 70000` and
    `--nproc 1000000000000` were handed to msrun, `eval --seq-len 100000000000` was accepted."""
    values = ["99999999999999999999", "-1"] if is_int else ["nan", "inf", "-1", "1e300"]
    for value in values:
        argv = [*SKELETON[command], flag, value, *TAIL.get(command, [])]
        code, _, err = cli(capsys, *argv)
        _one_line(code, err)
        assert flag in err, (argv, err)


def test_generate_refuses_bad_sampling_numbers_before_loading(capsys):
    for flag, value in (("--seed", "-1"), ("--temperature", "1e-320"), ("--seed", "18446744073709551616"),
                        ("--repetition-penalty", "1e308"), ("--top-k", "99999999999")):
        code, _, err = cli(capsys, "generate", "no-such-run", "--prompt", "a", flag, value)
        _one_line(code, err)
        assert flag in err, err


def test_sampling_survives_a_tiny_temperature_and_refuses_nan_logits():
    """The lower bound of --temperature is not what keeps sampling finite: x / 1e-4 of a logit
    range of 1e3 is still finite, and the max is taken out first."""
    from mspretrain.eval.generate import SamplingParams, sample_next

    rng = np.random.default_rng(0)
    logits = np.array([1.0, 3.0, 2.0, -1e30], np.float32)
    p = SamplingParams(temperature=1e-300, top_k=0, top_p=1.0, repetition_penalty=1.0)
    assert sample_next(logits, [], p, rng) == 1
    with pytest.raises(UserError, match="not finite"):
        sample_next(np.array([np.nan, 1.0], np.float32), [], SamplingParams(), rng)


# ----------------------------------------------------------------------------- config numbers

def _int_keys() -> list[str]:
    keys = []
    for section in cfgmod.SECTIONS:
        for f in dataclasses.fields(getattr(cfgmod.Config(), section)):
            if hints(type(getattr(cfgmod.Config(), section)))[f.name] is int:
                keys.append(f"{section}.{f.name}")
    return keys


@pytest.mark.parametrize("key", _int_keys())
def test_no_integer_key_takes_a_value_beyond_64_bits(key):
    """TOML integers are unbounded in Python: `train.max_steps=99999999999999999999` trained on
    (it never ends), seeds of 2**64 failed inside numpy after the run dir was made."""
    for value in ("99999999999999999999", "-99999999999999999999"):
        with pytest.raises(UserError) as e:
            cfgmod.load(str(TINY), [f"{key}={value}"])
        assert key in str(e.value), e.value


@pytest.mark.parametrize("override, words", [
    ("train.seed=-1", "train.seed = -1 is not a seed"),
    ("train.seed=4294967296", "train.seed = 4294967296 is not a seed"),
    ("prepare.seed=-5", "prepare.seed = -5 is not a seed"),
    ("train.max_steps=10000000000000", "train.max_steps = 1e+13 is above the limit"),
    ("train.max_tokens=1e17", "train.max_tokens = 1e+17 is above the limit"),
    ("model.head_dim=1000000000000", "model.head_dim = 1e+12 is above the limit"),
    ("model.max_seq_len=1e18", "model.max_seq_len = 1e+18 is above the limit"),
    ("model.max_seq_len=2000000000", "model.max_seq_len = 2e+09 is above the limit"),
    ("model.rope_original_max_len=1e18", "model.rope_original_max_len"),
    ("model.sliding_window=1e18", "model.sliding_window"),
    ("prepare.vocab_size=1000000000000", "prepare.vocab_size = 1e+12 is above the limit"),
    ("prepare.tokenizer_sample_chars=-1", "prepare.tokenizer_sample_chars = -1 must be positive"),
    ("eval.batch_size=100000000", "eval.batch_size = 1e+08 is above the limit"),
    ("eval.batch_size=5000", "eval.batch_size = 5000 is above the limit of 4096"),
    ("eval.choices_shots=1000000000000", "eval.choices_shots"),
    ("device.threads=100000000", "device.threads = 1e+08 is above the limit"),
    ("device.max_device_memory=1e300", "device.max_device_memory"),
    ("precision.init_scale=1e300", "precision.init_scale = 1e+300 is above the limit"),
    ("precision.max_scale=1e39", "precision.max_scale"),
    ("spike.window=1000000000000", "spike.window"),
    ("model.norm_eps=1e-300", "model.norm_eps = 1e-300 is below the floor"),
    ("optim.eps=1e-300", "optim.eps = 1e-300 is below the floor"),
    ("model.init_std=1e-300", "model.init_std = 1e-300 is below the floor"),
    ("cost.price_per_device_hour=1e300", "cost.price_per_device_hour = 1e+300 is above the limit"),
])
def test_config_numbers_that_cannot_run_are_refused(override, words):
    with pytest.raises(UserError) as e:
        cfgmod.load(str(TINY), [override])
    assert words in str(e.value), e.value


def test_plan_refuses_a_head_dim_no_device_holds(capsys):
    """`plan model.head_dim=1e12` printed 1.5 quadrillion parameters instead of refusing."""
    code, _, err = cli(capsys, "plan", "--config", str(TINY), "model.vocab_size=512", "model.head_dim=1000000000000")
    _one_line(code, err)
    assert "model.head_dim" in err


def test_the_shipped_configs_stay_inside_every_ceiling():
    """The ceilings sit far above any real model: every config the project ships still loads."""
    for path in sorted((ROOT / "configs").glob("*.toml")):
        cfgmod.load(path)


# ----------------------------------------------------------------------------- class 7: stdout on a full disk

@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize("argv", [["plan", "--config", str(TINY), "model.vocab_size=512"], ["doctor", "--json"]])
def test_output_redirected_to_a_full_disk_is_one_line(argv):
    """`mspretrain plan > plan.txt` on a full disk ended in an OSError traceback from print()."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(ROOT), "GLOG_v": "3"}
    with open("/dev/full", "w") as full:
        p = subprocess.run([sys.executable, "-m", "mspretrain.cli", *argv], stdout=full, stderr=subprocess.PIPE, env=env,
                           timeout=120, text=True)
    _one_line(p.returncode, p.stderr)
    assert "No space left on device" in p.stderr, p.stderr


# ----------------------------------------------------------------------------- config values checked with the config

@pytest.mark.parametrize("override, words", [
    ("profile.steps=abc", "profile.steps = 'abc' is not a step range"),
    ("profile.steps=20-10", "is empty or starts before step 1"),
    ("profile.steps=1-99999999999999999999", "is not a step range"),
    ("profile.steps=١٢", "is not a step range"),  # Arabic-Indic digits: int() takes them, a step range does not
    ('data.sources=[{path=5}]', "data.sources[0].path = 5 is not a directory name"),
    ('data.sources=[{path=""}]', "data.sources[0].path"),
    ('data.sources=[{path="a", weight=1e308}, {path="b", weight=1e308}]', "data.sources[0].weight must be a positive number up to 1e12"),
])
def test_config_values_a_run_cannot_use_are_refused_with_the_config(override, words):
    """`profile.steps=abc` was refused by the trainer after config.toml, run_meta.json and the
    tokenizer had been written into a new run dir; `data.sources=[{path=5}]` ended in a
    TypeError traceback; two weights of 1e308 summed to inf."""
    with pytest.raises(UserError) as e:
        cfgmod.load(str(TINY), [override])
    assert words in str(e.value), e.value


def test_a_refused_profile_range_leaves_no_run_dir(capsys, tiny_data, tmp_path):
    run = tmp_path / "run"
    code, _, err = cli(capsys, "train", "--config", str(TINY), "--data", str(tiny_data), "--run", str(run), "train.max_steps=3",
                        "profile.steps=abc", "--quiet")
    _one_line(code, err)
    assert "profile.steps" in err and not run.exists()


def test_a_question_with_100000_options_is_refused_before_any_forward_pass(tmp_path):
    """`eval --choices` with one question of 100,000 options ran past 3 minutes (a forward pass per option)."""
    import json

    from mspretrain.eval.choices import read_choices

    p = tmp_path / "wide.jsonl"
    p.write_text(json.dumps({"context": "q", "choices": ["a"] * 100_000, "label": 0}) + "\n", encoding="utf-8")
    with pytest.raises(UserError, match="100,000 options"):
        read_choices(p)


@pytest.mark.parametrize("kind", ["fifo", "devzero", "dir", "dangling"])
def test_an_hf_tokenizer_that_is_not_a_file_is_named_not_ignored(tmp_path, kind):
    """A FIFO, /dev/zero, a directory or a dangling link named tokenizer.model made `convert` say
    "no tokenizer in the HF folder" and go on; it is the folder's tokenizer, damaged."""
    import json
    import os

    from mspretrain.model.hf import read_hf_dir

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
                                                      "intermediate_size": 192, "num_hidden_layers": 1, "num_attention_heads": 4,
                                                      "vocab_size": 300}))
    tok = tmp_path / "tokenizer.model"
    {"fifo": lambda: os.mkfifo(tok), "devzero": lambda: tok.symlink_to("/dev/zero"), "dir": tok.mkdir,
     "dangling": lambda: tok.symlink_to(tmp_path / "nothing")}[kind]()
    with pytest.raises(UserError, match="tokenizer file"):
        read_hf_dir(tmp_path)


# ----------------------------------------------------------------------------- damaged data dirs

@pytest.mark.parametrize("key, value, words", [
    ("tokens", {"train": float("nan"), "valid": 1}, "tokens.train = nan is not a token count"),
    ("tokens", {"train": -5, "valid": 1}, "tokens.train = -5 is not a token count"),
    ("tokens", {"train": 10**30, "valid": 1}, "is not a token count"),
    ("tokens", {"train": "many", "valid": 1}, "is not a token count"),
    ("vocab_size", 10**30, "is not a vocabulary size"),
    ("special_ids", {"eos": 10**9}, "special_ids.eos = 1000000000 is not a token id"),
    ("special_ids", {"eos": -7}, "special_ids.eos = -7 is not a token id"),
    ("special_ids", {"eos": 1.5}, "special_ids.eos = 1.5 is not a token id"),
])
def test_a_manifest_with_impossible_counts_is_refused_by_its_reader(tiny_data, tmp_path, capsys, key, value, words):
    """`plan --data` with `"tokens": {"train": NaN}` ended in `int(nan)`'s traceback; a negative or
    1e30 token count was planned as given. read_manifest checks the numbers every reader uses."""
    import json
    import shutil

    d = tmp_path / "data"
    shutil.copytree(tiny_data, d)
    manifest = json.loads((d / "manifest.json").read_text())
    manifest[key] = value
    (d / "manifest.json").write_text(json.dumps(manifest))
    from mspretrain.data.manifest import read_manifest

    with pytest.raises(UserError, match=words.replace(".", r"\.").replace("(", r"\(")):
        read_manifest(d)
    if key == "tokens":  # plan reads only the keys it needs, these among them
        code, _, err = cli(capsys, "plan", "--config", str(TINY), "--data", str(d))
        _one_line(code, err)
        assert words in err, err


# ----------------------------------------------------------------------------- special files named, not "missing"

def _special(path: Path, kind: str) -> Path:
    import os

    {"fifo": lambda: os.mkfifo(path), "devzero": lambda: path.symlink_to("/dev/zero"),
     "dangling": lambda: path.symlink_to(path.parent / "nothing-here"), "file": lambda: path.write_text("x")}[kind]()
    return path


WANT = {"fifo": "is a FIFO", "devzero": "is a device", "dangling": "is a symbolic link to nothing", "file": "is a file, not a directory"}


@pytest.mark.parametrize("kind", list(WANT))
@pytest.mark.parametrize("command", ["checkpoints", "report", "recover", "train --data"])
def test_a_dir_argument_that_is_a_special_file_says_what_it_is(tmp_path, capsys, kind, command):
    """`checkpoints FIFO` (or a file) printed "no checkpoints" and exited 0; the others said
    "does not exist" for a FIFO, or went on to their own, less exact, refusals."""
    p = _special(tmp_path / "x", kind)
    argv = (["train", "--config", str(TINY), "--data", str(p), "--run", str(tmp_path / "run")] if command == "train --data"
            else [command, str(p)])
    code, _, err = cli(capsys, *argv)
    _one_line(code, err)
    assert WANT[kind] in err, err


@pytest.mark.parametrize("kind", ["fifo", "devzero", "dangling"])
def test_an_input_file_that_is_a_special_file_says_what_it_is(tmp_path, capsys, kind, corpus_file):
    p = _special(tmp_path / "x.model", kind)
    for argv in (["tokenizer", "extend", str(p), "--train", str(corpus_file), "--add", "5", "--out", str(tmp_path / "o1")],
                 ["prepare", str(p), "--out", str(tmp_path / "o2")],
                 ["prepare", str(corpus_file), "--tokenizer", str(p), "--out", str(tmp_path / "o3")]):
        code, _, err = cli(capsys, *argv)
        _one_line(code, err)
        assert WANT[kind] in err, (argv, err)
        assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists() and not (tmp_path / "o3").exists()


def test_an_hf_config_with_an_absurd_context_is_refused():
    """`convert` took `max_position_embeddings: 1e15` into the checkpoint's config (RoPE tables of
    1e15 rows at the first eval); the model section's ceilings now apply to converted configs too."""
    from mspretrain.model.hf import config_from_hf

    hf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 192,
          "num_hidden_layers": 1, "num_attention_heads": 4, "vocab_size": 300, "max_position_embeddings": 10**15}
    with pytest.raises(UserError, match="max_seq_len"):
        config_from_hf(hf, "config.json")
    config_from_hf({**hf, "max_position_embeddings": 131072}, "config.json")  # Llama-3.1's context still converts


# ----------------------------------------------------------------------------- class 7: full disks and long names

def test_a_new_run_on_a_full_disk_is_one_line_and_leaves_no_run_dir(tmp_path, monkeypatch):
    """`train --run` on a full disk ended in an OSError traceback from the lock's holder line and
    left the new run dir (with an empty lock file) behind."""
    import errno
    import os

    from mspretrain.checkpoint import lock

    def full(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(lock.os, "pwrite", full)
    with pytest.raises(UserError, match="No space left on device"):
        lock.acquire(tmp_path / "new-run", "train")
    assert not (tmp_path / "new-run").exists()
    (tmp_path / "old-run").mkdir()
    (tmp_path / "old-run" / "run_meta.json").write_text("{}")  # a run dir (one without it is refused as not a run)
    (tmp_path / "old-run" / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="No space left on device"):
        lock.acquire(tmp_path / "old-run", "train")
    assert (tmp_path / "old-run" / "notes.txt").read_text() == "mine"  # an existing run dir is not removed


@pytest.mark.parametrize("argv", [
    ["prepare", "CORPUS", "--out", "LONG"], ["report", "RUN", "--out", "LONG.html"], ["selftest", "--out", "LONG.json"],
])
def test_a_path_longer_than_the_filesystem_takes_is_one_line(tmp_path, capsys, corpus_file, argv):
    """A 300-character --out ended in an ENAMETOOLONG traceback in every writer."""
    long = str(tmp_path / ("x" * 300))
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text("")
    argv = [a.replace("LONG", long).replace("CORPUS", str(corpus_file)).replace("RUN", str(run)) for a in argv]
    code, _, err = cli(capsys, *argv)
    _one_line(code, err)
    assert "too long" in err, err


def test_a_non_utf8_name_reaching_a_text_writer_is_one_line(tmp_path, capsys, monkeypatch):
    """`report` of a run dir with a non-UTF-8 name and `tokenizer extend` of such a base ended in
    UnicodeEncodeError tracebacks ("surrogates not allowed") when writing their UTF-8 output."""
    from mspretrain import cli as cli_module

    class Boom:
        __doc__ = "x"
        EXAMPLES = None

        @staticmethod
        def add_arguments(p):
            p.add_argument("run")

        @staticmethod
        def run(args):
            return len(args.run.encode("utf-8"))  # what a writer does with the name

    monkeypatch.setattr(cli_module.importlib, "import_module", lambda name: Boom)
    import os

    code, _, err = cli(capsys, "audit", os.fsdecode(b"run\xff"))
    _one_line(code, err)
    assert "not valid UTF-8" in err


def test_launch_checks_its_log_dir_before_msrun_starts(tmp_path, capsys):
    """A --log-dir under a file (or on a full or read-only disk) let msrun start and die with its
    own traceback, reported as "a worker failed"."""
    import shutil
    import sys

    if shutil.which("msrun", path=str(Path(sys.executable).parent)) is None:
        pytest.skip("msrun is not installed next to this Python")
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    code, out, err = cli(capsys, "launch", "--nproc", "1", "--log-dir", str(blocker / "logs"), "--", "plan", "--config", TINY)
    _one_line(code, err)
    assert "--log-dir" in err and "msrun" not in out, err


def test_report_out_on_a_read_only_filesystem_is_one_line(tmp_path, capsys, monkeypatch):
    """`report --out` on a read-only filesystem: the cleanup of a temporary file never made raised
    EROFS in a `finally`, and its traceback replaced the one-line error."""
    import errno
    import os

    import mspretrain.forensics.report as report_ops

    def read_only(*a, **k):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(tmp_path / "ro" / ".r.html.tmp"))

    # the report is rendered in memory first (every refusal before the first write); the write of
    # the HTML's temporary file then meets the read-only filesystem, and so does its cleanup
    monkeypatch.setattr(report_ops, "render_report", lambda run_dir: ("<html></html>", {}))
    real_unlink, real_write = Path.unlink, Path.write_text
    monkeypatch.setattr(Path, "unlink", lambda self, missing_ok=False: read_only() if self.name.endswith(".tmp")
                        else real_unlink(self, missing_ok=missing_ok))
    monkeypatch.setattr(Path, "write_text", lambda self, *a, **k: read_only() if self.name.endswith(".tmp")
                        else real_write(self, *a, **k))
    run = tmp_path / "run"
    run.mkdir()
    code, _, err = cli(capsys, "report", str(run), "--out", str(tmp_path / "r.html"))
    _one_line(code, err)
    assert "Read-only file system" in err, err


def test_doctor_fails_a_run_path_under_a_file(tmp_path):
    """`doctor --run FILE/sub` said every check was ok; train then refused at its start."""
    from mspretrain.preflight.doctor import check_run_dir

    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    found = [f for f in check_run_dir(blocker / "run", cfgmod.load(TINY)) if f.name == "run dir writable"]
    assert found and found[0].status == "fail" and "is a file" in found[0].detail, found


@pytest.mark.parametrize("kind", ["fifo", "devzero", "dangling"])
def test_special_files_as_config_choices_and_selftest_inputs_say_what_they_are(tmp_path, capsys, kind):
    p = str(_special(tmp_path / "x", kind))
    for argv in (["plan", "--config", p], ["eval", "no-such-run", "--choices", p],
                 ["plan", "--config", str(TINY), "model.vocab_size=512", "--from-selftest", p]):
        code, _, err = cli(capsys, *argv)
        _one_line(code, err)
        assert WANT[kind] in err, (argv, err)


@pytest.mark.parametrize("flag", ["--lr-scale", "--loss-scale"])
def test_replay_scales_that_float32_rounds_to_zero_are_refused(capsys, flag):
    """`replay --loss-scale 1e-320` replayed with a scale of 0.0 (NaN gradients, exit 0)."""
    code, _, err = cli(capsys, "replay", "no-such-run", "--from-step", "2", "--steps", "1", flag, "1e-320")
    _one_line(code, err)
    assert flag in err and "must be a positive finite number from" in err, err


def test_cpu_kernel_threads_are_the_hosts_cores_shared_by_its_ranks(monkeypatch):
    """device.threads = 0: each rank's kernel pool is its share of the cores, so msrun ranks on one
    box do not spin on each other's cores; a bad exported count is one line naming the variable."""
    from mspretrain.device import LOCAL_RANKS_ENV, cpu_threads
    from mspretrain.errors import UserError

    monkeypatch.setattr("os.cpu_count", lambda: 8)
    assert cpu_threads({}) == 8  # one process
    assert cpu_threads({LOCAL_RANKS_ENV: "2"}) == 4  # launch --nproc 2
    assert cpu_threads({"MS_WORKER_NUM": "4"}) == 2  # a bare msrun (one host on CPU)
    assert cpu_threads({LOCAL_RANKS_ENV: "2", "MS_WORKER_NUM": "16"}) == 4  # launch over 8 nodes
    assert cpu_threads({LOCAL_RANKS_ENV: "16"}) == 1
    with pytest.raises(UserError, match="MS_WORKER_NUM"):
        cpu_threads({"MS_WORKER_NUM": "x"})
