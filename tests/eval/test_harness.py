"""lm-evaluation-harness on our model (mspretrain/eval/harness.py): the same checkpoint through our
lm-eval model and through lm-eval's `hf` model on its `export --format hf` folder gives every
request's log-likelihood within 1e-4, the same is_greedy flags and accuracy, and identical greedy
generations; a request's score does not depend on its batch; `eval --tasks` runs with the network
off and refuses unknown tasks and missing local data in one line."""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("GLOG_v", "3")

import numpy as np
import pytest

from mspretrain.checkpoint.store import write_weights_only_checkpoint
from mspretrain.config.schema import Config, ModelConfig, resolve_model
from mspretrain.data.tokenizer import Tokenizer
from mspretrain.model.decoder import Decoder, state_numpy
from tests.helpers.cli import assert_refusal, cli
from tests.helpers.hf import HF_VOCAB, train_tokenizer
from tests.helpers.runs import MSRUN, kill_tree

harness = pytest.importorskip("mspretrain.eval.harness")  # needs the eval extra (pinned in [test])
lm_eval = pytest.importorskip("lm_eval")

V = HF_VOCAB
ROOT = Path(__file__).resolve().parents[2]
TASKS = "mspretrain_zh_choices,mspretrain_zh_gen,mspretrain_zh_rolling"  # held back: never trained on here


