"""HTML report: from a real tiny run and from synthetic run dirs (live, partial, sparse), plus
TensorBoard dashboard wiring and a headless-Chromium screenshot when Chromium is installed."""
from __future__ import annotations

import base64
import io
import json
import math
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mspretrain.cli import main
from mspretrain.config import schema as cfgmod
from mspretrain.forensics.report import build_report
from mspretrain.forensics.report_summary import read_metrics, summarize
from tests.conftest import ONE_LAYER

PANELS = ("loss", "eval_ppl", "lr", "grad_norm", "loss_scale", "throughput", "memory")


class _Collect(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.imgs: list[str] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag == "img":
            self.imgs.append(dict(attrs)["src"])

    def handle_data(self, data):
        self.text.append(data)


def parse(html_path: Path) -> _Collect:
    p = _Collect()
    p.feed(html_path.read_text(encoding="utf-8"))
    p.close()
    return p


def assert_plot_png(data: bytes) -> None:
    img = np.asarray(Image.open(io.BytesIO(data)).convert("L"), dtype=np.float32)
    assert img.shape[0] > 100 and img.shape[1] > 300
    # A plot has ink: a good share of non-white pixels, not a blank canvas.
    assert (img < 200).mean() > 0.01


def write_data_dir(root: Path) -> Path:
    d = root / "data"
    d.mkdir()
    (d / "manifest.json").write_text(json.dumps({
        "fingerprint": "abc123", "tokens": {"train": 51200, "valid": 1000}, "vocab_size": 1000,
        "special_ids": {"bos": 1, "eos": 2, "pad": 0, "unk": 3}, "documents": {"train": 300, "valid": 5},
        "characters": 80000, "chars_per_token": 1.56}))
    return d


def synthetic_run(root: Path, *, partial: bool = True, world: int = 2, overrides: tuple[str, ...] = ()) -> Path:
    run = root / "run"
    run.mkdir()
    # 200 of 400 steps logged: the run is still going
    cfg = cfgmod.load(None, ["train.max_steps=400", "cost.price_per_device_hour=3.0", "schedule.warmup_steps=10", *overrides])
    cfgmod.save(cfg, run / "config.toml")
    (run / "run_meta.json").write_text(json.dumps({"data_dir": str(write_data_dir(root)), "world_size": world,
                                                   "hardware": {"device": "cpu", "cpus": 2}}))
    lines = []
    for s in range(1, 201):
        rec = {"step": s, "loss": 6.0 - 2.0 * (1 - math.exp(-s / 50)), "lr": 3e-4, "loss_scale": 1024.0, "skipped": 0}
        if s == 120:
            rec["loss"] += 1.0  # the planted spike
        if s % 10 == 0:
            rec.update(grad_norm=1.0, tokens_per_s=2000.0, mfu=0.31, elapsed_s=s * 0.5)
        if s % 50 == 0:
            rec.update({"mem_mb": 800.0 + s, "eval/ppl": 300.0 / s})
        lines.append(json.dumps(rec))
    text = "\n".join(lines) + "\n"
    if partial:
        text += '{"step": 201, "loss": 3.9'  # the writer is mid-line: a live run
    (run / "metrics.jsonl").write_text(text)
    return run


def test_report_from_synthetic_live_run(tmp_path):
    run = synthetic_run(tmp_path)
    out = build_report(run)
    assert out == run / "report" / "report.html"
    page = parse(out)
    assert len(page.imgs) == len(PANELS)
    for src, stem in zip(page.imgs, PANELS):
        assert src.startswith("data:image/png;base64,")
        data = base64.b64decode(src.split(",", 1)[1])
        assert data == (run / "report" / f"{stem}.png").read_bytes()
        assert_plot_png(data)
    text = " ".join(page.text)
    assert "step 120: loss spike" in text  # the spike is listed (and marked on the loss plot)
    assert "1 unreadable line" in text and "may still be going" in text
    assert "abc123" in text and "51,200" in text  # the data manifest summary
    s = summarize(run)
    assert s["last_step"] == 200 and s["world_size"] == 2
    assert s["tokens"] == 200 * 8 * 64  # steps x global batch x seq len (no `tokens` logged)
    assert s["hours"] == pytest.approx(100 / 3600) and s["hours_note"] == "logged"
    assert s["cost"] == pytest.approx(100 / 3600 * 2 * 3.0)
    assert s["best_ppl"] == pytest.approx(1.5)
    assert [e["step"] for e in s["events"] if e["kind"] == "loss_spike"] == [120]


def test_report_with_missing_metrics_and_out_file(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 3.0 / s}) + "\n" for s in range(1, 30)))
    out = build_report(run, tmp_path / "elsewhere" / "r.html")
    page = parse(out)
    assert len(page.imgs) == 1  # only the loss panel has data
    assert " ".join(page.text).count("no data in metrics.jsonl") == len(PANELS) - 1
    assert sorted(p.name for p in (run / "report").glob("*.png")) == ["loss.png"]


