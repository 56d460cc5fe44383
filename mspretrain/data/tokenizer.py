"""Tokenizer: a thin, typed wrapper over SentencePiece (and HF `tokenizers` JSON files).

Design choices: the training recipe is Llama's (BPE, byte fallback, split digits, identity
normaliser, character coverage 0.9995) so any Chinese character or byte survives a round
trip; special ids are fixed (unk 0, bos 1, eos 2, pad 3 for our own models) and recorded in the
manifest. A vocabulary too small for the characters SentencePiece must cover lowers the
coverage with a warning, or fails in one line — never with a SentencePiece trace.
"""
from __future__ import annotations

import io
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Sequence

from mspretrain.errors import UserError
from mspretrain.fsutil import atomic_write, sha256_file
from mspretrain.paths import DataPaths

if TYPE_CHECKING:  # numpy is imported where it is used: loading a tokenizer should not need it
    import numpy as np

_NAMES = DataPaths(Path())
TOKENIZER_FILES = (_NAMES.tokenizer_model.name, _NAMES.tokenizer_json.name)  # SentencePiece first


@dataclass
class Tokenizer:
    """Common surface of a SentencePiece model or an HF `tokenizers` JSON file."""

    path: Path
    _sp: object | None = None
    _hf: object | None = None
    _raw_encode: object | None = field(default=None, repr=False, compare=False)
    _raw_checked: bool = field(default=False, repr=False, compare=False)
    _bpe: object | None = field(default=None, repr=False, compare=False)
    _bpe_checked: bool = field(default=False, repr=False, compare=False)

    # ----------------------------------------------------------------- loading
    @classmethod
    def load(cls, path: str | Path) -> "Tokenizer":
        """Load `tokenizer.model` / `tokenizer.json`, or a directory holding one of them."""
        p = Path(path)
        if p.is_dir():
            for name in TOKENIZER_FILES:
                if (p / name).is_file():
                    p = p / name
                    break
            else:
                raise UserError(f"no tokenizer.model or tokenizer.json in {path}",
                                "pass --tokenizer PATH to a SentencePiece .model or HF tokenizer.json file")
        if not p.is_file():
            from mspretrain.fsutil import why_not

            raise UserError(f"tokenizer {p} {why_not(p)}",
                            "pass --tokenizer with a path to a SentencePiece .model or a tokenizer.json file")
        from mspretrain.outputs import refuse_torn

        refuse_torn(p, "tokenizer")  # e.g. a `tokenizer extend` output whose .model and .json are from different runs
        if p.suffix == ".json":
            try:
                from tokenizers import Tokenizer as HFTokenizer

                return cls(path=p, _hf=HFTokenizer.from_file(str(p)))
            except ImportError:
                raise UserError("reading tokenizer.json needs the `tokenizers` package",
                                "pip install tokenizers, or use a SentencePiece tokenizer.model") from None
            except Exception as exc:  # the HF library raises plain Exceptions on bad JSON
                raise UserError(f"{p} is not a valid HF tokenizer.json ({str(exc).splitlines()[0][:120]})",
                                "pass a tokenizer.json saved by HF tokenizers, or a SentencePiece .model") from None
        import sentencepiece as spm

        sp = spm.SentencePieceProcessor()
        try:
            sp.LoadFromSerializedProto(p.read_bytes())
        except Exception:
            raise UserError(f"{p} is not a SentencePiece model",
                            "pass a tokenizer.model written by SentencePiece (or by `mspretrain prepare`)") from None
        return cls(path=p, _sp=sp)

    # ----------------------------------------------------------------- properties
    @property
    def vocab_size(self) -> int:
        if self._sp is not None:
            return int(self._sp.GetPieceSize())
        return int(self._hf.get_vocab_size(with_added_tokens=True))

    def _hf_id(self, *names: str) -> int:
        for n in names:
            i = self._hf.token_to_id(n)
            if i is not None:
                return int(i)
        return -1

    @property
    def bos_id(self) -> int:
        return int(self._sp.bos_id()) if self._sp is not None else self._hf_id("<s>", "<|begin_of_text|>", "<bos>")

    @property
    def eos_id(self) -> int:
        return int(self._sp.eos_id()) if self._sp is not None else self._hf_id("</s>", "<|end_of_text|>", "<eos>", "<|endoftext|>")

    @property
    def pad_id(self) -> int:
        return int(self._sp.pad_id()) if self._sp is not None else self._hf_id("<pad>")

    @property
    def unk_id(self) -> int:
        return int(self._sp.unk_id()) if self._sp is not None else self._hf_id("<unk>")

    def special_ids(self) -> dict[str, int]:
        return {"bos": self.bos_id, "eos": self.eos_id, "pad": self.pad_id, "unk": self.unk_id}

    def sha256(self) -> str:
        return sha256_file(self.path)

    # ----------------------------------------------------------------- encode / decode
    def encode(self, text: str) -> list[int]:
        if self._sp is not None:
            return list(self._sp.EncodeAsIds(text))
        return list(self._hf.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: Sequence[str], num_threads: int = -1) -> list[list[int]]:
        if self._sp is not None:
            return self._sp.Encode(list(texts), out_type=int, num_threads=num_threads)
        return [e.ids for e in self._hf.encode_batch(list(texts), add_special_tokens=False)]

    def encode_flat(self, texts: Sequence[str], eos_id: int, dtype) -> tuple["np.ndarray", "np.ndarray"]:
        """All texts encoded back to back with `eos_id` after each: (flat ids as `dtype`, tokens
        per text incl. the EOS as int32). SentencePiece hands back one int32 buffer per text,
        so no Python int is built per token (building them cost as much as 20 % of encoding)."""
        import numpy as np

        texts = list(texts)
        fast = self._bpe_encoder()
        if fast is not None:
            try:
                ids_bytes, length_bytes = fast.encode(texts, eos_id)
            except UnicodeEncodeError:  # a lone surrogate: SentencePiece decides what happens
                pass
            else:
                flat, lengths = np.frombuffer(ids_bytes, np.int32), np.frombuffer(length_bytes, np.int32)
                if flat.size and int(flat.max()) > np.iinfo(dtype).max:
                    raise ValueError(f"token id {int(flat.max())} does not fit {np.dtype(dtype)}")
                return flat.astype(dtype), lengths.copy()
        ids, lengths = self._encode_ids(texts)
        lengths = lengths + np.int32(1)
        total = int(lengths.sum(dtype=np.int64))
        ends = np.cumsum(lengths, dtype=np.int64) - 1
        flat = np.full(total, eos_id, dtype=dtype)
        if ids.size:
            if int(ids.min()) < 0 or int(ids.max()) > np.iinfo(dtype).max:
                raise ValueError(f"token id {int(ids.max())} does not fit {np.dtype(dtype)}")
            body = np.ones(total, dtype=bool)
            body[ends] = False
            flat[body] = ids
        return flat, lengths

    def _encode_ids(self, texts: list[str]) -> tuple["np.ndarray", "np.ndarray"]:
        """(ids of all texts back to back, ids per text as int32), one thread."""
        import numpy as np

        if not texts:
            return np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.int32)
        raw = self._sp_buffers() if self._sp is not None else None
        if raw is not None:
            views = list(map(memoryview, raw(texts)))
            lengths = np.fromiter(map(len, views), dtype=np.int32, count=len(views))
            return np.frombuffer(b"".join(views), dtype=np.int32), lengths
        if self._sp is not None and hasattr(self._sp, "EncodeAsNumpy"):
            arrays = self._sp.EncodeAsNumpy(texts, num_threads=1)
        else:
            arrays = [np.asarray(x, dtype=np.int64) for x in self.encode_batch(texts, num_threads=1)]
        lengths = np.fromiter(map(len, arrays), dtype=np.int32, count=len(arrays))
        return np.concatenate(arrays), lengths

    def _bpe_encoder(self):
        """Our C BPE encoder (mspretrain/data/_bpe.c) for this model, or None.

        SentencePiece's encode builds a protobuf with piece and surface strings for every token,
        which is most of its cost when only ids are wanted; the C encoder runs the same merge
        algorithm without it (4-5x less CPU on the benchmark corpus, docs/benchmarks/prepare.md). It covers the model shape
        `prepare` trains (BPE, identity normaliser, no dummy prefix, no whitespace removal,
        byte fallback, only normal/control/unknown/byte pieces); any other model, a missing
        extension, MSPRETRAIN_BPE=sentencepiece, or a probe text encoded differently from
        SentencePiece's `EncodeAsIds` leaves SentencePiece in charge. Built once per tokenizer."""
        if self._bpe_checked:
            return self._bpe
        self._bpe_checked = True
        choice = os.environ.get("MSPRETRAIN_BPE", "").strip().lower()
        if choice not in ("", "auto", "sentencepiece"):
            raise UserError(f"MSPRETRAIN_BPE={choice} is not an encoder choice",
                            "unset MSPRETRAIN_BPE (our encoder where it applies), or set it to sentencepiece")
        if self._sp is None or choice == "sentencepiece":
            return None
        try:
            from sentencepiece import sentencepiece_model_pb2

            from mspretrain.data._bpe import Encoder
        except ImportError:  # extension not built (no C compiler at install), or no protobuf
            return None
        m = sentencepiece_model_pb2.ModelProto()
        m.ParseFromString(self._sp.serialized_model_proto())
        norm, kind = m.normalizer_spec, sentencepiece_model_pb2.ModelProto.SentencePiece
        if (m.trainer_spec.model_type != sentencepiece_model_pb2.TrainerSpec.BPE or norm.precompiled_charsmap
                or norm.add_dummy_prefix or norm.remove_extra_whitespaces or not norm.escape_whitespaces
                or not m.trainer_spec.byte_fallback):
            return None
        pieces, scores, ids, byte_ids = [], [], [], [-1] * 256
        for i, piece in enumerate(m.pieces):
            if piece.type == kind.NORMAL:
                pieces.append(piece.piece.encode("utf-8"))
                scores.append(piece.score)
                ids.append(i)
            elif piece.type == kind.BYTE:
                byte_ids[int(piece.piece[3:5], 16)] = i
            elif piece.type not in (kind.CONTROL, kind.UNKNOWN):  # user-defined or unused pieces
                return None
        if -1 in byte_ids:
            return None
        try:
            encoder = Encoder(pieces, scores, ids, byte_ids)
        except (ValueError, TypeError):  # e.g. a piece holding a character that is not a piece itself
            return None
        probe = ["春眠不觉晓，处处闻啼鸟。 夜来 abc 123!", "", "😀𠮷\x00 \n x", "  a  b ", "aaaaaaaa 的的的的的的"]
        flat, _ = encoder.encode(probe, -1)
        if memoryview(flat).cast("i").tolist() != [i for t in probe for i in list(self._sp.EncodeAsIds(t)) + [-1]]:
            return None
        self._bpe = encoder
        return encoder

    def _sp_buffers(self):
        """SentencePiece's C++ batch encoder without the Python wrapper's per-text numpy array,
        or None. `EncodeAsNumpy` wraps each text's int32 buffer in its own array (~1 us per text,
        ~4 % of encoding short documents); the buffers are joined in one `bytes.join` instead.
        The call is private API, so it is used only once it has encoded probe texts exactly
        as the public `EncodeAsIds` does (checked once per loaded tokenizer)."""
        if self._raw_checked:
            return self._raw_encode
        self._raw_checked = True
        sp = self._sp
        try:
            batch = sp._processor._EncodeAsBufferBatch

            def encode(texts: list[str]):
                return batch(texts, 1, None, sp._enable_sampling, sp._nbest_size, sp._alpha,
                             sp._add_bos, sp._add_eos, sp._reverse)

            probe = ["春眠不觉晓，处处闻啼鸟。 夜来 abc 123!", "", "😀𠮷\x00 \n x"]
            got = [memoryview(b).tolist() for b in encode(probe)]
            if got == [list(sp.EncodeAsIds(t)) for t in probe]:
                self._raw_encode = encode
        except Exception:  # any change in the private API: the public path
            self._raw_encode = None
        return self._raw_encode

    def decode(self, ids: Iterable[int]) -> str:
        ids = [int(i) for i in ids]
        if self._sp is not None:
            return self._sp.DecodeIds(ids)
        return self._hf.decode(ids, skip_special_tokens=True)

    def save_to(self, directory: str | Path) -> Path:
        """Copy the tokenizer file into `directory` under its canonical name."""
        out = Path(directory) / (_NAMES.tokenizer_json.name if self._hf is not None else _NAMES.tokenizer_model.name)
        atomic_write(out, self.path.read_bytes(), fsync=False)  # whole or absent; durability is the caller's (prepare fsyncs all at once)
        return out


