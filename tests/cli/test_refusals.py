"""A refused command leaves every file as it was.

Every refusal path of `train` (a resume that changes the data, the trainable groups, the model,
seq_len; --init-from on a run that resumes or with weights that do not fit), of `recover` and of
`--init-from` runs against a copy of one finished tiny run, and the whole run dir (the list of
files and every file's bytes) is checksummed before and after. The lock file is left out: taking
the run-dir lock writes the holder's PID into it, and that is the lock's job (checkpoint/lock.py).

Then every other writing command refused on a dir that is not its own (a data dir, an HF folder, a
checkpoint, a user folder given as `--run`; replay, report, launch and demo refusals): there the
whole tree around it is compared (`tests/helpers/cli.py` `state`: names, bytes, modes and modification
times, lock files included: a dir that is not a run must not even get a lock file).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from mspretrain.cli import main
from tests.conftest import NO_EVAL, TINY, make_poems
from tests.helpers.cli import checksum, refused, state


@pytest.fixture(scope="module")
def finished(tmp_path_factory, tiny_data) -> Path:
    """A finished 4-step run (checkpoints at 2 and 4); read-only: tests copy it."""
    run = tmp_path_factory.mktemp("finished") / "run"
    assert main(["train", "--config", str(TINY), "--data", str(tiny_data), "--run", str(run), "--quiet",
                 "train.max_steps=4", "checkpoint.every=2", "checkpoint.keep_last=2", NO_EVAL]) == 0
    return run


@pytest.fixture(scope="module")
def other_data(tmp_path_factory, tiny_data, tiny_cfg) -> Path:
    """Another data dir with the same tokenizer (so only the data fingerprint differs)."""
    from mspretrain.prepare.prepare import prepare

    src = tmp_path_factory.mktemp("other_corpus") / "c.txt"
    src.write_text("\n\n".join(make_poems(400, seed=5)) + "\n", encoding="utf-8")
    out = tmp_path_factory.mktemp("other_data") / "d"
    prepare([str(src)], out, tiny_cfg.prepare, tokenizer=str(tiny_data / "tokenizer.model"), workers=1, log=lambda s: None)
    return out


def _train(run: Path, data: Path, *extra: str) -> list[str]:
    return ["train", "--config", str(TINY), "--data", str(data), "--run", str(run), "--quiet",
            "train.max_steps=6", "checkpoint.every=2", "checkpoint.keep_last=2", *extra]


# each case: (extra args, a phrase of the refusal); "{other}" is the other data dir, "{run}" the finished run
TRAIN_REFUSALS = {
    "data_dir_changed": (["--data", "{other}"], "data"),
    "trainable_changed": (['train.trainable=["embeddings", "lm_head"]'], "train.trainable"),
    "seq_len_changed": (["data.seq_len=16"], "seq_len"),
    "seq_len_changed_allowed_config": (["--allow-config-change", "data.seq_len=16"], "seq_len"),
    "model_key_changed_allowed_config": (["--allow-config-change", "model.dim=32"], ""),
    "model_layers_changed_allowed_config": (["--allow-config-change", "model.n_layers=3"], ""),
    "seed_changed_allowed_config": (["--allow-config-change", "train.seed=7"], "seed"),
    "init_from_on_a_run_that_resumes": (["--init-from", "{run}"], "--init-from"),
    "bad_config_value": (["optim.lr=-1"], "lr"),
}


@pytest.mark.parametrize("case", sorted(TRAIN_REFUSALS))
def test_a_refused_train_leaves_the_run_dir_as_it_was(finished, tiny_data, other_data, tmp_path, capsys, case):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    extra, phrase = TRAIN_REFUSALS[case]
    data = tiny_data
    args = []
    for a in extra:
        if a == "--data":
            continue
        if a == "{other}":
            data = other_data
            continue
        args.append(a.replace("{run}", str(finished)))
    before = checksum(run)
    err = refused(capsys, *_train(run, data, *args))
    assert phrase in err
    assert checksum(run) == before
    # the untouched run still resumes with its own command
    assert main(_train(run, tiny_data, "train.max_steps=4")) == 0


def test_a_refused_resume_after_a_crash_keeps_metrics_and_batches(finished, other_data, tmp_path, capsys):
    """Resuming from an earlier checkpoint (a crash after step 2's save) with another data dir:
    metrics.jsonl and batches.jsonl are not cut back to step 2 by the refused command."""
    from tests.conftest import copy_run_at

    run = copy_run_at(finished, tmp_path / "run", 2)
    before = checksum(run)
    refused(capsys, *_train(run, other_data))
    assert checksum(run) == before


INIT_REFUSALS = {
    "explicit_model_key_disagrees": ["model.dim=32"],
    "missing_path": ["--init-from", "{missing}"],
    "not_weights": ["--init-from", "{notes}"],
}


@pytest.mark.parametrize("case", sorted(INIT_REFUSALS))
def test_a_refused_init_from_creates_no_run_dir(finished, tiny_data, tmp_path, capsys, case):
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "readme.txt").write_text("mine", encoding="utf-8")
    src = tmp_path / "src"
    shutil.copytree(finished, src)
    args = INIT_REFUSALS[case]
    if "--init-from" not in args:
        args = ["--init-from", "{src}", *args]
    args = [a.replace("{missing}", str(tmp_path / "nope")).replace("{notes}", str(notes)).replace("{src}", str(src)) for a in args]
    before_src, before_notes = checksum(src), checksum(notes)
    run = tmp_path / "new" / "run"
    refused(capsys, *_train(run, tiny_data, *args))
    assert not run.exists()
    assert checksum(src) == before_src and checksum(notes) == before_notes


RECOVER_REFUSALS = ["no_such_step", "no_intact_weights", "data_dir_gone"]


@pytest.mark.parametrize("case", RECOVER_REFUSALS)
def test_a_refused_recover_leaves_the_run_dir_as_it_was(finished, tmp_path, capsys, case):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    ckpts = sorted((run / "checkpoints").iterdir())
    args = ["recover", str(run)]
    if case == "no_such_step":
        args += ["--step", "3"]
    elif case == "no_intact_weights":
        for d in ckpts:
            (d / "model.safetensors").write_bytes(b"\0" * 16)
    else:  # train_state is rebuildable, data_state is not: neither is written
        for n in ("train_state.json", "data_state.json"):
            (ckpts[-1] / n).write_text("{broken", encoding="utf-8")
        meta = json.loads((run / "run_meta.json").read_text(encoding="utf-8"))
        meta["data_dir"] = str(tmp_path / "gone")
        (run / "run_meta.json").write_text(json.dumps(meta), encoding="utf-8")
    before = checksum(run)
    refused(capsys, *args)
    assert checksum(run) == before


# The quick demo beside a full one, and the full one continued then refused by the demo:
# test_pipeline.py `test_the_quick_demo_never_touches_the_full_demo_run` (it shares the demo runs
# of its `demo_workdir` with the demo's orchestration test there).


def test_a_refused_new_run_leaves_no_run_dir(tiny_data, tmp_path, capsys):
    """A refusal after the run lock was taken (here the loader: a sample longer than the valid
    split) leaves no half-made run dir behind."""
    run = tmp_path / "runs" / "new"
    refused(capsys, "train", "--config", str(TINY), "--data", str(tiny_data), "--run", str(run), "--quiet",
            "model.max_seq_len=8192", "data.seq_len=4096", "train.max_steps=2")
    assert not run.exists()


# --------------------------------------------------------------------------- run dirs that are not runs, refused writers


def _not_runs(root: Path, tiny_data: Path) -> dict[str, Path]:
    """Directories that are not run dirs, each with a file `train` would have replaced."""
    data = root / "data"
    shutil.copytree(tiny_data, data)
    hf = root / "hf"  # an HF folder: its own tokenizer.model, which train replaced with the data's
    hf.mkdir()
    (hf / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (hf / "tokenizer.model").write_bytes(b"someone else's tokenizer")
    ckpt = root / "step_000004"  # a checkpoint dir (of another run) named as --run
    ckpt.mkdir()
    for name in ("manifest.json", "model.safetensors", "config.toml", "train_state.json"):
        (ckpt / name).write_text("x")
    mine = root / "mine"  # a user's folder with their own config.toml and notes
    mine.mkdir()
    (mine / "config.toml").write_text("# my notes on the config\n")
    (mine / "notes.txt").write_text("mine")
    checkpoints = root / "checkpoints"  # a run's checkpoints/ dir named as --run
    (checkpoints / "step_000002").mkdir(parents=True)
    (root / "data-link").symlink_to(data)
    return {"data dir": data, "HF folder": hf, "checkpoint": ckpt, "user folder": mine, "checkpoints/": checkpoints,
            "symlink to a data dir": root / "data-link"}


@pytest.mark.parametrize("kind", ["data dir", "HF folder", "checkpoint", "user folder", "checkpoints/", "symlink to a data dir"])
def test_train_refuses_a_run_dir_that_is_not_one(tiny_data, tmp_path, capsys, kind):
    """`train --run X` on a dir of other files replaced its config.toml and tokenizer.model (an HF
    folder's tokenizer by the data's, a user's config.toml) and added checkpoints: refused now,
    before the lock file, so nothing in it changes."""
    root = tmp_path / "w"
    root.mkdir()
    target = _not_runs(root, tiny_data)[kind]
    before = state(root)
    err = refused(capsys, "train", "--config", TINY, "--data", tiny_data, "--run", target, "--quiet", "train.max_steps=2",
                  "schedule.warmup_steps=1")
    assert "is not a run dir" in err
    assert state(root) == before


@pytest.mark.parametrize("kind", ["data dir", "HF folder", "checkpoint"])
def test_recover_on_a_dir_that_is_not_a_run_leaves_no_lock_file(tiny_data, tmp_path, capsys, kind):
    root = tmp_path / "w"
    root.mkdir()
    target = _not_runs(root, tiny_data)[kind]
    before = state(root)
    refused(capsys, "recover", target)
    assert state(root) == before


def test_a_run_dir_with_files_of_the_users_still_resumes_and_a_dir_with_only_a_config_is_a_new_run(tmp_path):
    """The refusal does not catch real runs: a run dir (run_meta.json) may hold the user's notes;
    a dir holding only names `train` writes (a config placed there first) is a new run."""
    from mspretrain.checkpoint.lock import foreign_entries

    run = tmp_path / "run"
    run.mkdir()
    (run / "run_meta.json").write_text("{}")
    (run / "NOTES.md").write_text("mine")
    assert foreign_entries(run) == []
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    shutil.copy(TINY, fresh / "config.toml")
    (fresh / "checkpoints.failed-20260101T000000Z").mkdir()
    (fresh / "msrun_log").mkdir()  # `launch` run from the run dir makes its log dir first
    (fresh / ".DS_Store").write_text("x")
    assert foreign_entries(fresh) == []
    (fresh / "model.safetensors").write_text("x")
    assert foreign_entries(fresh) == ["model.safetensors"]


@pytest.mark.parametrize("where", ["default", "new dirs"])
def test_a_refused_report_creates_no_directory(tiny_data, tmp_path, capsys, where):
    """`report DATA_DIR` (not a run) made DATA_DIR/report/, and `--out new/deep/x.html` made
    new/deep/, before refusing: the report is now rendered in memory before anything is written."""
    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    before = state(tmp_path)
    extra = ["--out", tmp_path / "new" / "deep" / "r.html"] if where == "new dirs" else []
    refused(capsys, "report", data, *extra)
    assert state(tmp_path) == before


@pytest.mark.parametrize("given", ["new", "empty"])
def test_a_refused_replay_leaves_its_out_dir_as_it_was(reference_run, tmp_path, capsys, given):
    """A refusal after replay had copied the starting checkpoint into --out (here: the run's data
    dir is gone) left the copy there: --out is now as it was, absent or empty."""
    run = tmp_path / "run"
    shutil.copytree(reference_run, run)
    meta = json.loads((run / "run_meta.json").read_text())
    meta["data_dir"] = str(tmp_path / "gone")
    (run / "run_meta.json").write_text(json.dumps(meta))
    out = tmp_path / "deep" / "scratch" if given == "new" else tmp_path / "scratch"
    if given == "empty":
        out.mkdir()
    before = state(tmp_path)
    refused(capsys, "replay", run, "--from-step", "4", "--steps", "1", "--out", out)
    assert state(tmp_path) == before


@pytest.mark.parametrize("cmd", [["frobnicate"], ["train", "--frob", "1"], ["train", "--config", "c.toml"]])
def test_launch_refuses_a_worker_command_that_cannot_parse_before_msrun_starts(tmp_path, monkeypatch, capsys, cmd):
    """`launch -- frobnicate` started msrun, whose workers all failed with a traceback, and left
    msrun_log/ behind (exit 1). The workers' command is parsed first now: exit 2, nothing written."""
    monkeypatch.chdir(tmp_path)
    refused(capsys, "launch", "--nproc", "2", "--", *cmd)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("missing", ["--data", "data.sources"])
def test_launch_refuses_a_train_whose_data_dir_is_missing_before_msrun_starts(tiny_data, tmp_path, monkeypatch, capsys, missing):
    """`launch -- train --data MISSING` started msrun, whose workers each printed a traceback
    (launch exit 1). launch reads the data dirs' manifests first now: exit 2, nothing written."""
    monkeypatch.chdir(tmp_path)
    gone = tmp_path / "gone"
    if missing == "--data":
        cmd = ["--data", gone]
    else:
        cmd = ["--data", tiny_data, f'data.sources=[{{path="{tiny_data}", weight=1}}, {{path="{gone}", weight=1}}]']
    err = refused(capsys, "launch", "--nproc", "2", "--", "train", "--config", TINY, "--run", tmp_path / "run", *cmd)
    assert f"{gone} does not exist" in err or f"{gone} is not" in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("nproc, overrides, needle", [
    (2, ["parallel.tp=2", "optim.shard_parameters=true"], "optim.shard_parameters"),  # ZeRO-3 with tp
    (2, ["parallel.tp=2", "model.n_kv_heads=1"], "does not divide model.n_kv_heads = 1"),
    (2, ["parallel.tp=3", "model.n_heads=3", "model.n_kv_heads=3", "model.dim=48"], "does not divide the 2 ranks"),
    (2, ["parallel.tp=2", "eval.choices_file=x.csv"], "eval.choices_file"),
    (2, ["parallel.tp=2", "optim.split_mb=8"], "optim.split_mb"),  # other variants of the class
    (4, ["parallel.tp=4", "model.n_heads=8", "model.n_kv_heads=4", "model.ffn_dim=170"], "model.ffn_dim = 170"),
    (2, ["parallel.tp=2", "model.vocab_size=513"], "model.vocab_size = 513"),
])
def test_launch_refuses_a_tensor_parallel_train_that_train_refuses_before_msrun_starts(tiny_data, tmp_path, monkeypatch, capsys,
                                                                                        nproc, overrides, needle):
    """`launch -- train` with a tensor-parallel config train refuses started msrun and ended in
    every worker's traceback (exit 1): train's config checks run before msrun now, exit 2, nothing written."""
    monkeypatch.chdir(tmp_path)
    err = refused(capsys, "launch", "--nproc", nproc, "--", "train", "--config", TINY, "--data", tiny_data,
                  "--run", tmp_path / "run", *overrides)
    assert needle in err
    assert list(tmp_path.iterdir()) == []


def test_launch_refuses_tp_on_an_init_from_model_it_cannot_cut(tiny_data, tmp_path, monkeypatch, capsys):
    """--init-from an HF folder whose config.json has one KV head, with parallel.tp=2: the model
    comes from the folder, so the folder's config.json is what launch checks before msrun."""
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 1, "intermediate_size": 96, "vocab_size": 512}))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    err = refused(capsys, "launch", "--nproc", "2", "--", "train", "--data", tiny_data, "--run", work / "run",
                  "--init-from", hf, "parallel.tp=2", "train.max_steps=5")
    assert "does not divide model.n_kv_heads = 1" in err
    assert list(work.iterdir()) == []


def test_a_refused_demo_prepares_nothing_first(corpus_file, tmp_path, capsys):
    """The demo checked its run dir's config only after preparing the data (minutes, and a new
    data dir left behind by the refusal) when data/ was gone: now before."""
    work = tmp_path / "wd"
    (work / "run").mkdir(parents=True)
    shutil.copy(TINY, work / "run" / "config.toml")  # a run with another config than the demo's
    before = state(tmp_path)
    err = refused(capsys, "demo", "--workdir", work, "--corpus", corpus_file, "--quiet", "prepare.vocab_size=512")
    assert "another config than this demo's" in err
    assert state(tmp_path) == before
