"""Metrics sinks (JSONL + TensorBoard) at their intervals, resume truncation, NFS warning, MFU."""
from __future__ import annotations

import json
import math
import threading

import pytest

from mspretrain.config.schema import Config, MetricsConfig, ModelConfig, resolve_model
from mspretrain.monitor import mfu
from mspretrain.monitor.metrics import MetricsLogger, is_network_fs, mount_of, truncate_metrics
from tests.helpers.runs import read_tb_scalars

CFG = MetricsConfig(loss_every=1, lr_every=2, loss_scale_every=3, grad_norm_every=5, memory_every=7,
                    throughput_every=4)
EVERY = {"loss": 1, "lr": 2, "loss_scale": 3, "grad_norm": 5, "mem_mb": 7, "tokens_per_s": 4, "samples_per_s": 4,
         "mfu": 4, "real_token_share": 4, "tokens_per_device_hour": 4, "cost_per_btok": 4, "skipped": 1}
STEPS = range(1, 31)


def full_values(step: int) -> dict[str, float]:
    return {"loss": 5.0 - step * 0.01, "lr": 1e-4 * step, "loss_scale": 64.0, "grad_norm": 1.5, "mem_mb": 900.0,
            "tokens_per_s": 1000.0, "samples_per_s": 10.0, "mfu": 0.3, "real_token_share": 1.0,
            "tokens_per_device_hour": 3.6e6, "cost_per_btok": 2.0, "skipped": 0}


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("run")
    threads: list[str] = []
    logger = MetricsLogger(run, CFG, log=lambda s: None)
    original = logger._write
    logger._write = lambda rec: (threads.append(threading.current_thread().name), original(rec))[1]
    for step in STEPS:
        logger.log(step, full_values(step))
    logger.log(10, {"eval/ppl": 123.0})
    logger.close()
    return run, threads


def test_each_metric_in_jsonl_exactly_at_its_interval(logged_run):
    run, _ = logged_run
    lines = (run / "metrics.jsonl").read_text().splitlines()
    recs = [json.loads(x) for x in lines]
    for key, every in EVERY.items():
        steps = [r["step"] for r in recs if key in r]
        assert steps == [s for s in STEPS if s % every == 0], key
    assert [r["step"] for r in recs if "eval/ppl" in r] == [10]


def test_each_metric_in_tensorboard_exactly_at_its_interval(logged_run):
    run, _ = logged_run
    tags = read_tb_scalars(run / "tb")
    for key, every in EVERY.items():
        assert sorted(tags[key]) == [s for s in STEPS if s % every == 0], key
    assert tags["eval/ppl"] == [10]


def test_writes_happen_off_the_training_thread(logged_run):
    _, threads = logged_run
    assert threads and set(threads) == {"metrics-writer"}


def test_record_with_only_step_is_not_written(tmp_path):
    with MetricsLogger(tmp_path, MetricsConfig(tensorboard=False), log=lambda s: None) as m:
        m.log(3, {"grad_norm": 1.0})  # grad_norm_every = 50: nothing kept
        m.log(4, {"loss": 2.0, "weird": None})
    assert [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [{"step": 4, "loss": 2.0}]


def test_disabled_rank_writes_nothing(tmp_path):
    m = MetricsLogger(tmp_path / "r1", CFG, enabled=False)
    m.log(1, {"loss": 1.0})
    m.close()
    assert not (tmp_path / "r1").exists()


def test_nan_loss_round_trips(tmp_path):
    with MetricsLogger(tmp_path, MetricsConfig(tensorboard=False), log=lambda s: None) as m:
        m.log(1, {"loss": float("nan")})
    assert math.isnan(json.loads((tmp_path / "metrics.jsonl").read_text())["loss"])


def test_resume_drops_steps_after_checkpoint_and_partial_line(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 11)) + '{"step": 11, "lo')
    with MetricsLogger(tmp_path, MetricsConfig(tensorboard=True), resume_step=6, log=lambda s: None) as m:
        for s in range(7, 9):
            m.log(s, {"loss": 2.0})
    steps = [json.loads(x)["step"] for x in p.read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6, 7, 8]
    assert truncate_metrics(p, 100) == 0  # nothing to drop: the file is not rewritten


MOUNTS = """22 27 0:21 / /proc rw,relatime - proc proc rw
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw
40 27 0:50 / {nfs} rw,relatime shared:7 - nfs4 filer:/export rw,vers=4.2
41 27 0:51 / {fuse} rw - fuse.sshfs user@host:/x rw
42 27 0:52 / /mnt/with\\040space rw - cifs //srv/share rw
"""


def test_nfs_warning_from_faked_mount_table(tmp_path):
    nfs, fuse, local = tmp_path / "nfs", tmp_path / "fuse", tmp_path / "local"
    table = tmp_path / "mountinfo"
    table.write_text(MOUNTS.format(nfs=nfs, fuse=fuse))
    assert mount_of(nfs / "deep" / "run", table)[1] == "nfs4"
    assert mount_of("/mnt/with space/run", table)[:2] == ("/mnt/with space", "cifs")
    assert mount_of(local, table)[1] == "ext4"
    for where, warned in ((nfs / "run", True), (fuse / "run", True), (local / "run", False)):
        msgs: list[str] = []
        MetricsLogger(where, MetricsConfig(tensorboard=False), log=msgs.append, mountinfo=table).close()
        assert any("network filesystem" in m for m in msgs) == warned, where
    assert is_network_fs("fuse.gcsfuse") and is_network_fs("lustre") and not is_network_fs("tmpfs")


# ----------------------------------------------------------------------------- MFU

