"""Shared fixtures: a small Chinese corpus written by the tests themselves (no network), a data
dir prepared from it once per session, and the tiny config. Expensive things are session-scoped
because MindSpore compiles each new graph in seconds."""
from __future__ import annotations

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


@pytest.fixture(scope="session")
def corpus_file(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("corpus")
    p = d / "poems.txt"
    p.write_text("\n\n".join(make_poems(1200)) + "\n", encoding="utf-8")
    return p


@pytest.fixture(scope="session")
def tiny_cfg():
    from mspretrain import config as cfgmod

    return cfgmod.load(TINY)


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory, corpus_file, tiny_cfg) -> Path:
    from mspretrain.data.prepare import prepare

    out = tmp_path_factory.mktemp("data") / "tiny"
    prepare([str(corpus_file)], out, tiny_cfg.prepare, workers=1, log=lambda s: None)
    return out


# One tiny training run that several test files compare against (single process, fp32, cosine
# schedule over 8 steps, a checkpoint after every step, all kept). Before this, four tests each
# trained their own copy with the same config except `max_steps`: three compilations saved.
REFERENCE_STEPS = 8
# grad_norm_every=1: the grad norm of every step is compared (a gradient scale error that clipping
# and Adam hide from the weights shows there); it does not change the numerics.
REFERENCE_ARGS = (f"train.max_steps={REFERENCE_STEPS}", "checkpoint.every=1", f"checkpoint.keep_last={REFERENCE_STEPS}",
                  "metrics.grad_norm_every=1")


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory, tiny_data) -> Path:
    """Read-only: copy it (shutil.copytree) before training on or damaging it."""
    from mspretrain.cli import main

    run = tmp_path_factory.mktemp("reference") / "run"
    assert main(["train", "--config", str(TINY), "--data", str(tiny_data), "--run", str(run), "--quiet",
                 "train.log_every=1", *REFERENCE_ARGS]) == 0
    return run


FP16_MASTERS = ("precision.dtype=fp16", "precision.param_dtype=compute", "precision.loss_scale=static")


@pytest.fixture(scope="session")
def one_fp16(tmp_path_factory, tiny_data) -> Path:
    """The reference run's config in fp16 with fp16 matrices and fp32 masters, on one process: what
    the fp16-masters msrun tests of tests/test_zero2.py and tests/test_zero3.py compare against
    (each trained it for itself before). Read-only."""
    from mspretrain.cli import main

    one = tmp_path_factory.mktemp("one-fp16") / "one-fp16"
    assert main(["train", "--config", str(TINY), "--data", str(tiny_data), "--run", str(one), *REFERENCE_ARGS, "--quiet",
                 "train.log_every=1", *FP16_MASTERS]) == 0
    return one


# A spike `rewind` run in one process (checkpoints every 4 steps, lr 10x the reference's so that
# spikes come): what the 2-rank msrun rewind run (tests/test_distributed.py) and the two-node one
# (tests/test_multinode.py) must equal. Both used to train this same run of their own.
REWIND_ARGS = ("train.max_steps=14", "checkpoint.every=4", "spike.action=rewind", "spike.threshold=0.02", "spike.window=3",
               "schedule.warmup_steps=1", "optim.lr=0.01")


@pytest.fixture(scope="session")
def rewind_one_process(tmp_path_factory, tiny_data) -> Path:
    """Read-only, like `reference_run`."""
    from mspretrain.cli import main

    run = tmp_path_factory.mktemp("rewind") / "one"
    assert main(["train", "--config", str(TINY), "--data", str(tiny_data), "--run", str(run), "--quiet", *REWIND_ARGS]) == 0
    return run


@pytest.fixture(scope="session")
def two_ranks_fp32(tmp_path_factory, tiny_data) -> Path:
    """`reference_run`'s config on 2 ranks, fp32 wire, one AllReduce bucket (the default), launched
    as two "nodes" of one worker each (two `mspretrain launch --nodes 2` processes, see
    tests/test_multinode.py): compared with one process (tests/test_distributed.py, and with its
    log dirs and a resume on two nodes in tests/test_multinode.py) and with one AllReduce per
    parameter on one 2-worker msrun (tests/test_zero2.py). One job for the three: the two-node
    job and a 2-worker msrun of this config each trained the same 8 steps before. Read-only."""
    from tests.test_multinode import two_nodes

    tmp = tmp_path_factory.mktemp("two-ranks")
    run = tmp / "two-fp32"
    two_nodes(tmp, tiny_data, run, *REFERENCE_ARGS, "precision.allreduce_dtype=fp32")
    return run


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


