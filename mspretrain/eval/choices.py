"""Multiple-choice accuracy by log-likelihood (C-Eval / CMMLU layout, or a generic one).

Layouts (one item per JSONL line or CSV row):
- C-Eval / CMMLU: `question`, options `A`, `B`, `C`, `D` (consecutive letters from A, at least
  two), `answer` a letter; header names in any case (CMMLU's CSV writes `Question`, `Answer`).
  The context is `{question}\\n答案：` and each option's text is the continuation scored.
- Generic JSONL: `{"context": str, "choices": [str, ...], "label": int}`; the option follows the
  context with nothing in between (the file decides spaces and separators).

Design choices:
- Each option is scored as a cloze continuation: the sum of its tokens' log-probabilities given
  the prompt (`acc`), and that sum divided by its token count (`acc_norm`); both are reported.
  Scoring the option text rather than its letter is what a small or freshly pretrained model can
  answer at all; a letter is one token and carries no signal until a model follows instructions.
- Prompt and option are encoded separately, so the option's tokens are the same in every
  prompt. The prompt starts with the EOS token: `prepare` separates documents with EOS, so that
  is what a model trained here has seen before a document starts.
- Few-shot prompts take the first `shots` dev items in file order (deterministic), each written
  as its context followed by its correct option and a blank line.
- Independent of the batch size: every row is right-padded to one width for the whole call and
  the last batch is filled with masked copies, so one compiled graph serves all batches; the
  causal mask keeps padding out of the scored positions. Sums are taken in float64 on the host.
  A prompt longer than the model's context loses its oldest tokens (the option is never cut).
"""
from __future__ import annotations

import csv
import json
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from mspretrain.errors import UserError
from mspretrain.fsutil import TEXT_CAP, read_regular_bytes

CEVAL_ANSWER_CUE = "\n答案："
_LAYOUT_HINT = ('each row needs question, A, B, C, D and answer (a letter), C-Eval/CMMLU style, or is a JSON object '
                '{"context": str, "choices": [str, ...], "label": int}')


@dataclass(frozen=True)
class ChoiceItem:
    context: str
    choices: tuple[str, ...]
    label: int
    where: str  # "FILE:LINE", for messages


@dataclass(frozen=True)
class ItemScore:
    logprob: tuple[float, ...]  # summed log-likelihood of each option
    tokens: tuple[int, ...]  # tokens of each option
    label: int

    @property
    def pred(self) -> int:
        return int(np.argmax(self.logprob))

    @property
    def pred_norm(self) -> int:
        return int(np.argmax(np.asarray(self.logprob) / np.asarray(self.tokens)))


# ----------------------------------------------------------------------------- reading files

def _bad(where: str, what: str) -> UserError:
    return UserError(f"{where}: {what}", _LAYOUT_HINT)


def _ceval_item(row: dict[str, Any], where: str) -> ChoiceItem:
    keys = {str(k).strip().lower(): v for k, v in row.items() if k is not None}
    question, answer = keys.get("question"), keys.get("answer")
    options = []
    for letter in string.ascii_lowercase:
        if letter not in keys:
            break
        options.append(keys[letter])
    if question is None or len(options) < 2 or answer is None:
        missing = [k for k in ("question", "a", "b", "answer") if k not in keys]
        raise _bad(where, f"not a multiple-choice row (missing {', '.join(m.upper() if len(m) == 1 else m for m in missing)})")
    if any(not isinstance(v, (str, int, float)) for v in [question, answer, *options]):
        raise _bad(where, "question, options and answer must be text")
    letter = str(answer).strip().upper()
    if len(letter) != 1 or not "A" <= letter < chr(ord("A") + len(options)):
        raise _bad(where, f"answer {str(answer)!r} is not one of the option letters A-{chr(ord('A') + len(options) - 1)}")
    choices = tuple(str(o).strip() for o in options)
    if any(not c for c in choices):
        raise _bad(where, "an option is empty")
    return ChoiceItem(context=f"{str(question).strip()}{CEVAL_ANSWER_CUE}", choices=choices,
                      label=ord(letter) - ord("A"), where=where)