def test_read_metrics_later_line_wins_and_bad_lines_counted(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text('{"step": 2, "loss": 1}\n{"step": 1, "loss": 5}\nnot json\n{"step": 2, "loss": 7, "lr": 1}\n')
    recs, bad = read_metrics(p)
    assert recs == [{"step": 1, "loss": 5}, {"step": 2, "loss": 7, "lr": 1}] and bad == 1


def test_report_cli(tmp_path, capsys):
    run = synthetic_run(tmp_path, partial=False)
    assert main(["report", str(run), "--out", str(tmp_path / "x.html")]) == 0
    assert (tmp_path / "x.html").is_file()
    assert main(["report", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_dashboard_binds_localhost_or_says_how_to_install(tmp_path, capsys, monkeypatch):
    from mspretrain.commands import dashboard

    (tmp_path / "tb").mkdir()
    monkeypatch.setattr(dashboard, "tensorboard_command", lambda logdir, port: None)
    assert main(["dashboard", str(tmp_path)]) == 2
    assert "pip install" in capsys.readouterr().err
    calls = []
    monkeypatch.setattr(dashboard, "tensorboard_command", lambda logdir, port: ["tb", logdir, "127.0.0.1", str(port)])
    monkeypatch.setattr(dashboard.subprocess, "call", lambda cmd: calls.append(cmd) or 0)
    assert main(["dashboard", str(tmp_path), "--port", "7007"]) == 0
    assert calls == [["tb", str(tmp_path / "tb"), "127.0.0.1", "7007"]]
    monkeypatch.undo()
    cmd = dashboard.tensorboard_command("d", 6006)
    assert cmd is None or cmd[cmd.index("--host") + 1] == "127.0.0.1"
    # TensorBoard is absent from the test venv (cmd is None above): build the real command lines
    # as if it were installed, as an executable on PATH and as a module only, and run `dashboard`
    # through the real tensorboard_command.
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(dashboard.shutil, "which", lambda name: "/opt/tb/bin/tensorboard" if name == "tensorboard" else None)
    assert dashboard.tensorboard_command("d", 6006) == ["/opt/tb/bin/tensorboard", "--logdir", "d", "--host", "127.0.0.1", "--port", "6006"]
    calls = []
    monkeypatch.setattr(dashboard.subprocess, "call", lambda cmd: calls.append(cmd) or 0)
    assert main(["dashboard", str(tmp_path), "--port", "7007"]) == 0
    assert calls == [["/opt/tb/bin/tensorboard", "--logdir", str(tmp_path / "tb"), "--host", "127.0.0.1", "--port", "7007"]]
    assert "http://127.0.0.1:7007" in capsys.readouterr().out
    monkeypatch.setattr(dashboard.shutil, "which", lambda name: None)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "tensorboard" else real_find_spec(name, *a))
    assert dashboard.tensorboard_command("d", 6006) == [sys.executable, "-m", "tensorboard.main", "--logdir", "d",
                                                         "--host", "127.0.0.1", "--port", "6006"]


# ------------------------------------------------------------------ a real tiny run

@pytest.fixture(scope="module")
def real_run(tmp_path_factory):
    """Twelve steps of the tiny config through the real Trainer, on a random-token data dir."""
    from mspretrain.data.shards import ShardWriter, token_dtype
    from mspretrain.train.build import build_trainer as Trainer

    root = tmp_path_factory.mktemp("real")
    data = root / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    tokens = {}
    for split, n in (("train", 60), ("valid", 8)):
        w = ShardWriter(data / split, token_dtype(256))
        tokens[split] = 0
        for _ in range(n):
            doc = np.append(rng.integers(4, 256, size=int(rng.integers(20, 60))), 2)
            w.add(doc)
            tokens[split] += len(doc)
        w.finalize()
    (data / "manifest.json").write_text(json.dumps({
        "fingerprint": "fp-real", "tokens": tokens, "vocab_size": 256, "documents": {"train": 60, "valid": 8},
        "special_ids": {"bos": 1, "eos": 2, "pad": 0, "unk": 3}}))
    cfg = cfgmod.load(Path(__file__).parents[2] / "configs" / "tiny.toml", [
        "train.max_steps=12", "metrics.grad_norm_every=2", "metrics.memory_every=3", "metrics.throughput_every=2",
        "eval.every=6", "eval.max_tokens=256", "checkpoint.every=0", "cost.price_per_device_hour=2.0", ONE_LAYER])
    Trainer(cfg, data, root / "run", log=lambda s: None).train()
    return root / "run"


def test_report_from_real_tiny_run(real_run):
    out = build_report(real_run)
    page = parse(out)
    assert len(page.imgs) == len(PANELS)  # the trainer logs every metric a panel needs
    for src in page.imgs:
        assert_plot_png(base64.b64decode(src.split(",", 1)[1]))
    s = summarize(real_run)
    assert s["last_step"] == 12 and s["mean_tokens_per_s"] > 0 and s["cost"] > 0
    assert s["manifest"]["fingerprint"] == "fp-real"
    # a finished run's fresh metrics.jsonl is not "may still be going"
    assert s["ended"] and s["updated_s_ago"] < 600 and "may still be going" not in " ".join(page.text)


def test_a_run_stopped_before_its_budget_is_not_still_going(tmp_path):
    run = synthetic_run(tmp_path, partial=False)
    assert not summarize(run)["ended"]  # 200 of 400 steps, no train.log: it may be going
    (run / "train.log").write_text("2026-01-01 00:00:00 device cpu, 2 threads; world 1; micro-batch 8 x 1 accumulation\n"
                                   "2026-01-01 00:09:00 stopped by SIGTERM after step 200; checkpoint written.\n")
    assert summarize(run)["ended"]
    with open(run / "train.log", "a") as f:  # resumed: a new session is under way
        f.write("2026-01-01 01:00:00 device cpu, 2 threads; world 1; micro-batch 8 x 1 accumulation\n")
    assert not summarize(run)["ended"]


def test_a_tensor_parallel_runs_budget_splits_the_batch_over_its_data_parallel_ranks(tmp_path):
    """4 ranks at tp 2 are 2 data-parallel ranks: a global batch of 2 splits over them (over all 4 it
    would not, and the report lost the run's budget and its warm-up)."""
    run = synthetic_run(tmp_path, world=4, overrides=("parallel.tp=2", "train.global_batch=2"))
    summary = summarize(run)
    assert summary["budget_steps"] == 400 and summary["warmup"] == 10


CHROMIUM = shutil.which("chromium") or (Path("/usr/bin/chromium").exists() and "/usr/bin/chromium")


@pytest.mark.skipif(not CHROMIUM, reason="Chromium is not installed (Debian package `chromium`)")
def test_report_screenshot_in_headless_chromium(tmp_path):
    run = synthetic_run(tmp_path)
    html_path = build_report(run)
    shot = tmp_path / "shot.png"
    subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", f"--screenshot={shot}",
                    "--window-size=1100,2200", "--hide-scrollbars", html_path.as_uri()],
                   check=True, timeout=120, capture_output=True)
    img = np.asarray(Image.open(shot).convert("L"), dtype=np.float32)
    assert img.shape == (2200, 1100)
    assert (img < 200).mean() > 0.02  # text and plots were painted, not an empty page


