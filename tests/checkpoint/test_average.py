"""`mspretrain average` (checkpoint/average.py): the mean of N checkpoints' tensors, from one-process
files and from ZeRO-3's per-rank files, in bounded memory, as a verified checkpoint that eval,
generate, export and `train --init-from` take; refusals leave nothing behind.

The checkpoints of most tests are written here with numpy (store.write_checkpoint_dir, and for
ZeRO-3 the per-rank protocol of checkpoint/shards.py, as tests/checkpoint/test_zero3_checkpoint.py does): no
MindSpore model is built for them. One test averages the real `reference_run`."""
from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from tests.conftest import TINY
from tests.helpers.cli import assert_refusal, cli

SHAPES = {"embed.weight": (64, 16), "layers.0.attn.wq.weight": (16, 16), "norm.weight": (16,), "lm_head.weight": (64, 16)}


def _tensors(seed: int, shapes=SHAPES) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.normal(0, 1, s).astype(np.float32) for k, s in shapes.items()}


def _cfg(family: str = "llama"):
    from mspretrain.config import schema as cfgmod

    cfg = cfgmod.load(TINY)
    return replace(cfg, model=replace(cfg.model, family=family, qkv_bias=family == "qwen2"))


def _write_whole(run: Path, step: int, tensors: dict[str, np.ndarray], family: str = "llama") -> Path:
    from mspretrain.checkpoint import store

    d = run / "checkpoints" / store.step_dir_name(step)
    return store.write_checkpoint_dir(d, step=step, model=tensors, optimizer={"opt_step": np.array([step], np.int64)},
                                      train_state={"applied_steps": step}, data_state={}, config=_cfg(family))


def _write_zero3(run: Path, step: int, tensors: dict[str, np.ndarray], world: int = 2) -> Path:
    """The per-rank files a `world`-rank ZeRO-3 job writes: rank r's 1-D slice `NAME@a:b` of every
    parameter (step/zero3.py slice_state's cut), rank 1.. staged and collected by rank 0."""
    from mspretrain.checkpoint import shards, store
    from mspretrain.checkpoint.model_shards import model_shard_name, shard_metadata
    from mspretrain.parallel.layout import slice_bounds

    root = run / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    shapes = {k: v.shape for k, v in tensors.items()}

    def part(rank: int) -> dict[str, np.ndarray]:
        out = {}
        for k, v in tensors.items():
            a, b = slice_bounds(math.prod(v.shape), world, rank)
            out[f"{k}@{a}:{b}"] = v.reshape(-1)[a:b].copy()
        return out

    opt = {"opt_step": np.array([step], np.int64)}
    for rank in range(1, world):
        shards.write_shard(root, step, rank, world, opt, model=part(rank), model_metadata=shard_metadata(step, shapes))
    return store.write_checkpoint_dir(root / store.step_dir_name(step), step=step, model=part(0), optimizer=opt,
                                      train_state={"applied_steps": step}, data_state={}, config=_cfg(),
                                      optimizer_file=store.optimizer_shard_name(0, world), model_file=model_shard_name(0, world),
                                      model_metadata=shard_metadata(step, shapes),
                                      collect=lambda tmp: shards.collect(root, step, world, tmp))


