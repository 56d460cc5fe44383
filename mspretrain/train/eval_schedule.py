"""When the loop evaluates, and what it records: valid perplexity every `eval.every` steps and
always at the last step of the run (eval.every = 0 means only then), in that step's metrics."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from mspretrain.config import EvalConfig


class PeriodicEval:
    def __init__(self, cfg: EvalConfig, *, data_dir: Path, seq_len: int, log: Callable[[str], None]) -> None:
        self.cfg, self.data_dir, self.seq_len, self.log = cfg, data_dir, seq_len, log

    def due(self, step: int, total: int) -> bool:
        return bool(self.cfg.every and step % self.cfg.every == 0) or step == total

    def __call__(self, model: Any, step: int) -> dict[str, float]:
        """Valid perplexity of `model` after `step`, as metrics values; logs one line."""
        from mspretrain.eval.perplexity import evaluate_split

        res = evaluate_split(model, self.data_dir, split="valid", seq_len=self.seq_len,
                             batch_size=self.cfg.batch_size, max_tokens=self.cfg.max_tokens)
        self.log(f"step {step}: valid ppl {res['ppl']:.2f} over {res['tokens']:,} tokens")
        return {"eval/ppl": res["ppl"], "eval/nll": res["nll"]}
