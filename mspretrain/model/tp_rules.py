"""What tensor parallel cannot cut, as pure arithmetic on the model's shape (no MindSpore): shared by
`train` (model/parallel.py `check_tp`) and `plan`'s layout table (preflight/layouts.py `train_refusal`),
so the table never recommends a tp that `train` refuses."""
from __future__ import annotations


def tp_refusal(n_heads: int, n_kv_heads: int, ffn_dim: int, vocab_size: int, tp: int) -> tuple[str, str] | None:
    """(cause, fix) when tensor parallel `tp` cannot cut a model of this shape, else None."""
    if tp == 1:
        return None
    if n_kv_heads % tp:
        best = max(d for d in range(1, n_kv_heads + 1) if n_kv_heads % d == 0 and d <= tp)
        return (f"parallel.tp = {tp} does not divide model.n_kv_heads = {n_kv_heads}: tensor parallel splits the kv heads "
                "across ranks and does not replicate them",
                f"use parallel.tp={best} (a divisor of n_kv_heads) and data parallel for the other ranks")
    for key, value in (("n_heads", n_heads), ("ffn_dim", ffn_dim), ("vocab_size", vocab_size)):
        if value % tp:
            return (f"parallel.tp = {tp} does not divide model.{key} = {value}",
                    f"use a parallel.tp that divides model.{key}"
                    + (" (pad the vocabulary: model.vocab_size may exceed the tokenizer's)" if key == "vocab_size" else ""))
    return None