def _mean(ts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {k: np.mean(np.stack([t[k].astype(np.float64) for t in ts]), axis=0).astype(np.float32) for k in ts[0]}


def _assert_mean(out: Path, want: dict[str, np.ndarray]) -> None:
    got = load_file(str(out / "model.safetensors"))
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == np.float32 and got[k].shape == want[k].shape, k
        assert np.max(np.abs(got[k] - want[k])) <= 1e-7, k


def _assert_verified_by_the_cli(capsys, out: Path) -> None:
    """`checkpoints RUN --verify` lists the run's averages (RUN/averaged/*) and verifies them."""
    from mspretrain.checkpoint import store

    assert store.verify(out) is None
    code, stdout, _ = cli(capsys, "checkpoints", out.parent.parent, "--verify")
    assert code == 0, stdout
    assert any(out.name in line and "verified" in line for line in stdout.splitlines()), stdout


def test_uniform_average_of_one_process_checkpoints_is_their_mean_and_verifies(tmp_path, capsys):
    run = tmp_path / "run"
    ts = {s: _tensors(s) for s in (2, 4, 6, 8)}
    for s, t in ts.items():
        _write_whole(run, s, t)
    code, out, err = cli(capsys, "average", run, "--last", "3", "--quiet")
    assert code == 0, err
    dest = Path(out.strip())
    assert dest == run / "averaged" / "uniform-3ckpt-to-step_000008"
    _assert_mean(dest, _mean([ts[4], ts[6], ts[8]]))
    _assert_verified_by_the_cli(capsys, dest)
    state = json.loads((dest / "train_state.json").read_text())
    assert state["step"] == 8 and state["weights_only"] and [s["step"] for s in state["averaged"]["sources"]] == [4, 6, 8]
    # --steps picks any of them; the same output dir again is refused, nothing touched
    code, _, err = cli(capsys, "average", run, "--steps", "2,8", "--out", tmp_path / "two")
    assert code == 0, err
    _assert_mean(tmp_path / "two", _mean([ts[2], ts[8]]))
    before = (dest / "model.safetensors").read_bytes()
    code, _, err = cli(capsys, "average", run, "--last", "3")
    assert_refusal(code, err, "already exists")
    assert (dest / "model.safetensors").read_bytes() == before


def test_ema_average_weights_each_checkpoint_as_the_recursion_does(tmp_path, capsys):
    from mspretrain.checkpoint.average import ema_weights

    run = tmp_path / "run"
    ts = [_tensors(s) for s in range(3)]
    for s, t in enumerate(ts):
        _write_whole(run, s + 1, t)
    code, _, err = cli(capsys, "average", run, "--last", "3", "--ema", "0.75", "--out", tmp_path / "ema")
    assert code == 0, err
    e = {k: v.astype(np.float64) for k, v in ts[0].items()}  # e_1 = w_1, e_k = d e_{k-1} + (1 - d) w_k
    for t in ts[1:]:
        e = {k: 0.75 * e[k] + 0.25 * t[k] for k in e}
    _assert_mean(tmp_path / "ema", {k: v.astype(np.float32) for k, v in e.items()})
    assert ema_weights(3, 0.75) == pytest.approx([0.5625, 0.1875, 0.25]) and sum(ema_weights(7, 0.9)) == pytest.approx(1)


def test_average_of_zero3_per_rank_files_is_their_mean_and_verifies(tmp_path, capsys):
    run = tmp_path / "run"
    # the norm weight (16 elements) is under world^2 = 9 elements' cut too: every parameter sliced
    ts = [_tensors(10 + s) for s in range(3)]
    for s, t in enumerate(ts):
        _write_zero3(run, s + 1, t, world=3)
    names = {p.name for p in (run / "checkpoints" / "step_000001").iterdir()}
    assert "model.safetensors" not in names and "model-00002-of-00003.safetensors" in names
    code, _, err = cli(capsys, "average", run, "--last", "3")
    assert code == 0, err
    dest = run / "averaged" / "uniform-3ckpt-to-step_000003"
    _assert_mean(dest, _mean(ts))
    _assert_verified_by_the_cli(capsys, dest)
    # a one-process checkpoint and ZeRO-3 files of the same shapes average together
    _write_whole(run, 4, _tensors(99))
    code, _, err = cli(capsys, "average", run, "--steps", "3,4", "--out", tmp_path / "mixed")
    assert code == 0, err
    _assert_mean(tmp_path / "mixed", _mean([ts[2], _tensors(99)]))


def _nothing_written(run: Path, tmp_path: Path) -> None:
    assert not (run / "averaged").exists()
    assert not list(tmp_path.glob("out*"))


@pytest.mark.parametrize("case", ["shape", "names", "family", "missing", "corrupt", "too_few", "into_checkpoints", "decay"])
def test_refusals_are_one_line_and_write_nothing(tmp_path, capsys, case):
    run = tmp_path / "run"
    _write_whole(run, 1, _tensors(1))
    _write_whole(run, 2, _tensors(2))
    argv = ["average", run, "--last", "3", "--out", tmp_path / "out"]
    if case == "shape":
        _write_whole(run, 3, _tensors(3, {**SHAPES, "norm.weight": (17,)}))
        needle = "norm.weight has shape [17]"
    elif case == "names":
        _write_whole(run, 3, {**_tensors(3), "extra.weight": np.zeros(3, np.float32)})
        needle = "extra.weight is only in checkpoint step_000003"
    elif case == "family":
        _write_whole(run, 3, _tensors(3), family="qwen2")
        needle = "qwen2 model"
    elif case == "missing":
        argv = ["average", run, "--steps", "1,5", "--out", tmp_path / "out"]
        needle = "no checkpoint of step 5"
    elif case == "corrupt":
        d = _write_whole(run, 3, _tensors(3))
        blob = bytearray((d / "model.safetensors").read_bytes())
        blob[-1] ^= 1
        (d / "model.safetensors").write_bytes(bytes(blob))
        argv = ["average", run, "--steps", "1,2,3", "--out", tmp_path / "out"]
        needle = "step_000003 does not verify"
    elif case == "decay":
        argv = ["average", run, "--last", "2", "--ema", "1", "--out", tmp_path / "out"]
        needle = "--ema 1.0 is not a decay in (0, 1)"
    elif case == "into_checkpoints":
        argv = ["average", run, "--last", "2", "--out", run / "checkpoints" / "step_000003"]
        needle = "would be taken for a training checkpoint"
    else:
        needle = "--last asks for 3"
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    code, _, err = cli(capsys, *argv)
    assert_refusal(code, err, needle)
    _nothing_written(run, tmp_path)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before


def test_peak_memory_is_about_one_tensor_not_the_model(tmp_path):
    """16 tensors of 1 MB (fp32), 3 checkpoints: the mean holds a chunk's float64 sum and one
    source's piece of it at a time. tracemalloc sees numpy's and safetensors' allocations. Measured
    around the part whose memory grows with the model (reading, summing, writing); verifying and
    hashing the files (checkpoint/store.py) use fixed 16 MB buffers whatever the model."""
    import tracemalloc

    from mspretrain.checkpoint import average as avg
    from mspretrain.checkpoint.model_shards import _Index

    shapes = {f"layers.{i}.w": (512, 512) for i in range(16)}
    run = tmp_path / "run"
    for s in (1, 2, 3):
        _write_whole(run, s, _tensors(s, shapes))
    indexes = [_Index(src.dir) for src in avg.select(run, last=3)]
    tensor_bytes, model_bytes = 512 * 512 * 4, 16 * 512 * 512 * 4
    peaks = {}
    for chunk in (avg.CHUNK, 512 * 128):  # whole tensors; a quarter of one
        tracemalloc.start()
        avg.weighted_mean_file(tmp_path / f"out{chunk}.safetensors", indexes, avg.uniform_weights(3), shapes, {}, chunk)
        peaks[chunk] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    # float64 sum (2x), a piece (1x) and its float64 copy (2x) of one tensor, against 3 x 16 MB read
    assert peaks[avg.CHUNK] < 6 * tensor_bytes < model_bytes / 2, peaks
    assert peaks[512 * 128] < 2 * tensor_bytes, peaks
    a, b = (load_file(str(tmp_path / f"out{c}.safetensors")) for c in peaks)
    assert all(a[k].tobytes() == b[k].tobytes() for k in shapes)


@pytest.mark.slow  # eval, generate, export and a training run on the average (~13 s of CPU): end to end
def test_the_average_of_a_real_run_is_taken_by_eval_generate_export_and_init_from(tmp_path, capsys, reference_run, tiny_data):
    """reference_run's last 3 checkpoints (read-only: the output goes elsewhere)."""
    from mspretrain.checkpoint.model_shards import read_whole

    out = tmp_path / "avg"
    code, _, err = cli(capsys, "average", reference_run, "--last", "3", "--out", out)
    assert code == 0, err
    ck = reference_run / "checkpoints"
    _assert_mean(out, _mean([read_whole(ck / f"step_00000{s}") for s in (6, 7, 8)]))
    code, stdout, err = cli(capsys, "eval", out, "--data", tiny_data, "--json", "--max-tokens", "256")
    assert code == 0, err
    assert math.isfinite(json.loads(stdout.strip().splitlines()[-1])["ppl"])
    code, stdout, err = cli(capsys, "generate", out, "--prompt", "春", "--max-new-tokens", "4", "--greedy", "--json")
    assert code == 0, err
    code, _, err = cli(capsys, "export", out, "--format", "hf", "--out", tmp_path / "hf", "--quiet")
    assert code == 0, err
    assert (tmp_path / "hf" / "config.json").is_file()
    code, _, err = cli(capsys, "train", "--config", TINY, "--data", tiny_data, "--run", tmp_path / "run2", "--init-from", out,
                       "--quiet", "train.max_steps=1", "model.n_layers=1", "eval.at_end=false", "schedule.warmup_steps=0")
    assert code == 0, err
    assert (tmp_path / "run2" / "checkpoints" / "step_000001" / "manifest.json").is_file()


def test_a_failed_write_leaves_nothing_behind(tmp_path, monkeypatch, capsys):
    """A full disk while the mean is streamed: one line, no output dir, no .tmp, no new parent dir."""
    import errno

    from mspretrain.checkpoint import average as avg

    run = tmp_path / "run"
    _write_whole(run, 1, _tensors(1))
    _write_whole(run, 2, _tensors(2))

    def full(path, *a, **k):
        Path(path).write_bytes(b"x")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(avg, "weighted_mean_file", full)
    code, _, err = cli(capsys, "average", run, "--last", "2")
    assert_refusal(code, err, "No space left on device")
    assert not (run / "averaged").exists()
