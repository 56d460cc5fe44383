"""Extend a SentencePiece BPE tokenizer with pieces learned from new text (Chinese-LLaMA style).

Design choices:
- Every base piece keeps its id, string, score and type: a model trained with the base tokenizer
  keeps its embedding rows, and text that never contains a new piece's string encodes exactly as
  before (a new piece can only form where its string occurs).
- The new pieces come from a SentencePiece model trained on the corpus with `prepare`'s Llama
  recipe (BPE, byte fallback, split digits, identity normaliser). They are taken in that
  model's merge order (its most frequent merges first), skipping pieces the base already has.
  SentencePiece puts single characters after all merges; a multi-character piece whose
  characters the base lacks (Llama spells most Chinese characters as three byte pieces) could
  never form, so such characters are pulled in just before the first piece that needs them,
  and count towards N.
- New pieces get scores below every base score, continuing the base's order (score = -rank for
  SentencePiece BPE): base merges keep their priority, SentencePiece's own encoder and the
  `tokenizers` BPE built from the same order (tokenizer.json, merges ranked by score) agree,
  and our C encoder applies unchanged.
- The chars/token comparison uses a slice held apart from training the new pieces: every 20th
  document (line of a .txt file), so it is deterministic and spread over the corpus.
"""
from __future__ import annotations

import io
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from mspretrain.errors import UserError

HELD_OUT_EVERY = 20  # every 20th document is held apart for the chars/token comparison
OUR_FILES = ("tokenizer.model", "tokenizer.json", "extend.json")


@dataclass
class ExtendResult:
    base_size: int
    added: list[str]
    chars_per_token_before: float | None
    chars_per_token_after: float | None
    held_out_docs: int
    files: list[Path]


# ----------------------------------------------------------------------------- reading inputs

def read_base(path: str | Path, what: str = "base tokenizer"):
    """The base SentencePiece BPE model as a ModelProto (a dir means its tokenizer.model)."""
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb

    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.model"
    if not p.is_file():
        from mspretrain.fsutil import why_not

        raise UserError(f"{what} {p} {why_not(p)}", "pass a SentencePiece tokenizer.model (or a dir holding one) as BASE")
    if p.suffix == ".json":
        # Byte-level BPE (Qwen2/2.5, Qwen3, Llama-3) is refused, not extended: their 128-152 K vocabularies
        # already hold Chinese words, and continuing with the tokenizer as it is keeps every token the
        # published model learned (docs/design.md, "Model families").
        raise UserError(f"{what} {p} is a tokenizer.json (a byte-level BPE such as Qwen's or Llama-3's): "
                        "tokenizer extend works on SentencePiece BPE models only",
                        "pass a SentencePiece tokenizer.model (Llama-2's); Qwen and Llama-3 continue with their own tokenizer as it is")
    from mspretrain.outputs import refuse_torn

    refuse_torn(p, what)  # a tokenizer.model beside another write's tokenizer.json
    data = p.read_bytes()
    try:
        spm.SentencePieceProcessor().LoadFromSerializedProto(data)
        proto = pb.ModelProto()
        proto.ParseFromString(data)
    except Exception:
        raise UserError(f"{p} is not a SentencePiece model",
                        "pass a tokenizer.model written by SentencePiece (Llama's, or `mspretrain prepare`'s)") from None
    if proto.trainer_spec.model_type != pb.TrainerSpec.BPE:
        kind = pb.TrainerSpec.ModelType.Name(proto.trainer_spec.model_type)
        raise UserError(f"{p} is a SentencePiece {kind} model; only BPE models (Llama's kind) can be extended",
                        "pass a BPE tokenizer.model")
    return proto


def read_corpus(inputs: Sequence[str], warn: Callable[[str], None]) -> tuple[list[str], list[str]]:
    """(training documents, held-out documents): every HELD_OUT_EVERY-th document is held out."""
    from mspretrain.prepare.sources import SourceStats, discover, iter_documents

    stats = SourceStats()
    paths = discover(list(inputs), stats)
    train, held = [], []
    for i, doc in enumerate(iter_documents(paths, doc_per_line=True, stats=stats, warn=warn)):
        if not doc.strip():
            continue
        (held if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 else train).append(doc)
    return train, held


# ----------------------------------------------------------------------------- training new pieces