def test_flops_per_token_by_hand():
    m = resolve_model(ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=1000))
    assert m.ffn_dim == 192
    # per layer: q 64*64, k 64*32, v 64*32, o 64*64, w1 w2 w3 3*64*192; plus lm_head 64*1000
    n = 2 * (64 * 64 + 64 * 32 + 64 * 32 + 64 * 64 + 3 * 64 * 192) + 64 * 1000
    assert mfu.matmul_params(m) == n
    assert mfu.flops_per_token(m, 32) == 6 * n + 12 * 2 * 64 * 32
    assert mfu.flops_per_token(m, 32, ["all"]) == mfu.flops_per_token(m, 32)


def test_flops_per_token_with_frozen_groups_by_hand():
    """Frozen weights get no weight gradient: 4 N + 2 N_trained (+ attention) per token."""
    attn, mlp, head = 2 * (64 * 64 + 64 * 32 + 64 * 32 + 64 * 64), 2 * 3 * 64 * 192, 64 * 1000
    n, att = attn + mlp + head, 12 * 2 * 64 * 32
    m = resolve_model(ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=1000))
    # stage 1 of continued pretraining: the embedding is a gather (no matmul), lm_head is trained
    assert mfu.flops_per_token(m, 32, ["embeddings", "lm_head"]) == 4 * n + 2 * head + att
    assert mfu.flops_per_token(m, 32, ["embeddings"]) == 4 * n + att
    assert mfu.flops_per_token(m, 32, ["attention", "norms"]) == 4 * n + 2 * attn + att
    assert mfu.flops_per_token(m, 32, ["attention", "mlp", "lm_head"]) == 6 * n + att
    tied = resolve_model(ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=1000, tie_embeddings=True))
    # a tied embedding is the lm_head's matrix: training the embeddings trains that matmul
    assert mfu.flops_per_token(tied, 32, ["embeddings"]) == 4 * n + 2 * head + att


def test_llama2_7b_matmul_params_plus_embedding_and_norms_is_hf_count():
    m = ModelConfig(dim=4096, n_layers=32, n_heads=32, vocab_size=32000, ffn_dim=11008, max_seq_len=4096)
    norms = (2 * 32 + 1) * 4096
    assert mfu.matmul_params(m) + 32000 * 4096 + norms == 6_738_415_616


def test_peaks_and_throughput_figures():
    assert mfu.device_peak_tflops("ascend", "bf16") == 313.0
    assert mfu.device_peak_tflops("a100", "fp32") == 19.5
    assert mfu.device_peak_tflops("ascend", "fp32") == 0.0  # unknown: MFU is left out, not invented
    assert mfu.device_peak_tflops("ascend", "fp32", override=90.0) == 90.0
    cpu = mfu.measure_cpu_peak_tflops(0.05)
    assert 1e-5 < cpu < 100 and mfu.device_peak_tflops("cpu", "fp32") > 0
    t = mfu.throughput_metrics(tokens=8000, samples=125, seconds=2.0, flops_per_token=1e9, peak_tflops=10.0,
                               devices=2, real_tokens=6000, price_per_device_hour=3.6)
    assert t["tokens_per_s"] == 4000 and t["samples_per_s"] == 62.5
    assert t["tokens_per_device_hour"] == 4000 * 3600 / 2
    assert t["mfu"] == pytest.approx(4000 * 1e9 / (2 * 10e12))
    assert t["real_token_share"] == 0.75
    assert t["cost_per_btok"] == pytest.approx(3.6 / 7.2e6 * 1e9)
    assert "mfu" not in mfu.throughput_metrics(tokens=1, samples=1, seconds=1, flops_per_token=1, peak_tflops=0, devices=1)


def test_the_cpu_peak_is_measured_once_per_host_and_cores(tmp_path, monkeypatch):
    """Measured on a miss and kept in the cache dir; read back without measuring; another CPU or
    core count measures again beside it; a damaged or unwritable cache still gives a peak."""
    import json
    import os

    calls = []
    monkeypatch.setattr(mfu, "measure_cpu_peak_tflops", lambda seconds=1.0: calls.append(1) or 0.125)
    cache = tmp_path / "cache"
    assert mfu.cpu_peak_tflops(cache) == 0.125 and len(calls) == 1
    stored = json.loads((cache / "cpu_peak_tflops.json").read_text())
    assert stored == {mfu._host_key(): 0.125}
    assert mfu.cpu_peak_tflops(cache) == 0.125 and len(calls) == 1  # read, not measured
    monkeypatch.setenv("MSPRETRAIN_CACHE", str(cache))
    assert mfu.device_peak_tflops("cpu", "fp32") == 0.125 and len(calls) == 1  # what training asks for
    monkeypatch.setattr(mfu, "_host_key", lambda: "another cpu x 64")
    assert mfu.cpu_peak_tflops(cache) == 0.125 and len(calls) == 2
    assert set(json.loads((cache / "cpu_peak_tflops.json").read_text())) == {"another cpu x 64", *stored}
    for damaged in ("{not json", '{"another cpu x 64": "x"}', '{"another cpu x 64": -1}', "[1, 2]"):
        (cache / "cpu_peak_tflops.json").write_text(damaged)
        assert mfu.cpu_peak_tflops(cache) == 0.125
    assert len(calls) == 6
    assert json.loads((cache / "cpu_peak_tflops.json").read_text()) == {"another cpu x 64": 0.125}  # rewritten whole
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        assert mfu.cpu_peak_tflops(locked) == 0.125
    (tmp_path / "a-file").write_text("")
    assert mfu.cpu_peak_tflops(tmp_path / "a-file" / "below") == 0.125  # no dir can be made there: measured anyway


def test_config_defaults_match_field_report_intervals():
    m = Config().metrics
    assert (m.loss_every, m.lr_every, m.grad_norm_every, m.memory_every, m.throughput_every) == (1, 1, 50, 200, 10)