def random_checkpoint(root, tok_path, *, seed: int = 11, **model):
    """A random tiny model whose head never prefers a byte-fallback piece: with HF's tokenizer a
    run of byte pieces that is not valid UTF-8 decodes to other replacement characters than
    SentencePiece gives, which would compare the decoders, not the models. One layer: the subject is
    the adapter (requests, batching, the cache's prefill), not the layers, which tests/eval/test_eval.py
    and tests/model/ compare with two (each eval shape compiles a graph, ~40 % cheaper with one)."""
    cfg = resolve_model(ModelConfig(**{**dict(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=V, ffn_dim=96,
                                              max_seq_len=64, rope_theta=5000.0, init_std=0.1), **model}))
    tok = Tokenizer.load(tok_path)
    weights = state_numpy(Decoder(cfg, seed=seed))
    head = "embed.weight" if cfg.tie_embeddings else "lm_head.weight"
    dead = [i for i in range(tok.vocab_size) if tok._sp.IsByte(i) or tok._sp.IsUnknown(i) or i == tok.pad_id]
    weights[head][dead] = 0.0
    weights[head] *= 3.0
    ck = root / f"ckpt_{cfg.family}"
    write_weights_only_checkpoint(ck, weights, replace(Config(), model=cfg), tokenizer_path=tok_path)
    return ck


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(checkpoint, our lm-eval model, lm-eval's hf model on the checkpoint's HF export): built once."""
    from lm_eval.models.huggingface import HFLM

    from mspretrain.cli import main

    root = tmp_path_factory.mktemp("harness")
    tok = train_tokenizer(root / "tok" / "tokenizer.model", V)
    ck = random_checkpoint(root, tok)
    assert main(["export", str(ck), "--format", "hf", "--out", str(root / "hf"), "--quiet"]) == 0
    ours = harness.MindSporeLM.from_path(ck, batch_size=4)
    # prefix_token_id: our empty contexts start from EOS (what every document follows in training)
    theirs = HFLM(pretrained=str(root / "hf"), batch_size=1, prefix_token_id=2, device="cpu")
    return root, ck, ours, theirs


def _run(lm, tasks: str, limit=None) -> dict:
    return harness.evaluate(lm, tasks.split(","), limit=limit, log_samples=True, bootstrap_iters=0)


def test_same_scores_and_generations_as_lm_evals_hf_model(pair):
    _, _, ours, theirs = pair
    a, b = _run(ours, TASKS, limit=12), _run(theirs, TASKS, limit=12)
    ll = [(x, y) for task in ("mspretrain_zh_choices",) for sa, sb in zip(a["samples"][task], b["samples"][task])
          for x, y in zip(sa["resps"], sb["resps"])]
    assert len(ll) == 12 * 4
    assert max(abs(x[0][0] - y[0][0]) for x, y in ll) < 1e-4
    assert [x[0][1] for x, y in ll] == [y[0][1] for x, y in ll]
    for metric in ("acc,none", "acc_norm,none"):
        assert a["results"]["mspretrain_zh_choices"][metric] == b["results"]["mspretrain_zh_choices"][metric]
    rolling = [(sa["resps"][0][0], sb["resps"][0][0]) for sa, sb in zip(a["samples"]["mspretrain_zh_rolling"],
                                                                         b["samples"]["mspretrain_zh_rolling"])]
    assert len(rolling) == 12 and max(abs(x - y) for x, y in rolling) < 1e-4
    gen_a = [s["resps"][0][0] for s in a["samples"]["mspretrain_zh_gen"]]
    gen_b = [s["resps"][0][0] for s in b["samples"]["mspretrain_zh_gen"]]
    assert gen_a == gen_b and len(gen_a) == 12 and any(gen_a)


def test_a_requests_score_does_not_depend_on_its_batch(pair):
    _, _, ours, _ = pair
    rng = np.random.default_rng(0)
    rows = [(rng.integers(4, V, size=n).tolist(), k) for n, k in ((20, 3), (9, 2), (33, 5), (25, 1), (14, 4), (60, 7))]
    together = ours.score_rows(rows)
    for i, row in enumerate(rows):
        assert ours.score_rows([row]) == [together[i]]  # bitwise: same graph, rows do not mix
    assert ours.score_rows(rows[::-1]) == together[::-1]


def test_sampled_generation_is_seeded_and_order_free(pair):
    from lm_eval.api.instance import Instance

    _, _, ours, _ = pair
    kw = {"until": ["。"], "max_gen_toks": 10, "do_sample": True, "temperature": 1.0}
    reqs = [Instance("generate_until", {}, (c, dict(kw)), i) for i, c in enumerate(["中国的首都是", "一年有几个季节？"])]
    first = ours.generate_until(reqs)
    assert ours.generate_until(reqs[::-1]) == first[::-1]
    greedy = ours.generate_until([Instance("generate_until", {}, (reqs[0].args[0], {"until": ["。"], "max_gen_toks": 10}), 0)])
    other_seed = harness.MindSporeLM(ours.model, ours.tokenizer, seed=ours.seed + 1).generate_until(reqs)
    assert first != other_seed or first[0] != greedy[0]  # sampling draws from the run's seed


@pytest.mark.parametrize("family,switches", [("qwen2", dict(qkv_bias=True, tie_embeddings=True)),
                                             ("qwen3", dict(qk_norm=True, head_dim=32)),
                                             ("mistral", dict(sliding_window=8))])
def test_every_family_matches_hf(pair, family, switches):
    """The families' own switches (qkv bias, q/k norm, a sliding window shorter than the prompt, with
    the KV cache's padded prefill) through the adapter, against the hf model on their export."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from mspretrain.cli import main

    root = pair[0]
    ck = random_checkpoint(root, root / "tok" / "tokenizer.model", seed=5, family=family, **switches)
    assert main(["export", str(ck), "--format", "hf", "--out", str(root / f"hf_{family}"), "--quiet"]) == 0
    ours = harness.MindSporeLM.from_path(ck, batch_size=2)
    # the llama export's tokenizer: transformers 5 loads a qwen2/qwen3 folder's SentencePiece
    # tokenizer.model as Qwen2Tokenizer, which encodes CJK text to nothing (an export matter)
    theirs = HFLM(pretrained=str(root / f"hf_{family}"), tokenizer=str(root / "hf"), batch_size=1, prefix_token_id=2, device="cpu")
    ll = [Instance("loglikelihood", {}, pair_, i) for i, pair_ in enumerate([("一丁七丈三上下", "不与丐丑"), ("", "hello 12。")])]
    for (x, gx), (y, gy) in zip(ours.loglikelihood(ll), theirs.loglikelihood(ll)):
        assert abs(x - y) < 1e-4 and gx == gy
    gen = [Instance("generate_until", {}, ("一丁七丈三上下不与丐丑专且丕世", {"until": ["。"], "max_gen_toks": 12}), 0)]
    assert ours.generate_until(gen) == theirs.generate_until(gen)


# ----------------------------------------------------------------------------- the command

def test_eval_tasks_runs_offline_and_writes_lm_evals_files(pair, tmp_path, capsys, monkeypatch):
    _, ck, _, _ = pair

    def no_network(*a, **k):
        raise OSError("network is off in this test")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    out = tmp_path / "evals"
    rc, stdout, err = cli(capsys, "eval", ck, "--tasks", "mspretrain_zh_choices", "--limit", "5", "--log-samples",
                          "--output_path", out, "--num-fewshot", "1")
    assert rc == 0, err
    (model_dir,) = out.iterdir()
    results = json.loads(next(model_dir.glob("results_*.json")).read_text(encoding="utf-8"))
    assert results["results"]["mspretrain_zh_choices"]["acc,none"] >= 0 and results["n-shot"]["mspretrain_zh_choices"] == 1
    samples = [json.loads(x) for x in next(model_dir.glob("samples_mspretrain_zh_choices_*.jsonl")).read_text().splitlines()]
    assert len(samples) == 5 and "mspretrain_zh_choices" in stdout
    rc, stdout, err = cli(capsys, "eval", ck, "--tasks", "mspretrain_zh_choices", "--limit", "3", "--json")
    assert rc == 0, err
    assert "harness/mspretrain_zh_choices/acc" in json.loads(stdout.strip().splitlines()[-1])