def _recipe(vocab_size: int, coverage: float) -> dict:
    """`prepare`'s Llama recipe (data/tokenizer.py train_sentencepiece), for the candidate model."""
    return dict(model_type="bpe", vocab_size=vocab_size, character_coverage=coverage, byte_fallback=True,
                split_digits=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
                allow_whitespace_only_pieces=True, add_dummy_prefix=False, unk_id=0, bos_id=1, eos_id=2, pad_id=3,
                max_sentence_length=1 << 16, num_threads=2, train_extremely_large_corpus=False, minloglevel=2)


def _train_candidates(sentences: list[str], vocab_size: int) -> tuple[list[str] | None, int | None]:
    """(normal pieces of a model of `vocab_size` in id order, None) or (None, the largest size
    this corpus allows) when SentencePiece says the size is too high."""
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb

    from mspretrain.data.tokenizer import _coverage_for

    coverage, needed = _coverage_for(sentences, vocab_size, 0.9995)
    vocab_size = max(vocab_size, needed)
    for _attempt in range(6):
        out = io.BytesIO()
        try:
            spm.SentencePieceTrainer.Train(sentence_iterator=iter(sentences), model_writer=out,
                                           **_recipe(vocab_size, 0.9995))
        except RuntimeError as exc:
            msg = str(exc)
            if "smaller than required_chars" in msg:  # SentencePiece counted a few more characters
                vocab_size += 64
                continue
            limit = re.search(r"<=\s*(\d+)", msg)
            if "too high" in msg.lower() and limit:
                return None, int(limit.group(1))
            raise UserError(f"SentencePiece could not train on the corpus: {msg.splitlines()[-1][:160]}",
                            "check the --train files (plain text or .jsonl with a text field)") from None
        proto = pb.ModelProto()
        proto.ParseFromString(out.getvalue())
        normal = pb.ModelProto.SentencePiece.NORMAL
        return [p.piece for p in proto.pieces if p.type == normal], None
    raise UserError("SentencePiece could not fit the corpus's characters", "check the --train files")


def select_new_pieces(base: set[str], candidates: Sequence[str], n: int) -> list[str]:
    """Up to `n` pieces of `candidates` (most useful first) not in `base`, each one able to form:
    its characters are pieces (pulled in before it when missing) and it splits into two pieces
    that exist before it. Pieces that do not fit in what is left of `n` are passed over."""
    known = set(candidates)
    have = set(base)
    chosen: list[str] = []
    for piece in candidates:
        if piece in have:
            continue
        chars = [c for c in dict.fromkeys(piece) if c not in have]
        if any(c not in known for c in chars):  # a character the new model spells in bytes
            continue
        reachable = have | set(chars)
        if len(piece) > 1 and not any(piece[:i] in reachable and piece[i:] in reachable for i in range(1, len(piece))):
            continue
        add = chars + ([piece] if piece not in chars else [])
        if len(chosen) + len(add) > n:
            continue
        chosen += add
        have.update(add)
        if len(chosen) == n:
            break
    return chosen


def learn_pieces(sentences: list[str], base: set[str], n: int, log: Callable[[str], None]) -> list[str]:
    """The `n` new pieces, training bigger candidate models until there are enough (BPE's merge
    order does not depend on the vocab size, so a bigger model only adds candidates at the end)."""
    if not sentences:
        raise UserError("the --train corpus holds no text", "pass text files (or .jsonl with a text field) to learn new pieces from")
    size = n + 300
    limit = None
    chosen: list[str] = []
    for _round in range(8):
        pieces, too_high = _train_candidates(sentences, size if limit is None else min(size, limit))
        if pieces is None:
            limit = too_high
            continue
        chosen = select_new_pieces(base, pieces, n)
        if len(chosen) >= n:
            return chosen
        if limit is not None and size >= limit:
            break
        log(f"  {len(chosen)} new pieces from a {size}-piece model; training a larger one")
        size = max(size + 64, int(size + (n - len(chosen)) * 2))
        if limit is not None:
            size = min(size, limit)
    raise UserError(f"the corpus yields only {len(chosen)} new pieces, fewer than --add {n}",
                    f"use --add {len(chosen)} or less, or pass more text with --train")