# ------------------------------------------------------------------ what the report says

def test_report_events_come_from_train_log_and_wall_time_covers_every_session(tmp_path):
    # item 5: a Ctrl-C and a resume showed as "Events: none", and wall time covered the last session only
    run = synthetic_run(tmp_path, partial=False)
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for r in recs:
        if "elapsed_s" in r and r["step"] > 100:
            # a second session restarts the clock; its first step (compiling) is slower than all of session 1
            r["elapsed_s"] = 60.0 + (r["step"] - 100) * 0.25
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (run / "train.log").write_text(
        "2026-12-01 08:00:00 device cpu, 2 threads; world 1; micro-batch 8 x 1 accumulation\n"
        "2026-12-01 08:00:00 schedule cosine: warm-up 10 steps to lr 0.0003, 200 steps in all, min lr 3e-05\n"
        "2026-12-01 08:00:50 received SIGTERM (or Ctrl-C): finishing step 101, then writing a checkpoint\n"
        "2026-12-01 08:00:51 stopped by SIGTERM after step 101; checkpoint written. Resume with: ...\n"
        "2026-12-01 08:05:00 resumed from step_000100: step 100, 51,200 tokens seen, loss scale 1024\n"
        "2026-12-01 08:05:00 device cpu, 2 threads; world 1; micro-batch 8 x 1 accumulation\n"
        "2026-12-01 08:05:01 step 150/200 | loss 4.1 | lr 3e-04 | gnorm 1.0\n")
    s = summarize(run)
    assert s["sessions"] == 2 and s["hours_note"] == "logged, sum of 2 sessions"
    assert s["hours"] == pytest.approx((50.0 + 85.0) / 3600)  # session 1 ends at 50 s (step 100), session 2 at 85 s
    assert [line[20:36] for line in s["log_events"]] == ["received SIGTERM", "stopped by SIGTE", "resumed from ste"]
    text = " ".join(parse(build_report(run)).text)
    assert "received SIGTERM (or Ctrl-C): finishing step 101" in text and "resumed from step_000100" in text
    assert "step 150/200" not in text  # progress lines are not events
    (run / "train.log").unlink()  # without the log, the clock's drop alone marks a session: not here (60 > 50)
    assert summarize(run)["sessions"] == 1


