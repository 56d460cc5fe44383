"""Shared fixtures: a small Chinese corpus written by the tests themselves (no network), a data
dir prepared from it once per session, and the tiny config. Expensive things are session-scoped
because MindSpore compiles each new graph in seconds."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("GLOG_v", "3")
# What `setup_mindspore` sets on CPU (mspretrain/device.py), here before the first op of the test
# process: tests build models before any trainer sets MindSpore up, and the flag is read once.
os.environ.setdefault("MS_DEV_HOST_BLOCKING_RUN", "1")

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.toml"

# ~150 common characters; "poems" are lines of 5 or 7 characters drawn with a bias so that
# there is structure to learn (each character prefers a few successors).
CHARS = ("春风明月江南山水花落日夜秋云天地人心来去长空白雪青松流年故乡归路远清香红叶梦中"
         "千里万家门前桥边柳色鸟声寒烟孤舟独坐高楼望断相思无限时光何处见君知我不同一生"
         "西东北上下古今朝暮雨晴寒暖冬夏新旧老少金玉石竹林泉溪湖海波浪星河宫阙城关")


def make_poems(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    chars = list(dict.fromkeys(CHARS))
    succ = {c: rng.choice(len(chars), 4, replace=False) for c in chars}
    poems = []
    for i in range(n):
        width = 5 if i % 2 else 7
        lines = []
        c = chars[rng.integers(len(chars))]
        for _ in range(4):
            line = []
            for _ in range(width):
                line.append(c)
                c = chars[succ[c][rng.integers(4)]]
            lines.append("".join(line))
        poems.append(f"第{i}首\n" + "，".join(lines[:2]) + "。\n" + "，".join(lines[2:]) + "。")
    return poems


def built_once(tmp_path_factory, name: str, build) -> Path:
    """A read-only dir that the session fixtures of every xdist worker of one run share (`make test`
    runs two): the first worker to need it calls `build(dir)` under a lock, the other waits for it
    and reuses it instead of training or preparing the same thing again. Under plain `pytest`, a
    dir of its own base temp."""
    import fcntl
    import shutil

    root = _shared_root(tmp_path_factory)
    out, done = root / f"shared-{name}", root / f"shared-{name}.built"
    with open(root / f"shared-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.is_file():
            shutil.rmtree(out, ignore_errors=True)  # what a worker that failed half-way left
            out.mkdir()
            build(out)
            done.touch()
    return out


def _shared_root(tmp_path_factory) -> Path:
    """pytest-N/ under xdist (the parent of each worker's popen-gwK/), else this session's base temp."""
    root = tmp_path_factory.getbasetemp()
    return root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root


@contextlib.contextmanager
def one_msrun_at_a_time(tmp_path_factory):
    """Held around every job that launches ranks (an msrun test, a two-rank session run): an msrun
    job (2 workers + a scheduler) beside another would starve both jobs' heartbeats on 2 cores, and
    the two xdist workers of `make test` may each reach a file with one. An flock shared by the
    workers of one run: a job waits for the other to end."""
    import fcntl
    import time

    with open(_shared_root(tmp_path_factory) / "msrun.lock", "w") as lock:
        start = time.monotonic()
        fcntl.flock(lock, fcntl.LOCK_EX)
        from tests.cpu_plugin import record  # how long this worker waited for the other's job (tests/cpu_plugin.py)

        record({"lock_wait": round(time.monotonic() - start, 3), "worker": os.environ.get("PYTEST_XDIST_WORKER", "main")})
        yield


@pytest.fixture(autouse=True)
def _msrun_jobs_one_at_a_time(request, tmp_path_factory):
    if request.node.get_closest_marker("msrun") is None:
        yield
        return
    with one_msrun_at_a_time(tmp_path_factory):
        yield


@pytest.fixture(scope="session")
def corpus_file(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("corpus")
    p = d / "poems.txt"
    p.write_text("\n\n".join(make_poems(1200)) + "\n", encoding="utf-8")
    return p


@pytest.fixture(scope="session")
def tiny_cfg():
    from mspretrain.config import schema as cfgmod

    return cfgmod.load(TINY)


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory, corpus_file, tiny_cfg) -> Path:
    from mspretrain.prepare.prepare import prepare

    return built_once(tmp_path_factory, "data", lambda d: prepare([str(corpus_file)], d / "tiny", tiny_cfg.prepare,
                                                                   workers=1, log=lambda s: None)) / "tiny"


# One tiny training run that several test files compare against (single process, fp32, cosine
# schedule over 8 steps, a checkpoint after every step, all kept): one compilation for them all.
REFERENCE_STEPS = 8
# grad_norm_every=1: the grad norm of every step is compared (a gradient scale error that clipping
# and Adam hide from the weights shows there); it does not change the numerics.
# The final evaluation off, in the runs of other processes that no test reads it from: its graph
# compiles in ~40 % of the train step's time, in every worker (~3.5 s of CPU a worker of an msrun
# job). `reference_run` keeps it, and so do the 2-rank runs that compare their eval with it
# (test_distributed.py `two_ranks_fp32`, test_tp.py `tp2_run`: `EVAL_AT_END`, the later override wins).
NO_EVAL = "eval.at_end=false"
EVAL_AT_END = "eval.at_end=true"
# One layer (`ONE_LAYER`): what these runs compare (ranks against one process, a resume against an
# uninterrupted run, checkpoints) is per parameter; a second layer repeats the first's nodes at
# ~2.5 s of CPU per compilation in every worker. The stacking of layers is checked at 2 layers
# against transformers (test_model.py, test_families.py), by the 2-layer ZeRO-3 families job
# (tests/step/zero3_worker.py) and by the loopback ZeRO-3 and TP tests.
ONE_LAYER = "model.n_layers=1"
REFERENCE_ARGS = (f"train.max_steps={REFERENCE_STEPS}", "checkpoint.every=1", f"checkpoint.keep_last={REFERENCE_STEPS}",
                  "metrics.grad_norm_every=1", ONE_LAYER)


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory, tiny_data) -> Path:
    """Read-only: copy it (shutil.copytree) before training on or damaging it."""
    from mspretrain.cli import main

    def build(d: Path) -> None:
        assert main(["train", "--config", str(TINY), "--data", str(tiny_data), "--run", str(d / "run"), "--quiet",
                     "train.log_every=1", *REFERENCE_ARGS]) == 0
    return built_once(tmp_path_factory, "reference", build) / "run"


FP16_MASTERS = ("precision.dtype=fp16", "precision.param_dtype=compute", "precision.loss_scale=static")


@pytest.fixture(scope="session")
def one_fp16(tmp_path_factory, tiny_data) -> Path:
    """The reference run's config in fp16 with fp16 matrices and fp32 masters, on one process: what
    the fp16-masters msrun tests of tests/step/test_zero2.py and tests/step/test_zero3.py compare against. Read-only."""
    from mspretrain.cli import main

    one = tmp_path_factory.mktemp("one-fp16") / "one-fp16"
    assert main(["train", "--config", str(TINY), "--data", str(tiny_data), "--run", str(one), *REFERENCE_ARGS, "--quiet",
                 "train.log_every=1", NO_EVAL, *FP16_MASTERS]) == 0
    return one


# A spike `rewind` run in one process (checkpoints every 4 steps, lr 10x the reference's so that
# spikes come): what the 2-rank msrun rewind run (tests/train/test_distributed.py) and the two-node one
# (tests/launch/test_multinode.py) must equal.
REWIND_ARGS = ("train.max_steps=14", "checkpoint.every=4", "spike.action=rewind", "spike.threshold=0.02", "spike.window=3",
               "schedule.warmup_steps=1", "optim.lr=0.01", NO_EVAL)


@pytest.fixture(scope="session")
def rewind_one_process(tmp_path_factory, tiny_data) -> Path:
    """Read-only, like `reference_run`."""
    from mspretrain.cli import main

    run = tmp_path_factory.mktemp("rewind") / "one"
    assert main(["train", "--config", str(TINY), "--data", str(tiny_data), "--run", str(run), "--quiet", *REWIND_ARGS]) == 0
    return run


@pytest.fixture(scope="session")
def two_nodes_rewind(tmp_path_factory, tiny_data) -> Path:
    """`rewind_one_process`'s config on 2 ranks with the optimizer state sharded (ZeRO-1), launched
    as two "nodes" of one worker each (tests/helpers/runs.py `two_nodes`): what the msrun spike-rewind
    tests of tests/train/test_distributed.py and tests/launch/test_multinode.py compare with one process. One
    job for the two (the rewind's code is the same on a 2-worker msrun and on two nodes). Read-only."""
    from tests.helpers.runs import two_nodes

    def build(tmp: Path) -> None:
        with one_msrun_at_a_time(tmp_path_factory):
            two_nodes(tmp, tiny_data, tmp / "two", "optim.shard_optimizer=true", *REWIND_ARGS)
    return built_once(tmp_path_factory, "two-rewind", build) / "two"


@pytest.fixture(scope="session")
def two_ranks_fp32(tmp_path_factory, tiny_data) -> Path:
    """`reference_run`'s config on 2 ranks, fp32 wire, one AllReduce bucket (the default), launched
    as two "nodes" of one worker each (two `mspretrain launch --nodes 2` processes, see
    tests/launch/test_multinode.py): compared with one process (tests/train/test_distributed.py, and with its
    log dirs and a resume on two nodes in tests/launch/test_multinode.py) and with one AllReduce per
    parameter on one 2-worker msrun (tests/step/test_zero2.py). One job for the three. Read-only."""
    from tests.helpers.runs import two_nodes

    def build(tmp: Path) -> None:
        with one_msrun_at_a_time(tmp_path_factory):
            two_nodes(tmp, tiny_data, tmp / "two-fp32", *REFERENCE_ARGS, "precision.allreduce_dtype=fp32")
    return built_once(tmp_path_factory, "two-ranks", build) / "two-fp32"


@pytest.fixture(scope="session")
def walkthrough(tmp_path_factory) -> tuple[Path, str]:
    """scripts/walkthrough.sh (the quick start's sessions 1-6) run for real in a temp dir: its
    workdir and what it printed. Five MindSpore processes, each compiling its graphs (~1 min on a
    quiet 2-core box, ~2.5 min at load 5): tests/docs/test_walkthrough.py checks it and
    tests/docs/test_docs.py compares it with the docs (both in the xdist group "walkthrough", conftest.groups, so it runs
    once). Read-only: test_docs runs its further commands in a copy."""
    import subprocess
    import sys

    import torch  # noqa: F401  pinned test dependencies: missing must fail, not skip (pyproject [test])
    import transformers  # noqa: F401

    def build(work: Path) -> None:
        env = dict(os.environ, GLOG_v="3")
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # this venv's mspretrain and python
        proc = subprocess.run(["bash", str(ROOT / "scripts" / "walkthrough.sh"), str(work)], env=env, capture_output=True,
                              text=True, timeout=1200)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"walkthrough failed (exit {proc.returncode}):\n{out[-4000:]}"
        assert "Traceback" not in out, out[-4000:]
        (work.parent / f"{work.name}.out").write_text(out, encoding="utf-8")
    work = built_once(tmp_path_factory, "walkthrough", build)
    return work, (work.parent / f"{work.name}.out").read_text(encoding="utf-8")


def copy_run_at(src: Path, dst: Path, step: int) -> Path:
    """A copy of a run dir as it was right after the save of `step`: later checkpoints gone and
    metrics.jsonl cut there (what a crash after that save leaves to resume from)."""
    import json
    import shutil

    shutil.copytree(src, dst)
    for d in (dst / "checkpoints").iterdir():
        if int(d.name.split("_")[1].split(".")[0]) > step:
            shutil.rmtree(d)
    lines = (dst / "metrics.jsonl").read_text().splitlines()
    (dst / "metrics.jsonl").write_text("".join(line + "\n" for line in lines if json.loads(line).get("step", 0) <= step))
    return dst


def snapshot(state):
    """A private copy of an array or a dict of arrays: the "before" of a before/after comparison.
    `state_numpy()`, `optimizer_state()` and `Tensor.asnumpy()` return views of live buffers on
    CPU, so a "before" taken from them changes with the step and the comparison cannot fail."""
    if isinstance(state, dict):
        return {k: np.array(v, copy=True) for k, v in state.items()}
    return np.array(state, copy=True)


def assert_unshared(before, after) -> None:
    """`before` and `after` (arrays or dicts of arrays with the same keys) share no memory: a
    comparison between them compares two states, not one buffer with itself."""
    if isinstance(before, dict):
        assert set(before) == set(after), sorted(set(before) ^ set(after))
        for k in before:
            assert not np.shares_memory(before[k], after[k]), f"{k}: 'before' is a view of 'after' (take it with snapshot())"
    else:
        assert not np.shares_memory(before, after), "'before' is a view of 'after' (take it with snapshot())"


def assert_unchanged(before, after) -> None:
    """Bit for bit the same, and two different buffers (so that this can fail)."""
    assert_unshared(before, after)
    if isinstance(before, dict):
        for k in before:
            assert np.array_equal(before[k], after[k]), f"{k} changed"
    else:
        assert np.array_equal(before, after)


def relative_error(got, want) -> float:
    """|got - want| / |want| over the whole tensor: a relative tolerance that means something for
    tensors whose elements are mostly tiny (most exp_avg_sq values are below 1e-6, so an absolute
    1e-6 passes anything) and that one near-zero element's last-bit noise cannot fail."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert np.linalg.norm(want) > 0, "the reference is all zeros: nothing would be compared"
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def assert_close_rel(got, want, rtol: float, what: str) -> None:
    err = relative_error(got, want)
    assert err <= rtol, f"{what}: relative error {err:.3g} > {rtol:g}"


def assert_same_checkpoint(got: Path, want: Path, rtol: float, moments_rtol: float | None = None) -> None:
    """Model and optimizer files of two checkpoint dirs (any number of optimizer shards) agree
    tensor by tensor within `rtol` (relative_error), with the same names and the same AdamW step.
    `moments_rtol`: the optimizer state's own tolerance (bf16 moments: two runs whose fp32 values
    differ by rounding noise can round an element to neighbouring bf16 values, 2^-7 apart)."""
    from safetensors.numpy import load_file

    def optimizer(d: Path) -> dict:
        from mspretrain.step.step import parse_key

        out: dict = {}
        slices: dict = {}  # a split parameter's state, per slice (`NAME@start:stop`): joined into NAME, flat
        for f in sorted(d.glob("optimizer*.safetensors")):
            part = load_file(str(f))
            assert not (set(part) - {"opt_step"}) & set(out), f"{f.name} repeats another shard's tensors"
            for k, v in part.items():
                name, rng = parse_key(k)
                if rng is None:
                    out[k] = v
                else:
                    slices.setdefault(name, []).append((rng, v.reshape(-1)))
        for name, parts in slices.items():
            parts.sort(key=lambda p: p[0])
            assert all(a[0][1] == b[0][0] for a, b in zip(parts, parts[1:])) and parts[0][0][0] == 0, f"{name}: slices do not tile"
            out[name] = np.concatenate([v for _, v in parts])
        return out

    from mspretrain.checkpoint.model_shards import read_whole  # model.safetensors or ZeRO-3's per-rank files

    for a, b, tol in ((read_whole(got), read_whole(want), rtol),
                      (optimizer(got), optimizer(want), rtol if moments_rtol is None else moments_rtol)):
        assert a and set(a) == set(b), sorted(set(a) ^ set(b))
        for k in sorted(b):
            if k == "opt_step":
                assert int(np.asarray(a[k]).reshape(-1)[0]) == int(np.asarray(b[k]).reshape(-1)[0])
            else:  # (a split parameter's joined state is flat)
                assert_close_rel(a[k].reshape(b[k].shape) if a[k].size == b[k].size else a[k], b[k], tol, f"{got.name} {k}")


# `make test` runs the suite in two pytest-xdist workers, one per core (`-n 2 --dist loadfile`, the
# Makefile): a worker takes one test file at a time (its module fixtures are built once), the next
# when it is done, so the two end together without a hand-balanced list; a file that launches ranks
# is not handed to one worker while the other has one left (`pytest_xdist_make_scheduler` below,
# tests/helpers/schedule.py). What files share across
# workers: the tiny data dir, `reference_run`, tests/forensics/planted.py's run, the two-rank session
# runs and the walkthrough are built once for both (`built_once`); two jobs that launch ranks never
# run at once (`one_msrun_at_a_time`). `groups` names each file's class for the order (no longer
# an xdist group: xdist 3.8's loadgroup under pytest 9 put every test of a group on either worker,
# and two msrun jobs ran side by side): files with an msrun job first, then files with `slow`
# tests, so the short files fill the end of both workers.
TWO_RANK_RUNS = frozenset({"two_nodes_rewind", "two_ranks_fp32"})
SHARED_RUNS = ("walkthrough",)
MSRUN_GROUP = "msrun"


def groups(items) -> dict[str, str]:
    """Each test file's class for the order, as `tests/pkg/test_x.py` -> name: "msrun" for a file that
    launches ranks, the shared run's name for its readers, else the file itself."""
    by_file: dict[str, list] = {}
    for item in items:
        by_file.setdefault(item.nodeid.split("::")[0], []).append(item)
    out = {}
    for path, its in by_file.items():
        names = set().union(*(getattr(i, "fixturenames", ()) for i in its))
        if any(i.get_closest_marker("msrun") is not None for i in its) or names & TWO_RANK_RUNS:
            out[path] = MSRUN_GROUP
        else:
            out[path] = next((f for f in SHARED_RUNS if f in names), path)
    return out


def pytest_collection_modifyitems(config, items):
    """A test skipped when msrun is missing starts msrun: mark it `msrun` even where the decorator
    was forgotten, so that `make test-fast` (-m "not msrun ...") never starts workers (and takes
    `one_msrun_at_a_time`); then the files with long jobs go first."""
    for item in items:
        if any("msrun" in str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif")):
            item.add_marker(pytest.mark.msrun)
    group = groups(items)
    if os.environ.get("PYTEST_XDIST_WORKER"):  # for the controller's scheduler (tests/helpers/schedule.py)
        from tests.helpers.schedule import write_msrun_files

        write_msrun_files(_shared_root(config._tmp_path_factory), [f for f, g in group.items() if g == MSRUN_GROUP])
    slow = {group[i.nodeid.split("::")[0]] for i in items if i.get_closest_marker("slow") is not None}
    first: dict[str, int] = {}
    for n, item in enumerate(items):
        first.setdefault(group[item.nodeid.split("::")[0]], n)

    def rank(name: str) -> tuple[int, int]:
        return (0 if name == MSRUN_GROUP else 1 if name in slow else 2, first[name])
    items.sort(key=lambda i: rank(group[i.nodeid.split("::")[0]]))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` (`make test`): files that launch ranks handed to one worker at a time
    (tests/helpers/schedule.py says why); any other mode: xdist's own."""
    if config.getvalue("dist") != "loadfile":
        return None
    from tests.helpers.schedule import make_scheduler

    return make_scheduler(config, log)


@pytest.fixture
def world_of(monkeypatch):
    """Collective primitives built as rank r of a world of n without `init()` (as tests/step/collective_probe.py does);
    test_zero3.py and test_tp.py build their gathers and groups with it."""
    from mindspore.ops.operations import comm_ops

    def set_world(rank: int, n: int) -> None:
        monkeypatch.setattr(comm_ops, "get_rank", lambda group=None: rank)
        monkeypatch.setattr(comm_ops, "get_group_size", lambda group=None: n)
    return set_world