def docs_task_yamls(data: Path) -> dict[str, str]:
    """The C-Eval task YAMLs docs/evaluation.md shows, their /data/ceval paths moved to `data`."""
    text = (ROOT / "docs" / "evaluation.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```yaml\n# my_tasks/(\S+)\n(.*?)```", text, flags=re.S)
    assert {name for name, _ in blocks} == {"ceval_computer_network.yaml", "ceval_local.yaml"}
    return {name: body.replace("/data/ceval", str(data)).replace(", ceval-local-operating_system", "") for name, body in blocks}


def test_the_documented_local_ceval_task_runs_and_missing_data_is_one_line(pair, tmp_path, capsys):
    """docs/evaluation.md's C-Eval YAMLs over C-Eval-layout files (ours: eval/data/zh_ceval_*.csv):
    refused in one line naming the file while it is missing, scored once it is there."""
    _, ck, _, _ = pair
    tasks, data = tmp_path / "tasks", tmp_path / "ceval"
    tasks.mkdir()
    for name, body in docs_task_yamls(data).items():
        (tasks / name).write_text(body, encoding="utf-8")
    out = tmp_path / "evals"
    rc, _, err = cli(capsys, "eval", ck, "--tasks", "ceval-local-computer_network", "--include-path", tasks, "--output-path", out)
    assert_refusal(rc, err, str(data / "val" / "computer_network_val.csv"))
    rc, _, err = cli(capsys, "eval", ck, "--tasks", "ceval-local", "--include-path", tasks, "--output-path", out)
    assert_refusal(rc, err, "computer_network_val.csv")  # through the group: datasets' own message, one line
    assert not out.exists()
    shipped = harness.SHIPPED_TASKS.parent / "data"
    for split in ("val", "dev"):
        (data / split).mkdir(parents=True)
        shutil.copy(shipped / f"zh_ceval_{split}.csv", data / split / f"computer_network_{split}.csv")
    rc, stdout, err = cli(capsys, "eval", ck, "--tasks", "ceval-local", "--include-path", tasks, "--num-fewshot", "2", "--json")
    assert rc == 0, err
    scores = json.loads(stdout.strip().splitlines()[-1])
    assert 0 <= scores["harness/ceval-local/acc"] <= 1 and "harness/ceval-local-computer_network/acc" in scores


def test_unknown_tasks_and_stray_options_are_one_line(pair, capsys):
    _, ck, _, _ = pair
    rc, _, err = cli(capsys, "eval", ck, "--tasks", "no_such_task_anywhere")
    assert_refusal(rc, err, "unknown task 'no_such_task_anywhere'")
    rc, _, err = cli(capsys, "eval", ck, "--limit", "3")
    assert_refusal(rc, err, "go with --tasks")
    rc, _, err = cli(capsys, "eval", ck, "--tasks", "mspretrain_zh_choices", "--choices", "x.jsonl")
    assert_refusal(rc, err, "--choices does not go with --tasks")
    rc, _, err = cli(capsys, "eval", ck, "--tasks", "mspretrain_zh_choices", "--limit", "2.5")
    assert_refusal(rc, err, "--limit 2.5")


# ----------------------------------------------------------------------------- in the loop