MAX_CHOICES = 64  # C-Eval, CMMLU, MMLU: 4; HellaSwag: 4; the widest common benchmarks: 10


def _generic_item(obj: dict[str, Any], where: str) -> ChoiceItem:
    context, choices, label = obj.get("context"), obj.get("choices"), obj.get("label")
    if not isinstance(context, str):
        raise _bad(where, '"context" must be a string')
    if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) and c for c in choices):
        raise _bad(where, '"choices" must be a list of at least two non-empty strings')
    if len(choices) > MAX_CHOICES:  # each option is a forward pass: 100,000 options ran for hours
        raise _bad(where, f'"choices" has {len(choices):,} options, more than the {MAX_CHOICES} a multiple-choice question can have')
    if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < len(choices):
        raise _bad(where, f'"label" must be an integer index into "choices" (0-{len(choices) - 1}), got {label!r}')
    return ChoiceItem(context=context, choices=tuple(choices), label=label, where=where)


def read_choices(path: str | Path) -> list[ChoiceItem]:
    """Items of a `.jsonl` (either layout, per line) or `.csv` (C-Eval/CMMLU) file."""
    p = Path(path)
    if not p.is_file():
        from mspretrain.fsutil import why_not

        raise UserError(f"choices file {p} {why_not(p)}", "pass a .jsonl or .csv multiple-choice file")
    data = read_regular_bytes(p, TEXT_CAP, "choices file", "pass a .jsonl or .csv multiple-choice file")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise UserError(f"{p} is not UTF-8 text", "save the file as UTF-8") from None
    items: list[ChoiceItem] = []
    suffix = p.suffix.lower()
    if suffix in (".jsonl", ".json", ".ndjson"):
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            where = f"{p}:{n}"
            try:
                obj = json.loads(line)
            except (ValueError, RecursionError):  # RecursionError: nested past the parser's stack
                raise _bad(where, "not a JSON object (one object per line)") from None
            if not isinstance(obj, dict):
                raise _bad(where, "not a JSON object (one object per line)")
            items.append(_generic_item(obj, where) if "choices" in obj or "context" in obj else _ceval_item(obj, where))
    elif suffix == ".csv":
        reader = csv.DictReader(text.splitlines(keepends=True))
        try:
            for row in reader:
                items.append(_ceval_item(row, f"{p}:{reader.line_num}"))
        except csv.Error as exc:
            raise _bad(f"{p}:{reader.line_num}", f"malformed CSV ({exc})") from None
    else:
        raise UserError(f"{p}: unknown multiple-choice file type {p.suffix or '(none)'}", "pass a .jsonl or .csv file")
    if not items:
        raise UserError(f"{p} holds no items", "pass a file with at least one question")
    return items


# ----------------------------------------------------------------------------- prompts

def check_shots(dev: Sequence[ChoiceItem], shots: int, *, shots_name: str = "--shots", dev_name: str = "--dev") -> None:
    """Refuse a shot count the dev items cannot fill (names: the command's options, or the
    trainer's config keys eval.choices_shots / eval.choices_dev_file)."""
    if shots < 0:
        raise UserError(f"{shots_name} {shots} must not be negative", f"use 0 for zero-shot, or e.g. 5 with {dev_name}")
    if shots and not dev:
        raise UserError(f"{shots_name} {shots} needs a {dev_name} file of solved examples",
                        f"pass {dev_name} FILE (e.g. C-Eval's dev split), or use 0 shots")
    if shots > len(dev):
        raise UserError(f"{shots_name} {shots} needs {shots} dev items, the {dev_name} file has {len(dev)}",
                        f"use {len(dev)} shots or fewer, or a larger {dev_name} file")


def prompts(items: Sequence[ChoiceItem], dev: Sequence[ChoiceItem] = (), shots: int = 0) -> list[str]:
    """The prompt of each item: the first `shots` dev items answered, then the item's context."""
    check_shots(dev, shots)
    prefix = "".join(f"{d.context}{d.choices[d.label]}\n\n" for d in dev[:shots])
    return [prefix + it.context for it in items]


# ----------------------------------------------------------------------------- scoring

