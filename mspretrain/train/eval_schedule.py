"""When the loop evaluates, and what it records: valid perplexity every `eval.every` steps and
at the last step of the run (eval.every = 0 means only then; eval.at_end = false: not then), in
that step's metrics;
with `eval.choices_file`, multiple-choice accuracy (eval/choices.py) at the same steps; with
`eval.harness_tasks`, lm-evaluation-harness tasks run by lm-eval's own evaluator on the model being
trained (eval/harness.py), their scores as `harness/TASK/METRIC` (e.g. `harness/ceval-valid/acc`).

The choices files and the harness tasks (names, data, lm-eval installed) are read and checked at construction, so a bad file or shot count fails in
one line before the first step rather than at the first evaluation hours later. The model, the
run's last step and the heartbeat do not exist yet then: `attach` gives them once built, and the
evaluator is a train loop callback from there on (`post_step`: it says "eval" to the heartbeat and
adds its values to the step's)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from mspretrain.config.schema import EvalConfig
from mspretrain.monitor.callback import Callback, DataState, Values


class PeriodicEval(Callback):
    def __init__(self, cfg: EvalConfig, *, data_dir: Path, seq_len: int, log: Callable[[str], None],
                 jit_level: str = "O0", seed: int = 0) -> None:
        self.cfg, self.data_dir, self.seq_len, self.log = cfg, data_dir, seq_len, log
        self.jit_level = jit_level  # device.jit_level: the eval graph compiles at the step's level
        self.items: list[Any] = []
        self.dev: list[Any] = []
        self.tokenizer: Any = None
        if cfg.choices_file:
            from mspretrain.data.tokenizer import Tokenizer
            from mspretrain.eval.choices import check_shots, read_choices

            self.items = read_choices(cfg.choices_file)
            self.dev = read_choices(cfg.choices_dev_file) if cfg.choices_dev_file else []
            check_shots(self.dev, cfg.choices_shots, shots_name="eval.choices_shots", dev_name="eval.choices_dev_file")
            self.tokenizer = Tokenizer.load(data_dir)  # the pieces the model is trained on
        self.seed = seed  # train.seed: sampled generations of harness tasks draw from it
        self.harness: tuple[Any, list[Any]] | None = None
        if cfg.harness_tasks:
            from mspretrain.data.tokenizer import Tokenizer
            from mspretrain.eval.harness import resolve_tasks

            # the tasks' data is read now (offline): a missing file fails before the first step
            self.harness = resolve_tasks(cfg.harness_tasks.split(","), cfg.harness_include_path or None)
            self.tokenizer = self.tokenizer or Tokenizer.load(data_dir)
        self.model: Any = None
        self.total = 0
        self.phase: Callable[[str, int], None] = lambda name, step: None

    def attach(self, model: Any, *, total: int, phase: Callable[[str, int], None]) -> None:
        """The model to evaluate, the run's last step (evaluated unless eval.at_end = false) and the
        heartbeat's `phase` (it says "eval" while the evaluation runs)."""
        self.model, self.total, self.phase = model, total, phase

    def post_step(self, step: int, data_state: DataState, values: Values) -> None:
        if self.due(step, self.total):
            self.phase("eval", step)
            values.update(self(self.model, step))

    def due(self, step: int, total: int) -> bool:
        return bool(self.cfg.every and step % self.cfg.every == 0) or (self.cfg.at_end and step == total)

    def __call__(self, model: Any, step: int) -> dict[str, float]:
        """Valid perplexity (and multiple-choice accuracy) of `model` after `step`, as metrics
        values; logs one line each."""
        from mspretrain.eval.perplexity import evaluate_split

        res = evaluate_split(model, self.data_dir, split="valid", seq_len=self.seq_len,
                             batch_size=self.cfg.batch_size, max_tokens=self.cfg.max_tokens, jit_level=self.jit_level)
        self.log(f"step {step}: valid ppl {res['ppl']:.2f} over {res['tokens']:,} tokens")
        values = {"eval/ppl": res["ppl"], "eval/nll": res["nll"]}
        if self.items:
            from mspretrain.eval.choices import choices_accuracy

            acc = choices_accuracy(model, self.tokenizer, self.items, batch_size=self.cfg.batch_size,
                                   dev=self.dev, shots=self.cfg.choices_shots)
            self.log(f"step {step}: {Path(self.cfg.choices_file).name}: accuracy {acc['acc']:.1%} "
                     f"(length-normalised {acc['acc_norm']:.1%}) over {acc['count']} questions"
                     + (f", {self.cfg.choices_shots}-shot" if self.cfg.choices_shots else ""))
            values.update({"eval/acc": acc["acc"], "eval/acc_norm": acc["acc_norm"]})
        if self.harness is not None:
            values.update(self.harness_scores(model, step))
        return values

    def harness_scores(self, model: Any, step: int) -> dict[str, float]:
        from mspretrain.eval.harness import MindSporeLM, evaluate, task_scores

        cfg = self.cfg
        lm = MindSporeLM(model, self.tokenizer, batch_size=cfg.batch_size, seed=self.seed)
        results = evaluate(lm, cfg.harness_tasks.split(","), limit=cfg.harness_limit or None, resolved=self.harness,
                           num_fewshot=None if cfg.harness_num_fewshot < 0 else cfg.harness_num_fewshot, bootstrap_iters=0)
        scores = task_scores(results)
        self.log(f"step {step}: lm-eval " + ", ".join(f"{k.removeprefix('harness/')} {v:.4g}" for k, v in scores.items()))
        return scores