def assert_same_checkpoint(got: Path, want: Path, rtol: float) -> None:
    """Model and optimizer files of two checkpoint dirs (any number of optimizer shards) agree
    tensor by tensor within `rtol` (relative_error), with the same names and the same AdamW step."""
    from safetensors.numpy import load_file

    def optimizer(d: Path) -> dict:
        from mspretrain.train.step import parse_key

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

    for a, b in ((load_file(str(got / "model.safetensors")), load_file(str(want / "model.safetensors"))),
                 (optimizer(got), optimizer(want))):
        assert a and set(a) == set(b), sorted(set(a) ^ set(b))
        for k in sorted(b):
            if k == "opt_step":
                assert int(np.asarray(a[k]).reshape(-1)[0]) == int(np.asarray(b[k]).reshape(-1)[0])
            else:  # (a split parameter's joined state is flat)
                assert_close_rel(a[k].reshape(b[k].shape) if a[k].size == b[k].size else a[k], b[k], rtol, f"{got.name} {k}")


# The files whose tests start msrun (2 workers + a scheduler each). Under pytest-xdist their msrun
# tests are one unit of work, run first and one after another on one worker: two msrun jobs at once
# would starve each other's heartbeats on 2 cores. The files' other tests (tables, one-process
# steps, the CPU selftest) are units of their own, free for either worker. A new msrun test
# elsewhere is refused at collection.
MSRUN_FILES = ("tests/test_distributed.py", "tests/test_multinode.py", "tests/test_selftest.py", "tests/test_zero2.py",
               "tests/test_zero3.py", "tests/test_tp.py")


def pytest_collection_modifyitems(config, items):
    """A test skipped when msrun is missing starts msrun: mark it `msrun` even where the decorator was
    forgotten, so that `make test-fast` (-m "not msrun ...") never starts workers.

    The order is the queue pytest-xdist hands out (`make test`: -n 2 --dist loadfile, see
    `pytest_xdist_make_scheduler` below): the msrun tests first, then the files with `slow` tests,
    then the rest, each file's tests in their own order (longest units first leave the least idle
    tail). Only the order of files changes; a test never depends on another file having run."""
    for item in items:
        if any("msrun" in str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif")):
            item.add_marker(pytest.mark.msrun)
    msrun_tests = _msrun_tests()
    for item in items:
        marked = item.get_closest_marker("msrun") is not None
        if marked and _file(item.nodeid) not in MSRUN_FILES:
            raise pytest.UsageError(f"{item.nodeid} starts msrun: add its file to MSRUN_FILES in tests/conftest.py "
                                    "(pytest-xdist then never runs it beside another msrun test)")
        if _file(item.nodeid) in MSRUN_FILES and marked != (_test_key(item.nodeid) in msrun_tests):
            raise pytest.UsageError(f"{item.nodeid}: its msrun mark and what tests/conftest.py's _msrun_tests() reads "
                                    "from the source disagree (mark the test with @pytest.mark.msrun or a module "
                                    "pytestmark, as the other msrun tests are)")
    slow_files = {_file(i.nodeid) for i in items if i.get_closest_marker("slow")}
    items.sort(key=lambda i: 0 if i.get_closest_marker("msrun") else 1 if _file(i.nodeid) in slow_files else 2)


def _file(nodeid: str) -> str:
    return nodeid.split("::")[0]


def _test_key(nodeid: str) -> str:
    """`tests/test_x.py::test_name` of a node id (its parameters cut off)."""
    return f"{_file(nodeid)}::{nodeid.split('::')[-1].split('[')[0]}"


def _msrun_tests() -> frozenset:
    """`_test_key`s of the tests in MSRUN_FILES that start msrun, read from their source: the
    scheduler runs in pytest-xdist's controller, which collects nothing and sees node ids only.
    A test counts when a decorator or the module's `pytestmark` names `mark.msrun` or a skipif for
    a missing msrun; pytest_collection_modifyitems checks the result against the real marks."""
    import ast

    def says_msrun(node: ast.AST) -> bool:
        text = ast.unparse(node)
        return "mark.msrun" in text or ("skipif" in text and "msrun" in text)

    keys = set()
    for name in MSRUN_FILES:
        tree = ast.parse((ROOT / name).read_text(encoding="utf-8"))
        module_wide = any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
                          and says_msrun(n.value) for n in tree.body)
        for n in ast.walk(tree):
            if isinstance(n, ast.FunctionDef) and n.name.startswith("test"):
                if module_wide or any(says_msrun(d) for d in n.decorator_list):
                    keys.add(f"{name}::{n.name}")
    return frozenset(keys)


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist: unknown (and unused) without it
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile`, with the msrun tests as one unit: each test file goes whole to one worker
    (its module fixtures are built once), and the msrun tests of all MSRUN_FILES together to one
    worker (their files' other tests are each file's own unit). The units are handed out in
    collection order (above), not xdist's biggest-count-first. pytest-xdist's own `loadgroup`
    would say this with marks, but on pytest 9.2 its group suffix on the node id no longer takes
    effect (pytest-dev/pytest-xdist#1386), so the grouping is by node id here."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    msrun_tests = _msrun_tests()

    class MsrunTestsTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "msrun" if _test_key(nodeid) in msrun_tests else _file(nodeid)

    config.option.loadscopereorder = False
    return MsrunTestsTogether(config, log)