MIN_COVERAGE = 0.98  # below this, too many characters would become byte sequences: refuse
_META_PIECES = 4 + 256  # unk/bos/eos/pad + the 256 byte-fallback pieces


def _coverage_for(sentences: list[str], vocab_size: int, wanted: float) -> tuple[float, int]:
    """(character coverage that fits `vocab_size`, vocab needed for `wanted` coverage).

    SentencePiece keeps the most frequent characters until their share reaches the coverage and
    refuses to train if they (plus the meta pieces) outnumber the vocabulary; computing the
    fitting coverage from the character counts up front costs one counting pass instead of a
    failed training attempt per guess.
    """
    import numpy as np

    cps = np.frombuffer("".join(sentences).encode("utf-32-le"), dtype=np.uint32)
    counts = np.bincount(cps)
    counts = np.sort(counts[counts > 0])[::-1]
    share = np.cumsum(counts) / float(cps.size)  # share[k-1] = coverage of the top k characters
    needed = int(np.searchsorted(share, wanted)) + 1 + _META_PIECES + 2
    room = vocab_size - _META_PIECES - 2  # 2 spare: ties, and ' ' counted as '▁'
    if room >= counts.size or share[max(room - 1, 0)] >= wanted:
        return wanted, needed
    if room < 2:
        return 0.0, needed
    # SentencePiece stops adding characters once the covered share reaches the coverage, so
    # the share of the top room-1 characters keeps it at or below `room`.
    return float(share[room - 2]), needed


