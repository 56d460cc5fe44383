"""A tiny random HF model of a family, with a byte-level BPE tokenizer.json trained on your text:
a stand-in for a downloaded Qwen2.5 / Qwen3 / Llama-3 / Mistral folder (docs/quickstart.md,
"Continue from Qwen2.5 / Llama-3"). The shape matches configs/tiny.toml's model keys.

Usage: python scripts/tiny_hf_model.py --family qwen2 --text my-text/ --out tiny-qwen
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIALS = {"qwen2": ["<|endoftext|>"], "qwen3": ["<|endoftext|>"],  # Qwen: no BOS
            "llama3": ["<|begin_of_text|>", "<|end_of_text|>"], "mistral": ["<s>", "</s>"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", choices=sorted(SPECIALS), default="qwen2")
    ap.add_argument("--text", type=Path, required=True, help="a folder of .txt files to train the tokenizer on")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--vocab-size", type=int, default=512)
    args = ap.parse_args()

    texts = [p.read_text(encoding="utf-8") for p in sorted(args.text.glob("*.txt"))]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    specials = SPECIALS[args.family]
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=args.vocab_size, special_tokens=specials,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    shape = dict(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6,
                 eos_token_id=tok.token_to_id(specials[-1]), bos_token_id=tok.token_to_id(specials[0]) if len(specials) > 1 else None)
    torch.manual_seed(0)
    if args.family == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**shape, rope_theta=1e6, tie_word_embeddings=True))
    elif args.family == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**shape, head_dim=32, rope_theta=1e6))
    elif args.family == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**shape, sliding_window=None, rope_theta=1e6))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32}))
    model.save_pretrained(args.out)
    tok.save(str(args.out / "tokenizer.json"))
    print(f"wrote {args.out}: {type(model).__name__}, {model.num_parameters():,} parameters, "
          f"byte-level BPE of {tok.get_vocab_size()} tokens (specials {', '.join(specials)})")


if __name__ == "__main__":
    main()
