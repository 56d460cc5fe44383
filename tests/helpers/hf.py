"""HF material made here, no download: `HF_VOCAB`, `train_tokenizer` (a real SentencePiece model),
`tiny_hf_llama` (transformers, random init)."""
from __future__ import annotations

from pathlib import Path

HF_VOCAB = 320  # the vocabulary of `train_tokenizer`'s tokenizers in the HF tests


def train_tokenizer(path: Path, vocab: int) -> Path:
    """A small SentencePiece BPE model (byte fallback, Llama's special ids) written to `path`."""
    import io
    import random

    import sentencepiece as spm

    rng = random.Random(0)
    chars = [chr(c) for c in range(0x4E00, 0x4E00 + 40)]
    texts = ["".join(rng.choice(chars) for _ in range(rng.randint(4, 30))) + "，hello 12。" for _ in range(400)]
    model = io.BytesIO()
    spm.SentencePieceTrainer.Train(
        sentence_iterator=iter(texts), model_writer=model, model_type="bpe", vocab_size=vocab, character_coverage=1.0,
        byte_fallback=True, normalization_rule_name="identity", add_dummy_prefix=False, remove_extra_whitespaces=False,
        unk_id=0, bos_id=1, eos_id=2, pad_id=3, num_threads=1, minloglevel=2)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(model.getvalue())
    return path


def tiny_hf_llama(seed: int = 0, vocab: int = HF_VOCAB, tied: bool = False):
    """A random transformers Llama with configs/tiny.toml's model keys (dim 64, 2 layers, 4 heads,
    2 KV heads, 128 positions)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    hc = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2, pad_token_id=3)
    return transformers.LlamaForCausalLM(hc).eval()