def train_sentencepiece(
    texts: Iterable[str],
    out_dir: str | Path,
    vocab_size: int,
    *,
    character_coverage: float = 0.9995,
    num_threads: int = 2,
    seed: int = 1234,
) -> tuple[Tokenizer, list[str]]:
    """Train a Llama-style BPE model from `texts` into `out_dir/tokenizer.model`.

    Returns the tokenizer and warnings (e.g. the coverage had to be lowered). Raises
    `UserError` when no vocabulary size can work for this text. SentencePiece's BPE trainer
    has no randomness (no sampling: every sentence is used), so `seed` is recorded only.
    """
    import sentencepiece as spm

    sentences = [t for t in texts if t]
    if not sentences:
        raise UserError("no text left to train a tokenizer on", "check the input files, or lower prepare.min_chars")
    warnings: list[str] = []
    coverage, needed = _coverage_for(sentences, vocab_size, character_coverage)
    too_small = UserError(
        f"prepare.vocab_size = {vocab_size} is too small for the characters of this corpus (about {needed} needed "
        f"for character coverage {character_coverage})",
        f"raise prepare.vocab_size to {needed} or more (Chinese text needs roughly 5000-8000+; 16000-32000 is typical)")
    for _attempt in range(4):
        if coverage < MIN_COVERAGE:
            raise too_small
        model = io.BytesIO()
        try:
            spm.SentencePieceTrainer.Train(
                sentence_iterator=iter(sentences),
                model_writer=model,
                model_type="bpe",
                vocab_size=vocab_size,
                character_coverage=coverage,
                byte_fallback=True,
                split_digits=True,
                normalization_rule_name="identity",
                remove_extra_whitespaces=False,
                allow_whitespace_only_pieces=True,
                add_dummy_prefix=False,
                unk_id=0, bos_id=1, eos_id=2, pad_id=3,
                max_sentence_length=1 << 16,
                num_threads=num_threads,
                train_extremely_large_corpus=False,
                minloglevel=2,
            )
            break
        except RuntimeError as exc:
            msg = str(exc)
            if "smaller than required_chars" in msg:
                # The estimate missed by a few characters (SentencePiece counts after its own
                # normalisation): step down and try again.
                coverage = round(coverage - 0.002, 6)
                continue
            if "too high" in msg.lower():
                limit = re.search(r"<=\s*(\d+)", msg)
                at_most = f" (at most {limit.group(1)})" if limit else ""
                raise UserError(f"prepare.vocab_size = {vocab_size} is larger than this corpus can fill{at_most}",
                                f"lower prepare.vocab_size{' to ' + limit.group(1) if limit else ''}, or add more text") from None
            raise UserError(f"SentencePiece could not train: {msg.splitlines()[-1][:160]}", "check the corpus and prepare.vocab_size") from None
    else:
        raise too_small
    if coverage != character_coverage:
        warnings.append(f"vocab {vocab_size} is small for this corpus: character coverage lowered from {character_coverage} "
                        f"to {coverage:.6g} (rarer characters become byte tokens; about {needed} pieces would keep {character_coverage})")
    out = Path(out_dir) / _NAMES.tokenizer_model.name
    atomic_write(out, _without_thread_count(model.getvalue()), fsync=False)
    return Tokenizer.load(out), warnings


def _without_thread_count(proto: bytes) -> bytes:
    """The model with the recorded `num_threads` cleared: it is the only trace the thread count
    leaves (the pieces do not depend on it), and it would make outputs differ by machine."""
    try:
        from sentencepiece import sentencepiece_model_pb2
    except ImportError:  # needs protobuf; without it the model stays as trained
        return proto
    m = sentencepiece_model_pb2.ModelProto()
    m.ParseFromString(proto)
    m.trainer_spec.ClearField("num_threads")
    return m.SerializeToString(deterministic=True)
