"""Multiple-choice accuracy by log-likelihood: 100 % on a planted file after a short training run,
chance with shuffled labels, scores independent of the batch size, one-line errors for bad files.

The planted task: the training text is random characters, each written twice ("春春风风云云…"),
so a model learns that a character standing alone after complete pairs repeats. Each question's
context ends with one such lone character and the correct option starts by repeating it; the
other options start with a different character. A tokenizer of single characters (no merges)
keeps "春春" as two tokens, so the eval sees the token pairs the training saw."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from mspretrain.cli import main
from tests.conftest import CHARS, NO_EVAL, ONE_LAYER, TINY

ALPHABET = list(dict.fromkeys(CHARS))[:12]  # few characters: the pairs are learned in a few dozen steps
ITEMS = 48


def _doubled(rng: np.random.Generator, n: int) -> str:
    return "".join(c + c for c in rng.choice(ALPHABET, n))


def _planted(rng: np.random.Generator, shuffle_labels: bool) -> list[dict]:
    items = []
    for _ in range(ITEMS):
        context = _doubled(rng, 4) + (lone := str(rng.choice(ALPHABET)))
        others = [str(c) for c in rng.choice([c for c in ALPHABET if c != lone], 3, replace=False)]
        # A pair after the first character; not one of the options' first characters, or "日日日"
        # would repeat itself as well as the correct "水日日" repeats the context.
        tail = str(rng.choice([c for c in ALPHABET if c != lone and c not in others]))
        choices = [first + tail + tail for first in [lone] + others]  # same length: sum and mean rank alike
        order = rng.permutation(4)
        choices = [choices[i] for i in order]
        label = int(np.argmax(order == 0))
        items.append({"context": context, "choices": choices, "label": int(rng.integers(4)) if shuffle_labels else label})
    return items


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    import sentencepiece as spm

    from mspretrain.prepare.tokenizer_extend import _recipe

    d = tmp_path_factory.mktemp("choices")
    (d / "tok").mkdir()
    # prepare's recipe on sentences of one character each: nothing to merge, so the vocabulary
    # is the special and byte pieces plus the characters.
    spm.SentencePieceTrainer.Train(sentence_iterator=iter(ALPHABET * 5), model_prefix=str(d / "tok" / "tokenizer"),
                                   **_recipe(4 + 256 + len(ALPHABET), 1.0))
    rng = np.random.default_rng(0)
    (d / "doubled.txt").write_text("\n\n".join(_doubled(rng, 24) for _ in range(1500)) + "\n", encoding="utf-8")
    assert main(["prepare", str(d / "doubled.txt"), "--out", str(d / "data"), "--tokenizer", str(d / "tok" / "tokenizer.model"),
                 "--config", str(TINY), "--quiet"]) == 0
    run = d / "run"
    assert main(["train", "--config", str(TINY), "--data", str(d / "data"), "--run", str(run), "--quiet",
                 "train.max_steps=80", "optim.lr=1e-2", "checkpoint.every=80", NO_EVAL]) == 0
    for name, shuffled in (("planted.jsonl", False), ("shuffled.jsonl", True)):
        rows = _planted(np.random.default_rng(1), shuffled)
        (d / name).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return d


@pytest.fixture(scope="module")
def loaded(planted):
    from mspretrain.checkpoint.model import load_model

    return load_model(planted / "run")


def test_planted_answers_are_found_and_shuffled_labels_are_chance(planted, loaded):
    from mspretrain.eval.choices import choices_accuracy, read_choices

    tok = loaded.tokenizer
    assert all(len(tok.encode(c)) == 1 for c in ALPHABET) and len(tok.encode("春春")) == 2  # no merges
    res = choices_accuracy(loaded.model, tok, read_choices(planted / "planted.jsonl"), batch_size=3)
    assert res == {"acc": 1.0, "acc_norm": 1.0, "count": ITEMS}
    shuffled = choices_accuracy(loaded.model, tok, read_choices(planted / "shuffled.jsonl"), batch_size=3)
    assert shuffled["count"] == ITEMS and 0.0 <= shuffled["acc"] <= 0.6 and 0.0 <= shuffled["acc_norm"] <= 0.6


def test_scores_do_not_depend_on_batch_size_and_match_a_direct_forward(planted, loaded):
    import mindspore as ms

    from mspretrain.eval.choices import read_choices, score_items

    items = read_choices(planted / "planted.jsonl")[:7]  # 28 rows: batches of 3 end with a padded one
    dev = read_choices(planted / "shuffled.jsonl")[:2]
    one = score_items(loaded.model, loaded.tokenizer, items, batch_size=1, dev=dev, shots=2)
    three = score_items(loaded.model, loaded.tokenizer, items, batch_size=3, dev=dev, shots=2)
    a = np.array([s.logprob for s in one])
    b = np.array([s.logprob for s in three])
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=0)
    # Independent reference: one unpadded forward per option, log-softmax in float64.
    tok = loaded.tokenizer
    prefix = "".join(d.context + d.choices[d.label] + "\n\n" for d in dev)
    for it, got in zip(items[:3], one):
        for k, choice in enumerate(it.choices):
            ctx, opt = [tok.eos_id] + tok.encode(prefix + it.context), tok.encode(choice)
            row = np.array([ctx + opt], dtype=np.int32)
            logits = loaded.model(ms.Tensor(row[:, :-1])).asnumpy()[0].astype(np.float64)
            logp = logits - logits.max(-1, keepdims=True)
            logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
            want = sum(logp[len(ctx) - 1 + j, t] for j, t in enumerate(opt))
            assert got.tokens[k] == len(opt)
            assert got.logprob[k] == pytest.approx(want, rel=1e-5)


def test_cli_prints_accuracy_and_reads_the_shipped_files(planted, capsys):
    assert main(["eval", str(planted / "run"), "--choices", str(planted / "planted.jsonl"), "--batch-size", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out == {"acc": 1.0, "acc_norm": 1.0, "count": ITEMS, "shots": 0}
    data = Path(__file__).resolve().parents[2] / "mspretrain" / "eval" / "data"
    assert main(["eval", str(planted / "run"), "--choices", str(data / "zh_ceval_val.csv"), "--dev", str(data / "zh_ceval_dev.csv"),
                 "--shots", "2"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert "zh_ceval_val.csv: accuracy" in line and "2-shot" in line


def test_shipped_files_parse():
    from mspretrain.eval.choices import read_choices

    data = Path(__file__).resolve().parents[2] / "mspretrain" / "eval" / "data"
    generic = read_choices(data / "zh_generic.jsonl")
    val, dev = read_choices(data / "zh_ceval_val.csv"), read_choices(data / "zh_ceval_dev.csv")
    assert len(generic) >= 20 and len(val) >= 10 and len(dev) >= 5
    assert all(len(it.choices) == 4 and 0 <= it.label < 4 for it in generic + val + dev)
    assert {it.label for it in generic} == {0, 1, 2, 3} and {it.label for it in val} == {0, 1, 2, 3}


BAD = [
    ("a.jsonl", '{"context": "x", "choices": ["a", "b"], "label": 0}\n{"context": "y", "choices": ["a", "b"], "label": 2}\n',
     r"a\.jsonl:2: \"label\" must be an integer index"),
    ("b.jsonl", '{"context": "x", "choices": ["a"], "label": 0}\n', r"b\.jsonl:1: \"choices\" must be a list of at least two"),
    ("c.jsonl", "not json\n", r"c\.jsonl:1: not a JSON object"),
    ("d.jsonl", '{"text": "hello"}\n', r"d\.jsonl:1: not a multiple-choice row"),
    ("e.csv", "id,question,A,B,C,D,answer\n0,问,甲,乙,丙,丁,B\n1,问,甲,乙,丙,丁,E\n", r"e\.csv:3: answer 'E' is not one of the option letters A-D"),
    ("f.csv", "id,text\n0,hello\n", r"f\.csv:2: not a multiple-choice row"),
    ("g.txt", "hello\n", r"unknown multiple-choice file type \.txt"),
]


@pytest.mark.parametrize("name,text,match", BAD, ids=[b[0] for b in BAD])
def test_bad_files_are_one_line_errors(tmp_path, capsys, name, text, match):
    import re

    (tmp_path / name).write_text(text, encoding="utf-8")
    # The file is read before any model loads: a missing run would be the error otherwise.
    assert main(["eval", str(tmp_path / "no-run"), "--choices", str(tmp_path / name)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and err[0].startswith("error: ") and err[1].startswith("hint: "), err
    assert re.search(match, err[0]), err[0]


def test_option_errors(tmp_path, capsys):
    (tmp_path / "ok.jsonl").write_text('{"context": "x", "choices": ["a", "b"], "label": 0}\n', encoding="utf-8")
    assert main(["eval", str(tmp_path / "no-run"), "--choices", str(tmp_path / "ok.jsonl"), "--max-tokens", "5"]) == 2
    assert "for perplexity, not --choices" in capsys.readouterr().err
    assert main(["eval", str(tmp_path / "no-run"), "--choices", str(tmp_path / "ok.jsonl"), "--dev", str(tmp_path / "ok.jsonl"),
                 "--shots", "3"]) == 2
    assert "--shots 3 needs 3 dev items, the --dev file has 1" in capsys.readouterr().err
    assert main(["eval", str(tmp_path / "no-run"), "--choices", str(tmp_path / "ok.jsonl"), "--shots", "2"]) == 2
    assert "--shots 2 needs a --dev file of solved examples" in capsys.readouterr().err


@pytest.mark.slow  # a training run of its own (42 s at load ~6)
def test_choices_file_during_training_writes_eval_acc(planted, tmp_path, capsys):
    """eval.choices_file: eval/acc and eval/acc_norm at every eval step of the metrics, equal to
    `eval RUN --choices` on the final checkpoint; a bad file or shot count fails before the run
    dir is written."""
    run = tmp_path / "run"
    common = ["train", "--config", str(TINY), "--data", str(planted / "data"), "--quiet", "train.max_steps=4", "eval.every=2",
              "eval.max_tokens=256", "checkpoint.every=4", "eval.batch_size=4", ONE_LAYER]
    assert main([*common, "--run", str(run), f"eval.choices_file={planted / 'planted.jsonl'}"]) == 0
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    acc = {r["step"]: (r["eval/acc"], r["eval/acc_norm"]) for r in recs if "eval/acc" in r}
    assert sorted(acc) == [2, 4] and all(0 <= a <= 1 and 0 <= n <= 1 for a, n in acc.values())
    assert "planted.jsonl: accuracy" in (run / "train.log").read_text()
    capsys.readouterr()
    assert main(["eval", str(run), "--choices", str(planted / "planted.jsonl"), "--batch-size", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (out["acc"], out["acc_norm"]) == acc[4]

    for extra, match in (([f"eval.choices_file={tmp_path / 'missing.jsonl'}"], "missing.jsonl does not exist"),
                         ([f"eval.choices_file={planted / 'planted.jsonl'}", "eval.choices_shots=2"],
                          "eval.choices_shots 2 needs a eval.choices_dev_file file")):
        bad = tmp_path / f"bad-{len(extra)}"
        assert main([*common, "--run", str(bad), *extra]) == 2
        assert match in capsys.readouterr().err
        assert not bad.exists()


def test_length_normalisation_changes_the_answer_where_lengths_differ(monkeypatch):
    """acc sums an option's log-likelihood, acc_norm divides it by the option's token count: on
    options of different lengths the two pick different answers (every planted option above has
    the same length, where they cannot differ)."""
    from mspretrain.eval import choices
    from mspretrain.eval.choices import ChoiceItem, ItemScore

    # option 0: 1 token at -3 (mean -3); option 1: 4 tokens at -8 (sum -8, mean -2)
    short_wins = ItemScore(logprob=(-3.0, -8.0), tokens=(1, 4), label=1)
    assert (short_wins.pred, short_wins.pred_norm) == (0, 1)
    # three options: the longest is best by mean only
    three = ItemScore(logprob=(-2.0, -2.5, -9.0), tokens=(1, 2, 9), label=2)  # means -2, -1.25, -1
    assert (three.pred, three.pred_norm) == (0, 2)
    same = ItemScore(logprob=(-3.0, -8.0), tokens=(2, 2), label=0)
    assert (same.pred, same.pred_norm) == (0, 0)
    long_loses = ItemScore(logprob=(-2.0, -5.0), tokens=(1, 4), label=0)  # the sum is right, the mean is not
    assert (long_loses.pred, long_loses.pred_norm) == (0, 1)
    scores = [short_wins, three, same, long_loses, ItemScore(logprob=(-1.0, -6.0), tokens=(1, 3), label=0)]
    items = [ChoiceItem("q", tuple("abc"[: len(s.logprob)]), s.label, f"f:{i}") for i, s in enumerate(scores)]
    monkeypatch.setattr(choices, "score_items", lambda *a, **k: scores)
    assert choices.choices_accuracy(None, None, items, batch_size=1) == {"acc": 3 / 5, "acc_norm": 4 / 5, "count": 5}
