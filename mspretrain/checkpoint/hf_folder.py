"""HF model folders (mspretrain/families.py) with their tokenizer: what `convert --from-hf` reads and `export --format hf` writes.

model/hf.py converts config.json and the tensors; the tokenizer files need data/tokenizer. data
and model are siblings in layer 2 and do not import each other, so the two halves meet here, in
checkpoint/ (layer 3, which may import both), next to the checkpoint files the folders are
converted from and to.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from mspretrain.config.schema import ModelConfig
from mspretrain.errors import UserError
from mspretrain.model.hf import read_hf_dir, write_hf_dir

if TYPE_CHECKING:
    from mspretrain.data.tokenizer import Tokenizer


def read_hf_folder(hf_dir: str | Path) -> tuple[ModelConfig, dict[str, np.ndarray], Path | None]:
    """(resolved ModelConfig, our tensors, tokenizer path or None) of an HF model folder whose
    tokenizer, when it has one, matches config.json's vocab_size (checked before the weights are read)."""
    return read_hf_dir(hf_dir, check_tokenizer=_check_hf_tokenizer)


def _check_hf_tokenizer(tok_path: Path, m: ModelConfig) -> None:
    from mspretrain.data.tokenizer import Tokenizer

    tok_vocab = Tokenizer.load(tok_path).vocab_size
    # fewer tokens than rows is a padded embedding (Qwen2.5: 151,665 tokens, 152,064 rows); more is a mismatch
    if tok_vocab > m.vocab_size:
        raise UserError(f"tokenizer {tok_path.name} has {tok_vocab} tokens but config.json says vocab_size {m.vocab_size}",
                        "the tokenizer and the weights must belong to the same model; fix vocab_size or use the matching tokenizer")


def write_hf_folder(out: str | Path, m: ModelConfig, tensors: dict[str, np.ndarray],
                    tokenizer_path: str | Path | None = None) -> Path:
    """An HF model folder that `AutoModelForCausalLM` and (with a tokenizer) `AutoTokenizer` load."""
    from mspretrain.data.tokenizer import Tokenizer

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    ids: dict[str, int] = {}
    if tokenizer_path is not None:
        tok = Tokenizer.load(tokenizer_path)
        if tok.vocab_size > m.vocab_size:  # fewer: a padded embedding, as Qwen's
            raise UserError(f"tokenizer {Path(tokenizer_path).name} has {tok.vocab_size} tokens but the model's vocab_size is {m.vocab_size}",
                            "export with the tokenizer the model was trained with")
        ids = _tokenizer_files(out, tok, m.max_seq_len)
    return write_hf_dir(out, m, tensors, special_ids=ids)


# transformers 5 loads the tokenizer of a folder whose config.json says model_type "qwen2" as its own
# Qwen2Tokenizer (byte-level BPE from vocab.json + merges.txt), whatever tokenizer_config.json names:
# qwen2 is in its MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS (models/auto/tokenization_auto.py,
# transformers 5.25). A SentencePiece tokenizer.model then encodes Chinese text to no tokens at all.
# Nothing in the folder can change that choice short of remote code, so `export` says how to load it.
_FORCED_BYTE_LEVEL = frozenset({"qwen2"})


def tokenizer_load_note(m: ModelConfig, tokenizer_path: str | Path | None) -> str | None:
    """A one-line note for `export` when transformers' AutoTokenizer would misread the folder's
    SentencePiece tokenizer (see _FORCED_BYTE_LEVEL); None when AutoTokenizer reads it as written."""
    if tokenizer_path is None or m.family not in _FORCED_BYTE_LEVEL or Path(tokenizer_path).suffix != ".model":
        return None
    return ("note: transformers 5 loads a qwen2 folder's tokenizer as Qwen2Tokenizer, which cannot read a SentencePiece "
            "tokenizer.model: load it with transformers.LlamaTokenizer.from_pretrained(DIR) (the model loads with AutoModelForCausalLM)")


def _sp_add_dummy_prefix(path: Path) -> bool:
    """Whether a SentencePiece model prepends '▁' (decides HF's add_prefix_space)."""
    try:
        from sentencepiece import sentencepiece_model_pb2 as pb

        proto = pb.ModelProto()
        proto.ParseFromString(path.read_bytes())
        return bool(proto.normalizer_spec.add_dummy_prefix)
    except Exception:  # protobuf missing or an odd file: Llama's own default
        return True


def _tokenizer_files(out: Path, tok: "Tokenizer", max_len: int) -> dict[str, int]:
    """Copy the tokenizer and write the json files AutoTokenizer reads; returns the special ids."""
    tok.save_to(out)
    ids = tok.special_ids()
    piece = (tok._sp.IdToPiece if tok._sp is not None else tok._hf.id_to_token)
    special = {f"{name}_token": piece(ids[name]) for name in ("bos", "eos", "unk", "pad") if ids[name] >= 0}
    if tok._sp is not None:
        tcfg = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": False, "add_eos_token": False, "legacy": False,
                "add_prefix_space": _sp_add_dummy_prefix(tok.path), "clean_up_tokenization_spaces": False}
    else:
        tcfg = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    tcfg["model_max_length"] = max_len
    (out / "tokenizer_config.json").write_text(json.dumps(dict(tcfg, **special), indent=2, ensure_ascii=False), encoding="utf-8")
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2, ensure_ascii=False), encoding="utf-8")
    return ids