def pieces_of_model(path: str | Path) -> list[str]:
    """Normal pieces of another SentencePiece model (--with), in its own order."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    proto = read_base(path, "--with model")
    return [p.piece for p in proto.pieces if p.type == pb.ModelProto.SentencePiece.NORMAL]


# ----------------------------------------------------------------------------- building the model

def extended_proto(base, new_pieces: Sequence[str]):
    """A copy of `base` with `new_pieces` appended as normal pieces, scored below every base piece."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    out = pb.ModelProto()
    out.CopyFrom(base)
    normal = pb.ModelProto.SentencePiece.NORMAL
    scores = [p.score for p in base.pieces if p.type == normal]
    lowest = min(scores) if scores else 0.0
    for k, piece in enumerate(new_pieces):
        p = out.pieces.add()
        p.piece, p.score, p.type = piece, lowest - 1.0 - k, normal
    out.trainer_spec.vocab_size = len(out.pieces)
    return out


def hf_tokenizer_json(proto) -> dict:
    """The `tokenizers` (HF) BPE equivalent of a SentencePiece BPE ModelProto.

    Merges are every split of a normal piece into two normal pieces, ranked by the piece's score
    (highest first), as transformers' SentencePiece converter does; SentencePiece's
    escape-whitespace, dummy-prefix and charsmap become normalisers."""
    import base64

    from sentencepiece import sentencepiece_model_pb2 as pb

    kind = pb.ModelProto.SentencePiece
    vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
    normal = {p.piece: (p.score, i) for i, p in enumerate(proto.pieces) if p.type == kind.NORMAL}
    merges = []
    for piece, _rank in sorted(normal.items(), key=lambda kv: (-kv[1][0], kv[1][1])):  # score high to low
        local = [(piece[:j], piece[j:]) for j in range(1, len(piece)) if piece[:j] in normal and piece[j:] in normal]
        merges += sorted(local, key=lambda ab: (vocab[ab[0]], vocab[ab[1]]))
    unk = next((p.piece for p in proto.pieces if p.type == kind.UNKNOWN), None)
    # Control and unknown pieces are special tokens; user-defined pieces are matched whole in the
    # text by SentencePiece, which is what an added (non-special) token does in `tokenizers`.
    added = [{"id": i, "content": p.piece, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": p.type == kind.USER_DEFINED, "special": p.type != kind.USER_DEFINED}
             for i, p in enumerate(proto.pieces) if p.type in (kind.CONTROL, kind.UNKNOWN, kind.USER_DEFINED)]
    norm = proto.normalizer_spec
    normalizers: list[dict] = []
    if norm.precompiled_charsmap:
        normalizers.append({"type": "Precompiled", "precompiled_charsmap": base64.b64encode(norm.precompiled_charsmap).decode()})
    if norm.remove_extra_whitespaces:
        normalizers += [{"type": "Strip", "strip_left": True, "strip_right": True},
                        {"type": "Replace", "pattern": {"Regex": " {2,}"}, "content": " "}]
    if norm.add_dummy_prefix:
        normalizers.append({"type": "Prepend", "prepend": "▁"})
    if norm.escape_whitespaces:
        normalizers.append({"type": "Replace", "pattern": {"String": " "}, "content": "▁"})
    decoders = [{"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"}, {"type": "Fuse"}]
    if norm.add_dummy_prefix:
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "Sequence", "normalizers": normalizers} if normalizers else None,
        "pre_tokenizer": None,
        "post_processor": None,
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": {"type": "BPE", "dropout": None, "unk_token": unk, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": bool(proto.trainer_spec.byte_fallback),
                  "ignore_merges": False, "vocab": vocab, "merges": [list(m) for m in merges]},
    }


def chars_per_token(proto_bytes: bytes, docs: Sequence[str]) -> float | None:
    import sentencepiece as spm

    if not docs:
        return None
    sp = spm.SentencePieceProcessor()
    sp.LoadFromSerializedProto(proto_bytes)
    tokens = sum(len(ids) for ids in sp.Encode(list(docs), out_type=int, num_threads=1))
    return sum(map(len, docs)) / max(tokens, 1)


# ----------------------------------------------------------------------------- the command's work

def _between_writes() -> None:
    """A test hook: MSPRETRAIN_TEST_KILL_BETWEEN_WRITES=1 ends the process between the files' writes
    (tests/cli/test_outputs.py checks that the published set is then still the old one, whole)."""
    import os

    if os.environ.get("MSPRETRAIN_TEST_KILL_BETWEEN_WRITES") == "1":
        os._exit(137)


MAX_ADD = 1_000_000  # SentencePiece's trainer overflows long before --add 1e20; no tokenizer needs more


