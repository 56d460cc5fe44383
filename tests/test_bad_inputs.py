"""Bad inputs: nothing the user has is ever lost, and no input crashes a command.

Every refusal goes through `mspretrain.cli.main` and must be exactly one `error:` line plus one
`hint:` line, exit code 2, no traceback, and must leave the user's files byte for byte as they
were. (The run-dir lock and the all-checkpoints-corrupt refusal are in test_lock.py; the
safetensors / config.json fuzzing is in test_fuzz_readers.py. Refusals that must leave a run dir or an
output dir exactly as it was are in test_refusals.py and test_outputs.py.)

The inputs: prepare --overwrite and report --out on what they did not write, config floats,
the data dir's tokenizer and ids, crashes that become one line, resource bombs, messages that
say what happened, numbers that cannot run, and run files that are special files."""
from __future__ import annotations

import json
import os
import resource
import shutil
from pathlib import Path

import pytest

from mspretrain.cli import main
from tests.conftest import ROOT, TINY, make_poems
from tests.helpers import cli, refused


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

    from mspretrain.config import Config

    base = Config()
    return [f"{s.name}.{f.name}" for s in fields(Config) for f in fields(getattr(base, s.name))
            if isinstance(getattr(getattr(base, s.name), f.name), float)]


def test_every_float_key_refuses_nan_and_inf():
    from mspretrain import config as cfgmod
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
    from mspretrain import config as cfgmod
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

    from mspretrain import config as cfgmod
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

    from mspretrain.config import resolve_model
    from mspretrain.errors import UserError
    from mspretrain.ops.fits import GB, check_fits, estimate_bytes

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

    from mspretrain.config import resolve_model
    from mspretrain.errors import UserError
    from mspretrain.ops.fits import LOCAL_RANKS_ENV, check_fits, estimate_bytes, local_ranks

    cfg = replace(tiny_cfg, model=resolve_model(tiny_cfg.model, 512))
    one = estimate_bytes(cfg, 2)
    check_fits(cfg, 2, "cpu", memory=(2 * one + 1, None), local=2)
    with pytest.raises(UserError, match="2 ranks on this host"):
        check_fits(cfg, 2, "cpu", memory=(2 * one - 1, None), local=2)
    check_fits(cfg, 2, "cpu", memory=(2 * one - 1, None), local=1)  # the other rank is on another node
    assert local_ranks(2, {}) == 2  # a bare msrun on CPU: every rank is here
    assert local_ranks(8, {LOCAL_RANKS_ENV: "4"}) == 4  # launch --nproc 4 --nodes 2
    assert local_ranks(2, {LOCAL_RANKS_ENV: "x"}) == 2 and local_ranks(2, {LOCAL_RANKS_ENV: "9"}) == 2


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

    from mspretrain.ops.diagnose import diagnose

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
    """`mspretrain --help` used to promise overrides to every command; those that read no config
    ignored them silently. Now they are refused in one line (issue 33, docs item)."""
    assert main([command, str(reference_run), "train.max_steps=5"]) == 2
    err = capsys.readouterr().err
    assert "takes no section.key=value overrides" in err and err.count("\n") == 2


def test_quickstart_creates_my_text_with_the_walkthroughs_own_lines():
    root = Path(__file__).resolve().parents[1]
    quick = (root / "docs" / "quickstart.md").read_text(encoding="utf-8")
    block = quick.split("## 1. Your own text", 1)[1].split("```bash\n", 1)[1].split("\n```", 1)[0]
    assert block.startswith("mkdir -p my-text") and block in (root / "scripts" / "walkthrough.sh").read_text(encoding="utf-8")
