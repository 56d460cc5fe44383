"""Sampling text from a trained model.

Design choices: decoding recomputes the full context each step through one compiled graph of a
fixed length (the prompt plus the new tokens, rounded up to a multiple of 64), so a whole
generation compiles once and several prompts usually share that graph; a causal model's logits
at position t do not depend on the padding after t. When the model offers an incremental
KV-cache path (`prefill`/`decode_step`), it is used instead and must agree with this one
token for token under greedy decoding. Sampling happens on the host in numpy from a
`np.random.Generator` seeded by `seed`, so the same seed gives the same text.

The prompt is preceded by EOS: in training every document follows an EOS (documents are
joined by it), so EOS is the document-start context the model knows.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mspretrain.errors import UserError


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 64
    greedy: bool = False
    temperature: float = 0.8
    top_k: int = 50
    top_p: float = 0.95
    repetition_penalty: float = 1.1
    seed: int = 0
    stop_at_eos: bool = True

    def check(self) -> None:
        if self.max_new_tokens <= 0:
            raise UserError(f"--max-new-tokens {self.max_new_tokens} must be positive", "use e.g. --max-new-tokens 64")
        # `not x > 0` rather than `x <= 0`: NaN fails every comparison, and would sample garbage
        if not (self.temperature > 0 and math.isfinite(self.temperature)) and not self.greedy:
            raise UserError(f"--temperature {self.temperature} must be a positive finite number", "use e.g. 0.8, or --greedy")
        if self.top_k < 0 or not 0 < self.top_p <= 1:
            raise UserError("--top-k must be >= 0 and --top-p in (0, 1]", "use e.g. --top-k 50 --top-p 0.95")
        if not (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)):
            raise UserError(f"--repetition-penalty {self.repetition_penalty} must be a positive finite number", "use 1.0 (off) to 1.3")


@dataclass
class Generation:
    prompt: str
    text: str  # the generated continuation only
    ids: list[int] = field(default_factory=list)
    tokens_per_s: float = 0.0
    stopped_at_eos: bool = False


def sample_next(logits: np.ndarray, history: list[int], p: SamplingParams, rng: np.random.Generator) -> int:
    """One token from a logits row (V,), after repetition penalty, temperature, top-k and top-p."""
    x = logits.astype(np.float64).copy()
    if not np.isfinite(x).all():  # NaN weights (a diverged run's checkpoint): no token can be drawn
        raise UserError("the model's next-token logits are not finite (NaN or inf): its weights are damaged or diverged",
                        "generate from an earlier checkpoint (`mspretrain checkpoints RUN_DIR` lists them)")
    if p.repetition_penalty != 1.0 and history:
        seen = np.unique(np.asarray(history, dtype=np.int64))
        vals = x[seen]
        x[seen] = np.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if p.greedy:
        return int(np.argmax(x))
    with np.errstate(over="ignore"):  # max first: a tiny temperature then gives -inf and 0, never inf - inf
        x = (x - x.max()) / p.temperature
    if p.top_k and p.top_k < x.size:
        kth = np.partition(x, -p.top_k)[-p.top_k]
        x[x < kth] = -np.inf
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    if p.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        cum = np.cumsum(probs[order])
        cut = int(np.searchsorted(cum, p.top_p)) + 1  # smallest prefix with mass >= top_p
        keep = np.zeros_like(probs, dtype=bool)
        keep[order[:cut]] = True
        probs = np.where(keep, probs, 0.0)
        probs /= probs.sum()
    return int(rng.choice(probs.size, p=probs))


def _logits_fn(model: Any, length: int) -> Any:
    cache = getattr(model, "_mspretrain_gen_fns", None)
    if cache is None:
        cache = {}
        model._mspretrain_gen_fns = cache
    if length not in cache:
        import mindspore as ms

        def logits(tokens):
            return model(tokens)

        cache[length] = ms.jit(logits)
    return cache[length]


def _cached_fns(model: Any) -> tuple[Any, Any]:
    """Compiled prefill and decode_step of the model's KV-cache path, made once per model."""
    fns = getattr(model, "_mspretrain_cache_fns", None)
    if fns is None:
        import mindspore as ms

        def prefill(tokens, cache):
            return model.prefill(tokens, cache)

        def decode(token, pos, cache):
            return model.decode_step(token, pos, cache)

        fns = (ms.jit(prefill), ms.jit(decode))
        model._mspretrain_cache_fns = fns
    return fns