@pytest.mark.slow  # two training runs with lm-eval in the loop (~27 s of CPU): end to end
def test_harness_tasks_in_the_loop_resume_continues_one_curve(tiny_data, tmp_path):
    """eval.harness_tasks: lm-eval scores at every eval step in metrics.jsonl and the report's curve
    against tokens; a run killed after step 3 (its last save at 2) and resumed gives the same curve,
    each step once."""
    from mspretrain.cli import main
    from mspretrain.forensics.report import render_report
    from mspretrain.forensics.report_plots import harness_curves
    from mspretrain.forensics.report_summary import read_metrics
    from tests.conftest import ONE_LAYER, TINY

    args = ["--config", str(TINY), "--data", str(tiny_data), "--quiet", "train.max_steps=4", "eval.every=2", "eval.max_tokens=256",
            "checkpoint.every=2", "checkpoint.keep_last=3", "eval.batch_size=4", ONE_LAYER,
            "eval.harness_tasks=mspretrain_zh_choices", "eval.harness_limit=4"]
    run = tmp_path / "run"
    assert main(["train", "--run", str(run), *args]) == 0
    whole = harness_curves(read_metrics(run / "metrics.jsonl")[0])
    xs, ys = whole["mspretrain_zh_choices/acc"]
    assert len(xs) == 2 and xs[0] < xs[1] and all(0 <= y <= 1 for y in ys)
    assert "lm-eval mspretrain_zh_choices/acc" in (run / "train.log").read_text()

    killed = tmp_path / "killed"
    shutil.copytree(run, killed)
    shutil.rmtree(killed / "checkpoints" / "step_000004")
    lines = (killed / "metrics.jsonl").read_text().splitlines()
    (killed / "metrics.jsonl").write_text("".join(x + "\n" for x in lines if json.loads(x).get("step", 0) <= 3))
    assert main(["train", "--run", str(killed), *args]) == 0
    recs = [json.loads(x) for x in (killed / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in recs if "harness/mspretrain_zh_choices/acc" in r]
    assert steps == [2, 4]
    assert harness_curves(read_metrics(killed / "metrics.jsonl")[0]) == whole
    _, pngs = render_report(killed)
    assert "harness" in pngs


def test_bad_harness_settings_fail_before_the_run_dir(tiny_data, tmp_path, capsys):
    from tests.conftest import TINY

    run = tmp_path / "run"
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    for name, body in docs_task_yamls(tmp_path / "nowhere").items():
        (tasks / name).write_text(body, encoding="utf-8")
    rc, _, err = cli(capsys, "train", "--config", TINY, "--data", tiny_data, "--run", run, "eval.harness_tasks=ceval-local-computer_network",
                     f"eval.harness_include_path={tasks}")
    assert_refusal(rc, err, "computer_network_val.csv does not exist")
    assert not run.exists()
    rc, _, err = cli(capsys, "train", "--config", TINY, "--data", tiny_data, "--run", run, "eval.harness_limit=-1")
    assert_refusal(rc, err, "eval.harness_limit")
    rc, _, err = cli(capsys, "train", "--config", TINY, "--data", tiny_data, "--run", run, "eval.harness_tasks=mspretrain_zh_choices",
                     "optim.shard_parameters=true")
    assert_refusal(rc, err, "eval.harness_tasks is not run during training with parallel.tp > 1 or optim.shard_parameters")
    assert not run.exists()


# ----------------------------------------------------------------------------- data parallel

@pytest.mark.msrun
@pytest.mark.skipif(MSRUN is None, reason="msrun not installed with MindSpore")
def test_two_msrun_ranks_give_one_process_results(pair, tmp_path):
    """`launch --nproc 2 -- eval CK --tasks ...`: lm-eval splits the documents over the ranks and
    gathers them to rank 0 (our gather_object / all_gather / barrier); every sample's response is
    the one process's, bit for bit (a request's score does not depend on its batch)."""
    from mspretrain.parallel.distributed import free_local_port

    _, ck, ours, _ = pair
    one = _run(ours, "mspretrain_zh_choices", limit=6)  # in this process, its graphs compiled already
    tasks = ["--tasks", "mspretrain_zh_choices", "--limit", "6", "--log-samples"]
    logs = tmp_path / "logs"
    cmd = [sys.executable, "-m", "mspretrain.cli", "launch", "--nproc", "2", "--master-port", str(free_local_port()),
           "--log-dir", str(logs), "--", "eval", str(ck), *tasks, "--output-path", str(tmp_path / "two")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "GLOG_v": "3"})
    try:
        proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    assert proc.returncode == 0, "".join(p.read_text() for p in sorted(logs.glob("worker_*.log")))[-3000:]

    (model_dir,) = (tmp_path / "two").iterdir()
    two = json.loads(next(model_dir.glob("results_*.json")).read_text(encoding="utf-8"))
    samples = [json.loads(x) for x in next(model_dir.glob("samples_mspretrain_zh_choices_*.jsonl")).read_text(encoding="utf-8").splitlines()]
    # lm-eval writes the responses as strings: the same digits as the float's repr
    resps = {s["doc_id"]: [[[float(ll), g == "True"] for ll, g in r] for r in s["resps"]] for s in samples}
    assert sorted(resps) == list(range(6))  # each document once, from both ranks
    want = {s["doc_id"]: [[[float(ll), bool(g)] for ll, g in r] for r in s["resps"]] for s in one["samples"]["mspretrain_zh_choices"]}
    assert resps == want
    for metric in ("acc,none", "acc_norm,none"):
        assert two["results"]["mspretrain_zh_choices"][metric] == one["results"]["mspretrain_zh_choices"][metric]