def test_report_says_what_its_numbers_are(tmp_path):
    # item 10: documents as numbers not JSON, the warm-up that ran, peak memory, one throughput curve,
    # and "no loss scaling" for an fp32 run instead of a flat line on a +-0.04 axis
    from mspretrain.forensics.report_plots import plot_panel

    run = synthetic_run(tmp_path, partial=False)
    cfgmod.save(cfgmod.load(None, ["train.max_steps=200", "schedule.warmup_steps=\"auto\""]), run / "config.toml")
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for r in recs:
        r["loss_scale"] = 1.0
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    s = summarize(run)
    # auto warm-up: ceil(0.02 x 51,200 / (8 x 64)) = 2, as the trainer's schedule resolves it
    assert s["warmup"] == 2
    page = build_report(run).read_text(encoding="utf-8")
    assert "train 300, valid 5" in page and '{"train"' not in page
    assert "cosine, warm-up 2 steps (auto)" in page
    assert 'alt="Peak memory (host RSS' in page and 'alt="Throughput (right axis: MFU)"' in page
    fig = plot_panel("throughput", "t", s)
    assert len(fig.axes[0].lines) == 1  # tokens/s and MFU are one curve with two axes
    fig = plot_panel("loss_scale", "t", s)
    ax = fig.axes[0]
    assert ax.get_ylim() == (0.0, 2.0)
    assert any("no loss scaling (fp32)" in t.get_text() for t in ax.texts)


def test_report_shows_accuracy_and_where_the_weights_came_from(tmp_path):
    """eval/acc from metrics.jsonl (a panel and the summary line) and run_meta.json's init_from
    (path, kind, every weight file's SHA-256, the resized row counts)."""
    run = synthetic_run(tmp_path, partial=False)
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    for rec in lines:
        if rec["step"] % 50 == 0:
            rec.update({"eval/acc": rec["step"] / 400, "eval/acc_norm": 0.25})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    meta = json.loads((run / "run_meta.json").read_text())
    sha = "9f" * 32
    meta["init_from"] = {"path": "/models/llama2-7b-ms", "kind": "mspretrain checkpoint", "dir": "/models/llama2-7b-ms",
                         "files": {"model.safetensors": sha},
                         "resized": {"base_vocab": 32000, "vocab": 49953, "split_mean": 17950, "overall_mean": 3,
                                     "overall_mean_ids": [1, 2, 3]}}
    (run / "run_meta.json").write_text(json.dumps(meta))
    out = build_report(run)
    page = parse(out)
    assert (run / "report" / "eval_acc.png").is_file()
    assert len(page.imgs) == len(PANELS) + 1
    assert_plot_png((run / "report" / "eval_acc.png").read_bytes())
    text = " ".join(page.text)
    assert "50.0 % (length-normalised 25.0 %) at step 200" in text
    assert "/models/llama2-7b-ms (mspretrain checkpoint)" in text and sha in text
    assert "32,000 -> 49,953: 17,950 new rows" in text and "3 from the overall mean" in text
    s = summarize(run)
    assert s["last_acc"] == (200, 0.5, 0.25) and s["init_from"]["files"] == {"model.safetensors": sha}
    # a run from random weights has neither section
    (tmp_path / "plain").mkdir()
    plain = parse(build_report(synthetic_run(tmp_path / "plain")))
    assert "Initial weights" not in " ".join(plain.text) and len(plain.imgs) == len(PANELS)
