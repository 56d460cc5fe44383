"""An lm-evaluation-harness model backed by mspretrain's MindSpore decoder, in process.

`MindSporeLM` is an `lm_eval.api.model.TemplateLM` (lm-eval 0.4.x; pinned 0.4.13 in the `eval`
extra): lm-eval's own evaluator (`lm_eval.simple_evaluate`) drives it, with lm-eval's tasks,
prompts, metrics and output files. lm-eval is imported here and only here (the commands and the
trainer import this module lazily), so mspretrain runs without it.

    from mspretrain.eval.harness import MindSporeLM
    lm = MindSporeLM.from_path("runs/demo", batch_size=8)
    lm_eval.simple_evaluate(model=lm, tasks=["ceval-valid"], task_manager=...)

Design choices:
- Tokens are built by lm-eval's `TemplateLM` (context and continuation encoded together and
  split, an empty context replaced by `prefix_token_id`), exactly as its `hf` model does, so a
  checkpoint scores the same here and through `lm_eval --model hf` on its `export --format hf`
  folder (tests/eval/test_harness.py holds the two within 1e-4 per request). Non-empty contexts get
  no BOS/EOS in front, as in the `hf` model with the exported tokenizer (add_bos_token false);
  the prefix of an empty context (and of `loglikelihood_rolling`'s windows) is EOS, the token
  every document follows in training (`prepare` joins documents with it). To compare with the
  `hf` model pass it `prefix_token_id=<eos id>` (its default is BOS).
- Batch invariance: a request's score does not depend on what it is batched with. Requests are
  grouped by the width bucket of their own length (multiples of 32, up to the context), every
  batch is filled up to `batch_size` with copies, so a request always runs through the same
  compiled graph (batch, width) whatever else is scored; rows of a causal model do not mix.
- Log-probabilities come from an fp32 log-softmax in the graph; only the target's
  log-probability and the argmax (for is_greedy) leave the device, never the (B, T, V) logits.
- `generate_until` decodes one request at a time with the model's KV cache (`prefill` +
  `decode_step`): the prompt is prefilled right-padded to a bucket (the padding's cache slots
  are each overwritten before the causal mask lets a later position see them), so prompts of
  similar lengths share a compiled graph. Greedy when `do_sample` is false or the temperature
  is 0; sampled otherwise (temperature, top_k, top_p) on the host from a generator seeded by the
  run's seed and the request's text, so a sample does not depend on order or batching. Stops at
  EOS, at `max_gen_toks`, or when a stop string appears; the text is cut at the first stop
  string as lm-eval's backends do.
- Data parallel over msrun ranks (`mspretrain launch --nproc N -- eval RUN --tasks ...`): every
  rank loads the whole model; lm-eval gives each rank its share of the documents
  (`rank`/`world_size`) and gathers the per-document results to rank 0 through `gather_object` /
  `all_gather` / `barrier`, which are eager `AllReduce(SUM)` calls here (each rank writes its bytes
  into its own row of a zero buffer; the CPU backend reduces float32 only, which holds a byte and
  any count below 2^24 exactly). Only rank 0 writes and prints. lm-eval's own code for this path
  imports torch. During training (`eval.harness_tasks`, data parallel and ZeRO-1/2) every rank
  scores every request instead, on the whole weights it holds; under ZeRO-3 or tensor parallel the
  forward has collectives inside and the KV-cache decode has no such path, so config/schema.py refuses
  the harness in the loop there.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from mspretrain.errors import UserError

OFFLINE_ENV = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "HF_HUB_DISABLE_TELEMETRY": "1"}


def go_offline() -> None:
    """Nothing may reach a hub: the switches datasets / huggingface_hub read at import, and their
    module constants when they were imported before this call."""
    os.environ.update(OFFLINE_ENV)
    import sys

    if "datasets" in sys.modules:
        import datasets.config as dc

        dc.HF_DATASETS_OFFLINE = True
        dc.HF_HUB_OFFLINE = True
    if "huggingface_hub" in sys.modules:
        import huggingface_hub.constants as hc

        hc.HF_HUB_OFFLINE = True


def _lm_eval() -> Any:
    go_offline()
    try:
        import lm_eval  # noqa: F401
        from lm_eval.api.model import TemplateLM
    except ImportError:
        raise UserError("lm-evaluation-harness is not installed", 'pip install "mspretrain[eval]" (lm-eval 0.4.13)') from None
    import datasets

    datasets.disable_progress_bars()  # "Generating test split" bars on every load, in train.log's stderr too
    go_offline()  # datasets is imported now: its module constants too
    return TemplateLM


def bucket(n: int, cap: int, step: int = 32) -> int:
    """The compiled width for a row of n tokens: n rounded up to a multiple of `step`, at most `cap`."""
    return min(cap, -(-n // step) * step)


def _score_fn(model: Any) -> Callable[[Any], tuple[Any, Any]]:
    """tokens (B, W) -> (log-probability of each next token (B, W-1) fp32, argmax (B, W-1)),
    compiled once per model (MindSpore compiles once per shape)."""
    fn = model.__dict__.get("_mspretrain_harness_fn")
    if fn is None:
        import mindspore as ms
        from mindspore import ops

        def score(tokens):
            logits = model(tokens[:, :-1]).astype(ms.float32)
            logp = ops.log_softmax(logits, -1)
            target = ops.gather_elements(logp, 2, tokens[:, 1:].expand_dims(-1)).squeeze(-1)
            return target, logits.argmax(-1).astype(ms.int32)

        fn = ms.jit(score)
        model.__dict__["_mspretrain_harness_fn"] = fn
    return fn


def _request_seed(seed: int, context: str, gen_kwargs: dict) -> np.random.Generator:
    key = hashlib.sha256(json.dumps([context, gen_kwargs], sort_keys=True, default=str).encode("utf-8")).digest()
    return np.random.default_rng([seed & 0xFFFFFFFF, *np.frombuffer(key[:16], dtype=np.uint32).tolist()])


def make_lm_class() -> type:
    """The `MindSporeLM` class (built on first use: it subclasses lm-eval's TemplateLM)."""
    TemplateLM = _lm_eval()
    from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    from mspretrain.eval.generate import SamplingParams, _cached_fns, sample_next

    class MindSporeLM(TemplateLM):
        """lm-eval model: a loaded mspretrain Decoder and its tokenizer."""

        backend = "causal"

        def __init__(self, model: Any, tokenizer: Any, *, batch_size: int = 8, seed: int = 0,
                     max_length: int | None = None, max_gen_toks: int = 256, world: Any = None) -> None:
            super().__init__()
            if world is not None and world.size > 1:  # lm-eval shards the documents by these
                self._rank, self._world_size = int(world.rank), int(world.size)
            if not 0 < int(batch_size) <= 4096:
                raise UserError(f"batch size {batch_size} must be between 1 and 4096", "use e.g. --batch-size 8")
            self.model, self.tokenizer = model, tokenizer
            self.batch_size = int(batch_size)
            self.seed = int(seed)
            self._max_length = int(max_length or model.cfg.max_seq_len)
            self._max_gen_toks = int(max_gen_toks)
            if tokenizer.eos_id < 0:
                raise UserError("the tokenizer has no EOS token", "the harness needs EOS to start empty contexts and to stop generation")

        @classmethod
        def from_path(cls, path: str | Path, *, dtype: str | None = None, log: Callable[[str], None] = lambda s: None,
                      **kw: Any) -> "MindSporeLM":
            """From a RUN_DIR (its newest verified checkpoint) or a CKPT_DIR, loaded as `eval` loads it;
            the seed defaults to the run's train.seed. `world` (mspretrain.world.World, from
            train.distributed.init after this load under msrun): the ranks share the documents."""
            from mspretrain.checkpoint.model import load_model

            loaded = load_model(path, dtype=dtype, log=log)  # sets MindSpore up for the checkpoint's device
            kw.setdefault("seed", loaded.config.train.seed)
            return cls(loaded.model, loaded.tokenizer, **kw)

        # ------------------------------------------------------------- data parallel (lm-eval's hooks)
        @property
        def device(self) -> str:
            return "cpu"  # where lm-eval puts the torch tensors it hands to all_gather

        def _allsum(self, x: np.ndarray) -> np.ndarray:
            import mindspore as ms
            from mindspore import ops

            op = self.__dict__.setdefault("_allreduce", ops.AllReduce(ops.ReduceOp.SUM))
            return op(ms.Tensor(np.ascontiguousarray(x, dtype=np.float32))).asnumpy()

        def gather_object(self, obj: Any, dst: int = 0) -> list:
            """Every rank's `obj`, in rank order (on every rank; lm-eval reads it on rank 0)."""
            import pickle

            if self._world_size == 1:
                return [obj]
            data = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
            lengths = np.zeros((self._world_size, 3), dtype=np.float32)  # base-4096 digits: exact in float32
            lengths[self._rank] = (len(data) >> 24, (len(data) >> 12) & 4095, len(data) & 4095)
            lengths = self._allsum(lengths).astype(np.int64)
            sizes = [int(a << 24 | b << 12 | c) for a, b, c in lengths]
            buf = np.zeros((self._world_size, max(sizes)), dtype=np.float32)
            buf[self._rank, : len(data)] = data
            buf = self._allsum(buf)
            return [pickle.loads(buf[r, : sizes[r]].astype(np.uint8).tobytes()) for r in range(self._world_size)]  # noqa: S301 (our own ranks)

        def all_gather(self, tensor: Any) -> Any:
            import torch  # lm-eval's data-parallel path hands torch tensors (its code imports torch there)

            parts = self.gather_object(tensor.detach().cpu().numpy().reshape(-1))
            return torch.as_tensor(np.concatenate(parts))

        def barrier(self) -> None:
            if self._world_size > 1:
                self._allsum(np.zeros(1, dtype=np.float32))

        @classmethod
        def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> "MindSporeLM":
            """`lm_eval --model mspretrain --model_args pretrained=RUN_DIR,dtype=fp32` (after importing
            this module, which registers the name)."""
            from lm_eval.utils import simple_parse_args_string

            args = simple_parse_args_string(arg_string)
            extra = {k: v for k, v in (additional_config or {}).items() if k == "batch_size" and v not in (None, "auto")}
            path = args.pop("pretrained", None) or args.pop("path", None)
            if not path:
                raise UserError("--model_args needs pretrained=RUN_DIR (or a checkpoint dir)", "e.g. --model_args pretrained=runs/demo")
            return cls.from_path(path, **{**args, **extra})

        # ------------------------------------------------------------- lm-eval's surface
        @property
        def eot_token_id(self) -> int:
            return int(self.tokenizer.eos_id)

        @property
        def prefix_token_id(self) -> int:
            return int(self.tokenizer.eos_id)

        @property
        def max_length(self) -> int:
            return self._max_length

        @property
        def max_gen_toks(self) -> int:
            return self._max_gen_toks

        def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
            return list(self.tokenizer.encode(string))

        def tok_decode(self, tokens: Sequence[int], skip_special_tokens: bool = True) -> str:
            return self.tokenizer.decode([int(t) for t in tokens])

        # ------------------------------------------------------------- scoring
        def score_rows(self, rows: Sequence[tuple[list[int], int]]) -> list[tuple[float, bool]]:
            """(summed log-probability of the last n tokens, all of them greedy) per (tokens, n) row;
            rows of at most max_length + 1 tokens, batched by their own width bucket."""
            import mindspore as ms

            fn = _score_fn(self.model)
            cap = self._max_length + 1
            out: list[tuple[float, bool]] = [(0.0, False)] * len(rows)
            by_width: dict[int, list[int]] = {}
            for i, (row, _) in enumerate(rows):
                by_width.setdefault(bucket(len(row), cap), []).append(i)
            for width in sorted(by_width, reverse=True):
                idx = sorted(by_width[width], key=lambda i: -len(rows[i][0]))
                for start in range(0, len(idx), self.batch_size):
                    part = idx[start : start + self.batch_size]
                    batch = np.full((self.batch_size, width), self.eot_token_id, dtype=np.int32)
                    for r, i in enumerate(part):
                        batch[r, : len(rows[i][0])] = rows[i][0]
                    batch[len(part):] = batch[0]  # copies fill the batch: one shape per width
                    logp, greedy = fn(ms.Tensor(batch))
                    logp, greedy = logp.asnumpy().astype(np.float64), greedy.asnumpy()
                    for r, i in enumerate(part):
                        row, n = rows[i]
                        sl = slice(len(row) - 1 - n, len(row) - 1)  # predictions of the last n tokens
                        out[i] = (float(logp[r, sl].sum()), bool((greedy[r, sl] == np.asarray(row[-n:])).all()))
            return out

        def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
            rows = []
            for _, context_enc, continuation_enc in requests:
                if not continuation_enc:
                    raise UserError("a request's continuation encodes to no tokens", "check the task's doc_to_choice / doc_to_target")
                if len(continuation_enc) > self._max_length:
                    raise UserError(f"a continuation of {len(continuation_enc)} tokens does not fit the model's context of {self._max_length}",
                                    "use a task with shorter answers or a model with a longer context")
                rows.append(((list(context_enc) + list(continuation_enc))[-(self._max_length + 1):], len(continuation_enc)))
            res = self.score_rows(rows)
            for (key, _, _), answer in zip(requests, res):
                if key is not None:
                    self.cache_hook.add_partial("loglikelihood", key, answer)
            return res

        def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
            windows, owner = [], []
            for k, req in enumerate(requests):
                (string,) = req.args
                for ctx, cont in map(make_disjoint_window, get_rolling_token_windows(
                        token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                        max_seq_len=self._max_length, context_len=1)):
                    windows.append((None, ctx, cont))
                    owner.append(k)
            scores = self._loglikelihood_tokens(windows) if windows else []
            totals = [0.0] * len(requests)
            for k, (lp, _) in zip(owner, scores):
                totals[k] += lp
            for req, total in zip(requests, totals):
                self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
            return totals

        # ------------------------------------------------------------- generation
        def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
            eos_text = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
            out = []
            for req in requests:
                context, gen_kwargs = req.args
                text = self.generate_one(context, dict(gen_kwargs), eos_text)
                self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
                out.append(text)
            return out

        def generate_one(self, context: str, gen_kwargs: dict, eos_text: str = "") -> str:
            import mindspore as ms

            original = dict(gen_kwargs)
            kw = normalize_gen_kwargs(gen_kwargs, self._max_gen_toks)
            until = handle_stop_sequences(kw.pop("until", None), eos=eos_text)
            max_gen = int(kw.pop("max_gen_toks"))
            L = self._max_length
            if max_gen >= L:
                raise UserError(f"max_gen_toks {max_gen} must be less than the model's context of {L}",
                                "lower the task's generation_kwargs.max_gen_toks")
            ids = self.tok_encode(context)[-(L - max_gen):]  # lm-eval's left truncation
            if not ids:
                ids = [self.prefix_token_id]
            temperature = float(kw.get("temperature", 0.0) or 0.0)
            greedy = not kw.get("do_sample", False) or temperature == 0.0
            params = SamplingParams(max_new_tokens=max_gen, greedy=greedy, temperature=temperature if not greedy else 1.0,
                                    top_k=int(kw.get("top_k", 0) or 0), top_p=float(kw.get("top_p", 1.0) or 1.0),
                                    repetition_penalty=float(kw.get("repetition_penalty", 1.0) or 1.0))
            params.check()
            rng = _request_seed(self.seed, context, original)
            n = len(ids)
            S = bucket(n + max_gen, L, 64)
            P = bucket(n, S)
            prefill, decode = _cached_fns(self.model)
            buf = np.full((1, P), self.eot_token_id, dtype=np.int32)
            buf[0, :n] = ids
            logits, cache = prefill(ms.Tensor(buf), ms.mutable(self.model.init_cache(1, S)))
            row = logits.asnumpy()[0, n - 1]
            new: list[int] = []
            for i in range(min(max_gen, S - n)):
                nxt = sample_next(row, ids + new if params.repetition_penalty != 1.0 else [], params, rng)
                if nxt == self.eot_token_id:
                    break
                new.append(nxt)
                if any(s and s in self.tok_decode(new) for s in until) or i == min(max_gen, S - n) - 1:
                    break
                logits, cache = decode(ms.Tensor([[nxt]], ms.int32), ms.Tensor(n + len(new) - 1, ms.int32), ms.mutable(cache))
                row = logits.asnumpy()[0, 0]
            return postprocess_generated_text(generation=self.tok_decode(new), stop=until, think_end_token=None)

    try:
        from lm_eval.api.registry import register_model

        register_model("mspretrain")(MindSporeLM)
    except (ImportError, ValueError, AssertionError):  # already registered (a second build in one process)
        pass
    return MindSporeLM


_CLASS: type | None = None


def __getattr__(name: str) -> Any:
    """`from mspretrain.eval.harness import MindSporeLM` builds the class on first use."""
    global _CLASS
    if name == "MindSporeLM":
        if _CLASS is None:
            _CLASS = make_lm_class()
        return _CLASS
    raise AttributeError(name)


# ----------------------------------------------------------------------------- tasks and runs

SHIPPED_TASKS = Path(__file__).resolve().parent / "harness_tasks"  # mspretrain_zh_choices, _gen, _rolling
_FETCH_HINT = ("fetch the data and point a local task YAML's dataset_kwargs.data_files at it, then pass its dir "
               "with --include-path (docs/evaluation.md shows C-Eval, CMMLU and MMLU)")


def _local_files(cfg: dict | None) -> list[str]:
    """The local files a task's YAML names in dataset_kwargs.data_files / data_dir (not URLs or globs)."""
    kwargs = (cfg or {}).get("dataset_kwargs") or {}
    files: list[str] = []
    data_files = kwargs.get("data_files")
    for v in (data_files.values() if isinstance(data_files, dict) else [data_files]):
        files += [v] if isinstance(v, str) else [x for x in (v or []) if isinstance(x, str)]
    if isinstance(kwargs.get("data_dir"), str) and Path(str((cfg or {}).get("dataset_path", ""))).is_dir():
        files.append(str(Path(cfg["dataset_path"]) / kwargs["data_dir"]))
    return [f for f in files if "://" not in f and not any(c in f for c in "*?[")]


def resolve_tasks(names: Sequence[str], include_path: str | Path | None = None) -> tuple[Any, list[Any]]:
    """(lm-eval TaskManager, built Task/Group objects) for task names, offline; an unknown name or
    a task whose data cannot be read locally is refused in one line (UserError), naming the file."""
    _lm_eval()
    from lm_eval.api.group import Group
    from lm_eval.api.task import Task
    from lm_eval.tasks import TaskManager

    names = [n.strip() for n in names if n.strip()]
    if not names:
        raise UserError("--tasks names no task", "e.g. --tasks ceval-valid,cmmlu (with their local data) or mspretrain_zh_choices")
    paths = [str(SHIPPED_TASKS)]
    if include_path:
        for p in str(include_path).split(":") if isinstance(include_path, str) else [include_path]:
            if not Path(p).is_dir():
                raise UserError(f"--include-path {p} is not a directory", "pass the directory holding your task YAML files")
            paths.append(str(p))
    # lm-eval's ~14,000 own task configs take ~10 s to index: only when a name is not one of ours or the user's
    tm = TaskManager(include_path=paths, include_defaults=False)
    if any(not tm.match_tasks([n]) for n in names):
        tm = TaskManager(include_path=paths)
    unknown = [n for n in names if not tm.match_tasks([n])]
    if unknown:
        raise UserError(f"unknown task {unknown[0]!r}" + (f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""),
                        "`lm-eval ls tasks` lists lm-eval's tasks; a task of your own needs --include-path DIR with its YAML")
    built: list[Any] = []
    for name in tm.match_tasks(names):
        entry = tm.task_index.get(name)
        for f in _local_files(getattr(entry, "cfg", None)):
            if not Path(f).exists():
                raise UserError(f"task {name}: its data file {f} does not exist", _FETCH_HINT)
        try:
            obj = tm._load_spec(name)  # reads the data (lm-eval 0.4.13's loader, pinned)
        except UserError:
            raise
        except Exception as exc:  # datasets: FileNotFoundError, ConnectionError in offline mode, ...
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
            raise UserError(f"task {name}: its data cannot be read offline ({type(exc).__name__}: {first})", _FETCH_HINT) from None
        built += obj if isinstance(obj, list) else [obj]
    assert all(isinstance(o, (Task, Group)) for o in built)
    return tm, built


def evaluate(lm: Any, names: Sequence[str], *, include_path: str | Path | None = None, num_fewshot: int | None = None,
             limit: float | None = None, log_samples: bool = False, tracker: Any = None,
             resolved: tuple[Any, list[Any]] | None = None, bootstrap_iters: int = 100000,
             model_args: dict | None = None) -> dict:
    """lm-eval's own evaluator (`simple_evaluate`) with our model on these tasks: its results dict
    (bootstrap_iters=0: no standard errors, which the loop does not need and which cost seconds).
    model_args: only recorded, e.g. {"pretrained": RUN_DIR}, which names lm-eval's output sub-directory."""
    import logging

    from lm_eval import simple_evaluate

    tm, built = resolved or resolve_tasks(names, include_path)
    for name in ("lm-eval", "lm_eval"):  # lm-eval's INFO lines are for its own CLI; warnings stay
        logging.getLogger(name).setLevel(logging.WARNING)
    return simple_evaluate(model=lm, tasks=built, task_manager=tm, num_fewshot=num_fewshot, limit=limit,
                           log_samples=log_samples, evaluation_tracker=tracker, bootstrap_iters=bootstrap_iters,
                           model_args=model_args)


def task_scores(results: dict) -> dict[str, float]:
    """{"harness/TASK/METRIC": value} of an lm-eval results dict (groups included; stderr and the
    sample count left out)."""
    out: dict[str, float] = {}
    for task, metrics in results.get("results", {}).items():
        for key, v in metrics.items():
            metric, _, filt = key.partition(",")
            if "stderr" in metric or not isinstance(v, (int, float)) or isinstance(v, bool) or metric in ("alias", "sample_len"):
                continue
            out[f"harness/{task}/{metric}" + (f"_{filt}" if filt and filt != "none" else "")] = float(v)
    return out