def output_dir(out: Path, inputs: Sequence[str | Path], log: Callable[[str], None]):
    """The `OutputDir` extend writes through (mspretrain/outputs.py): refuses an --out holding
    files extend did not write, or holding an input (`--with OUT/tokenizer.model --out OUT`);
    replaces an earlier extend output whole, with one rename."""
    from mspretrain.outputs import OutputDir

    return OutputDir(out, "tokenizer extend", overwrite=True, inputs=inputs, known_names=OUR_FILES, log=log)


def extend_tokenizer(base_path: str | Path, out: str | Path, *, add: int | None, train: Sequence[str] = (),
                     with_model: str | None = None, held_out: Sequence[str] = (),
                     log: Callable[[str], None] = print) -> ExtendResult:
    """Write OUT/tokenizer.model, OUT/tokenizer.json and OUT/extend.json (what was done).

    New pieces come from `train` (learned; every 20th document held apart for chars/token) or
    from `with_model`'s pieces in its own order (chars/token then measured on every 20th
    document of `held_out`, if given)."""
    from mspretrain.data.tokenizer import sha256_file

    base_path, out = Path(base_path), Path(out)
    if add is not None and add <= 0:
        raise UserError(f"--add {add} must be positive", "ask for e.g. --add 20000 new pieces")
    if with_model is None and add is None:
        raise UserError("--add N is required with --train", "e.g. --add 20000 (Chinese-LLaMA added about 20,000)")
    if with_model is None and not train:
        raise UserError("nothing to learn new pieces from", "pass --train CORPUS... (with --add N) or --with OTHER.model")
    if add is not None and add > MAX_ADD:
        raise UserError(f"--add {add} is more new pieces than any tokenizer holds", f"ask for at most {MAX_ADD:,} (Chinese-LLaMA added about 20,000)")
    base = read_base(base_path)
    inputs: list[str | Path] = [base_path, *([with_model] if with_model else []), *train, *held_out]
    target = output_dir(out, inputs, log)  # refused here, before minutes of learning
    base_set = {p.piece for p in base.pieces}
    train_docs, held = read_corpus(train, warn=lambda s: log(f"warning: {s}")) if train else ([], [])
    if with_model is not None:
        candidates = [p for p in pieces_of_model(with_model) if p not in base_set]
        wanted = len(candidates) if add is None else add
        added = select_new_pieces(base_set, candidates, wanted)
        if len(added) < wanted:
            raise UserError(f"{with_model} has only {len(added)} pieces the base lacks (that can form), fewer than --add {add}",
                            f"use --add {len(added)} or less, or leave --add out to take them all")
        if held_out:
            _, held = read_corpus(held_out, warn=lambda s: log(f"warning: {s}"))
    else:
        # each line is a text here (SentencePiece trains on sentences), where `prepare` counts
        # blank-line-separated documents: say which, or the two counts of one corpus look inconsistent
        log(f"learning {add} new pieces from {len(train_docs):,} lines ({len(held):,} held out; a line of a .txt file counts "
            "as one text here, where prepare counts blank-line-separated documents)")
        added = learn_pieces(train_docs, base_set, add, log)
    proto = extended_proto(base, added)
    data = proto.SerializeToString(deterministic=True)
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor()
    sp.LoadFromSerializedProto(data)  # SentencePiece accepts what we built (no duplicate pieces)
    before = chars_per_token(base.SerializeToString(), held)
    after = chars_per_token(data, held)
    record = {"base": str(base_path), "base_sha256": sha256_file(base_path if base_path.is_file() else base_path / "tokenizer.model"),
              "base_size": len(base.pieces), "added": len(added), "size": len(proto.pieces),
              "train": [str(t) for t in train], "with": with_model, "held_out_every": HELD_OUT_EVERY,
              "held_out_docs": len(held), "chars_per_token_before": before, "chars_per_token_after": after,
              "first_new_pieces": added[:20]}
    with target as tmp:  # the three files are published together: a kill leaves the old set or the new one
        (tmp / "tokenizer.model").write_bytes(data)
        _between_writes()
        (tmp / "tokenizer.json").write_text(json.dumps(hf_tokenizer_json(proto), ensure_ascii=False), encoding="utf-8")
        (tmp / "extend.json").write_text(json.dumps(record, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
    files = [out / "tokenizer.model", out / "tokenizer.json", out / "extend.json"]
    return ExtendResult(base_size=len(base.pieces), added=added, chars_per_token_before=before,
                        chars_per_token_after=after, held_out_docs=len(held), files=files)