def _rows(tokenizer: Any, items: Sequence[ChoiceItem], texts: Sequence[str], max_len: int) -> list[tuple[list[int], int]]:
    """(tokens, number of option tokens at the end) per option, at most max_len + 1 tokens."""
    start = [tokenizer.eos_id] if tokenizer.eos_id >= 0 else []
    ctx = tokenizer.encode_batch([*texts], num_threads=1)
    opts = tokenizer.encode_batch([c for it in items for c in it.choices], num_threads=1)
    rows, k = [], 0
    for it, c in zip(items, ctx):
        for choice in it.choices:
            opt = list(opts[k])
            k += 1
            if not opt:
                raise _bad(it.where, f"option {choice!r} encodes to no tokens")
            if len(opt) >= max_len + 1:
                raise _bad(it.where, f"option of {len(opt)} tokens does not fit the model's context of {max_len}")
            row = (start + list(c) + opt)[-(max_len + 1):]  # the oldest prompt tokens go first
            if len(row) == len(opt):
                raise _bad(it.where, "empty context and the tokenizer has no EOS to start from")
            rows.append((row, len(opt)))
    return rows


def score_items(model: Any, tokenizer: Any, items: Sequence[ChoiceItem], *, batch_size: int,
                dev: Sequence[ChoiceItem] = (), shots: int = 0, max_len: int | None = None,
                progress: Callable[[int, int], None] | None = None) -> list[ItemScore]:
    """Log-likelihood of every option of every item (see the module docstring); `progress` is
    called with (options scored, options in all) after each batch."""
    import mindspore as ms

    from mspretrain.eval.perplexity import _nll_fn

    if batch_size <= 0:
        raise UserError(f"--batch-size {batch_size} must be positive", "use e.g. --batch-size 8")
    max_len = int(max_len or model.cfg.max_seq_len)
    rows = _rows(tokenizer, items, prompts(items, dev, shots), max_len)
    # One width for the whole call (rounded up to 16 so files of similar lengths share a graph).
    width = min(max_len + 1, -(-max(len(r) for r, _ in rows) // 16) * 16)
    pad = tokenizer.eos_id if tokenizer.eos_id >= 0 else 0
    tokens = np.full((len(rows), width), pad, dtype=np.int32)
    mask = np.zeros((len(rows), width - 1), dtype=bool)  # mask[r, j]: target j (= token j + 1) is scored
    for r, (row, n_opt) in enumerate(rows):
        tokens[r, : len(row)] = row
        mask[r, len(row) - 1 - n_opt : len(row) - 1] = True
    fn = _nll_fn(model)
    logprob = np.zeros(len(rows), dtype=np.float64)
    for i in range(0, len(rows), batch_size):
        batch = tokens[i : i + batch_size]
        real = batch.shape[0]
        if real < batch_size:  # masked copies of the first row keep one compiled shape
            batch = np.concatenate([batch, np.repeat(batch[:1], batch_size - real, axis=0)])
        nll = fn(ms.Tensor(batch)).asnumpy().astype(np.float64)[:real]  # (real, width - 1)
        logprob[i : i + real] = -(nll * mask[i : i + real]).sum(axis=1)
        if progress:
            progress(i + real, len(rows))
    out, k = [], 0
    for it in items:
        n = len(it.choices)
        out.append(ItemScore(logprob=tuple(float(x) for x in logprob[k : k + n]),
                             tokens=tuple(n_opt for _, n_opt in rows[k : k + n]), label=it.label))
        k += n
    return out


def choices_accuracy(model: Any, tokenizer: Any, items: Sequence[ChoiceItem], *, batch_size: int,
                     dev: Sequence[ChoiceItem] = (), shots: int = 0,
                     progress: Callable[[int, int], None] | None = None) -> dict[str, float]:
    """{"acc": summed log-likelihood accuracy, "acc_norm": per-token normalised accuracy, "count"}."""
    scores = score_items(model, tokenizer, items, batch_size=batch_size, dev=dev, shots=shots, progress=progress)
    n = len(scores)
    return {"acc": sum(s.pred == s.label for s in scores) / n,
            "acc_norm": sum(s.pred_norm == s.label for s in scores) / n,
            "count": n}