def generate(model: Any, tokenizer: Any, prompt: str, params: SamplingParams, *, max_seq_len: int,
             use_cache: bool = True) -> Generation:
    """Continue `prompt`; stops at EOS (if asked) or after max_new_tokens.

    With `use_cache` and a model that has `prefill`/`decode_step`, each new token costs one
    position of compute (KV cache); otherwise the whole padded context is recomputed per token."""
    import mindspore as ms

    params.check()
    if not prompt.strip():
        raise UserError("the prompt is empty", "pass some text, e.g. --prompt 春风")
    eos = tokenizer.eos_id
    ids = ([eos] if eos >= 0 else []) + tokenizer.encode(prompt)
    if len(ids) >= max_seq_len:
        raise UserError(f"the prompt is {len(ids)} tokens, the model's context is {max_seq_len}",
                        "shorten the prompt")
    budget = min(params.max_new_tokens, max_seq_len - len(ids))
    length = min(max_seq_len, -(-(len(ids) + budget) // 64) * 64)
    if use_cache and hasattr(model, "decode_step"):
        return _generate_cached(model, tokenizer, prompt, ids, budget, length, params)
    fn = _logits_fn(model, length)
    rng = np.random.default_rng(params.seed)
    buf = np.zeros((1, length), dtype=np.int32)
    buf[0, : len(ids)] = ids
    n_prompt = len(ids)
    new: list[int] = []
    stopped = False
    t0 = None
    for _ in range(budget):
        pos = n_prompt + len(new) - 1
        logits = fn(ms.Tensor(buf)).asnumpy()[0, pos]  # (V,)
        if t0 is None:
            t0 = time.perf_counter()  # exclude the one-off graph compilation from tokens/s
        nxt = sample_next(logits, ids[1:] + new, params, rng)
        if params.stop_at_eos and nxt == eos:
            stopped = True
            break
        new.append(nxt)
        buf[0, n_prompt + len(new) - 1] = nxt
    dt = time.perf_counter() - t0 if t0 is not None else 0.0
    tps = (len(new) - 1) / dt if len(new) > 1 and dt > 0 else 0.0
    return Generation(prompt=prompt, text=tokenizer.decode(new), ids=new, tokens_per_s=tps, stopped_at_eos=stopped)


def _generate_cached(model: Any, tokenizer: Any, prompt: str, ids: list[int], budget: int, length: int,
                     params: SamplingParams) -> Generation:
    import mindspore as ms

    prefill, decode = _cached_fns(model)
    rng = np.random.default_rng(params.seed)
    eos = tokenizer.eos_id
    logits, cache = prefill(ms.Tensor(np.asarray([ids], dtype=np.int32)), ms.mutable(model.init_cache(1, length)))
    row = logits.asnumpy()[0, -1]  # (V,)
    new: list[int] = []
    stopped = False
    t0 = None
    for i in range(budget):
        nxt = sample_next(row, ids[1:] + new, params, rng)
        if params.stop_at_eos and nxt == eos:
            stopped = True
            break
        new.append(nxt)
        if i == budget - 1:
            break
        pos = len(ids) + len(new) - 1
        logits, cache = decode(ms.Tensor([[nxt]], ms.int32), ms.Tensor(pos, ms.int32), ms.mutable(cache))
        row = logits.asnumpy()[0, 0]
        if t0 is None:
            t0 = time.perf_counter()  # after the first decode: compilation excluded from tokens/s
    dt = time.perf_counter() - t0 if t0 is not None else 0.0
    tps = (len(new) - 2) / dt if len(new) > 2 and dt > 0 else 0.0
    return Generation(prompt=prompt, text=tokenizer.decode(new), ids=new, tokens_per_s=tps, stopped_at_eos=stopped)
