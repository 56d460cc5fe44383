"""Sample text from a run or checkpoint."""
from __future__ import annotations

import argparse
import json

from mspretrain.commands.common import add_quiet_argument, bounded, refuse_data_dir, refuse_overrides

EXAMPLES = """examples:
  mspretrain generate runs/demo --prompt 春风 --max-new-tokens 48
  mspretrain generate runs/demo --prompt 明月 --greedy --json"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", metavar="RUN_DIR|CKPT_DIR")
    p.add_argument("--prompt", action="append", required=True, help="may be given several times")
    p.add_argument("--max-new-tokens", type=bounded(int, 1, 1 << 24), default=64)
    p.add_argument("--greedy", action="store_true")
    p.add_argument("--temperature", type=bounded(float, 1e-4, 1e4), default=0.8)
    p.add_argument("--top-k", type=bounded(int, 0, 1 << 22), default=50)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--repetition-penalty", type=bounded(float, 1e-3, 1e3), default=1.1)
    p.add_argument("--seed", type=bounded(int, 0, 2**63 - 1), default=0)
    p.add_argument("--no-stop", action="store_true", help="do not stop at EOS")
    p.add_argument("--json", action="store_true")
    add_quiet_argument(p)


def run(args: argparse.Namespace) -> int:
    from mspretrain.checkpoint.model import load_model
    from mspretrain.eval.generate import SamplingParams, generate

    refuse_overrides(args, "generate", "use generate's own options, e.g. --temperature 0.8 --top-k 50 (see `mspretrain generate --help`)")
    refuse_data_dir(args.path, "generate")
    params = SamplingParams(max_new_tokens=args.max_new_tokens, greedy=args.greedy, temperature=args.temperature,
                            top_k=args.top_k, top_p=args.top_p, repetition_penalty=args.repetition_penalty,
                            seed=args.seed, stop_at_eos=not args.no_stop)
    params.check()
    loaded = load_model(args.path, log=(lambda s: None) if args.json else print)
    out = []
    for prompt in args.prompt:
        g = generate(loaded.model, loaded.tokenizer, prompt, params, max_seq_len=loaded.config.model.max_seq_len)
        out.append({"prompt": prompt, "text": g.text, "tokens": len(g.ids), "tokens_per_s": round(g.tokens_per_s, 2),
                    "stopped": "eos" if g.stopped_at_eos else ("max_new_tokens" if len(g.ids) >= params.max_new_tokens else "context")})
        if not args.json:
            print(f"{prompt}{g.text}")
            if not args.quiet:
                why = _stop_reason(g, params.max_new_tokens, loaded.config.model.max_seq_len)
                print(f"  ({len(g.ids)} tokens, {g.tokens_per_s:.1f} tokens/s{why})")
    if args.json:
        print(json.dumps(out if len(out) > 1 else out[0], ensure_ascii=False))
    return 0


def _stop_reason(g, max_new_tokens: int, context: int) -> str:
    """Why generation ended early, when it did: EOS, or the model's context (model.max_seq_len)."""
    if g.stopped_at_eos:
        return ", stopped at end-of-text"
    if len(g.ids) < max_new_tokens:
        return f", stopped at the model's context of {context} tokens (prompt included)"
    return ""
