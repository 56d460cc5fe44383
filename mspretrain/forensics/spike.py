"""`mspretrain spike RUN --step S`: what was in step S's batch, and which of it made the loss jump.

1. The batch: the loader position before step S (`batches.jsonl`, or the spike record the trainer
   wrote when the detector fired, `monitor/spike_record.py`) and the loader's pure plan
   (`data/order.py`) name every sample of the global batch: its rank, micro-batch, source, window
   and the documents the window overlaps, with each document's input file and offset (the data
   dir's origin index, `data/origin.py`) and its first characters (the run's tokenizer).
2. The losses: the run is replayed (`forensics/replay.py`) from the newest checkpoint some steps before S
   up to step S - 1, so the model holds the exact weights step S started from. A forward pass over
   step S's whole global batch gives every target token's NLL (`model/loss.token_nll`); a sample's
   loss is the mean over its window, a document's the mean over the targets that belong to it
   (windows are split at document boundaries). Outliers are measured two ways: a robust z-score
   against the batch itself (median and MAD, which the outliers cannot drag along, unlike mean
   and standard deviation), and each part's excess NLL over the spike detector's reference (the
   mean logged loss of the `spike.window` steps before S), divided by the batch's target tokens:
   by how much that part raised the step's loss above the normal level. The excesses add up to
   the spike's size; documents are ranked by them (a 2-token fragment with a high mean raises
   the loss little, a long bad document a lot).
3. The gradients: at the weights before each replayed step and before step S, the gradient of that
   step's loss (fp32, unscaled, before clipping) per parameter group (`model/groups.py`), step S's
   against the rolling median of the replayed steps before it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from mspretrain import budget
from mspretrain.config import schema as cfgmod
from mspretrain.data.order import batch_hash
from mspretrain.errors import UserError
from mspretrain.forensics.audit import plan_of_run
from mspretrain.forensics.replay import TOLERANCE, Replay, check_run, read_run_metrics, replay, run_data_dir
from mspretrain.fsutil import read_json_file
from mspretrain.monitor.batch_log import FILE as BATCHES
from mspretrain.monitor.batch_log import problem
from mspretrain.monitor.batch_log import records as batch_records
from mspretrain.monitor.spike_record import batch_samples, doc_ends, record_path
from mspretrain.paths import DataPaths, RunPaths

HISTORY = 8  # replayed steps before S whose gradient norms make the rolling medians
TEXT_TOKENS = 16  # tokens decoded for "first characters"


@dataclass
class Part:
    """A sample or a document, with its loss against the batch."""

    source: int
    ident: int  # position in the global batch (sample) or document id (document)
    tokens: int = 0  # target tokens of the batch that belong to it
    loss: float = math.nan  # mean token NLL
    z: float = math.nan  # robust z-score of `loss` among its kind in this batch
    excess: float = math.nan  # (sum of its NLL - tokens x reference loss) / batch target tokens


@dataclass
class Analysis:
    run: Path
    step: int
    pos: list[int]
    hash_ok: bool
    world: int
    micro: int
    accum: int  # micro-batches per step (budget.micro_batches)
    global_batch: int
    sources: list[str]
    samples: list[dict[str, Any]]  # monitor/spike_record.batch_samples, plus "text"
    docs: dict[tuple[int, int], dict[str, Any]]  # (source, doc) -> {"file", "offset", "kind", "text"}
    logged: dict[str, Any]  # metrics.jsonl's record of the step
    reference: float | None = None  # mean logged loss of the spike.window steps before the step
    replay: Replay | None = None
    batch_loss: float | None = None  # recomputed at the weights of step S - 1
    sample_parts: list[Part] = field(default_factory=list)
    doc_parts: list[Part] = field(default_factory=list)  # ranked, most excess first
    groups: dict[int, dict[str, float]] = field(default_factory=dict)  # step -> group -> grad norm
    notes: list[str] = field(default_factory=list)


# ----------------------------------------------------------------------------- the batch
def step_record(run: Path, step: int) -> dict[str, Any]:
    """The batches.jsonl line of `step` (the last one: after a rewind it is the kept history), or
    the spike record of that step."""
    found, last = None, 0
    for rec in batch_records(run):
        if isinstance(rec.get("step"), int):
            last = max(last, rec["step"])
            if rec["step"] == step:
                found = rec
    spike = record_path(run, step)
    if found is None and spike.exists():
        found = read_json_file(spike, "spike record", "the file was edited or replaced; restore it")
        # the fields a step record shares with it (a spike record has no lr)
        why = problem({**found, "lr": 0.0}) if isinstance(found, dict) else "not a JSON object"
        if why is not None:
            raise UserError(f"spike record {spike} is damaged ({why})", "restore it, or train again")
    if found is not None:
        return found
    if not (run / BATCHES).is_file():
        raise UserError(f"{run} has no {BATCHES} and no spike record of step {step}, so its batch is unknown",
                        "inspect a run trained with this version of mspretrain")
    raise UserError(f"step {step} is out of range: {run}/{BATCHES} records steps 1..{last}",
                    f"choose a step between 1 and {last}")


def first_text(tokenizer: Any, ids: np.ndarray, width: int = 24) -> str:
    text = tokenizer.decode([int(t) for t in ids[:TEXT_TOKENS]]) if tokenizer is not None else ""
    text = " ".join(text.split()).rstrip("\ufffd")  # one line per row; no half-decoded last character
    return text[:width] + ("…" if len(text) > width else "")


def run_tokenizer(run: Path, data_dir: Path) -> Any:
    from mspretrain.data.tokenizer import Tokenizer

    paths = RunPaths(run)
    for p in (paths.tokenizer_model, paths.tokenizer_json, DataPaths(data_dir).tokenizer):
        if p is not None and p.is_file():
            return Tokenizer.load(p)
    return None


def describe_batch(run: str | Path, step: int) -> Analysis:
    """Step S's samples and documents, from files only (no MindSpore)."""
    from mspretrain.data.loader import resolve_sources
    from mspretrain.data.origin import read_origin
    from mspretrain.data.shards import IndexedDataset

    run = Path(run).expanduser().resolve()
    check_run(run)
    if step < 1:
        raise UserError(f"--step {step}: steps count from 1", "give the step as train.log and metrics.jsonl show it")
    rec = step_record(run, step)
    cfg = cfgmod.load(RunPaths(run).config)
    data_dir = run_data_dir(run)
    plan, tokens = plan_of_run(run, cfg)
    world = int(rec.get("world", 1))  # the loader's: the data-parallel ranks (train/build.py)
    b = budget.derive(cfg, world=world, data_tokens=tokens)
    g, pos = cfg.train.global_batch, [int(p) for p in rec["pos"]]
    ids = plan.batch(pos, g)
    sources = [p for p, _ in resolve_sources(data_dir, cfg.data.sources)]
    ends = [doc_ends(p) for p in sources]
    metrics = read_run_metrics(run)
    samples = batch_samples(ids, sources=[str(p) for p in sources], ends=ends, seq_len=cfg.data.seq_len,
                            micro=b.micro_batch, world=world)
    a = Analysis(run=run, step=step, pos=pos, hash_ok=rec.get("hash") in (None, batch_hash(ids)), world=world,
                 micro=b.micro_batch, accum=b.accumulation, global_batch=g, sources=[str(p) for p in sources], samples=samples, docs={},
                 logged=metrics.get(step, {}))
    before = [metrics[s]["loss"] for s in range(max(1, step - cfg.spike.window), step) if "loss" in metrics.get(s, {})]
    a.reference = float(np.mean(before)) if before else None
    if not a.hash_ok:
        a.notes.append("the batch the plan gives for this position is not the one the run logged (hash differs): "
                       "the data dir, seed or mixing weights changed since training, so the list below may be wrong")
    kept = record_path(run, step)  # the spike record: the losses of rank 0's samples as the step computed them
    if kept.exists():
        spike_rec = read_json_file(kept, "spike record", "the file was edited or replaced; restore it")
        if isinstance(spike_rec, dict) and spike_rec.get("hash") == batch_hash(ids) and isinstance(spike_rec.get("samples"), list):
            for sample, r in zip(samples, spike_rec["samples"]):
                if isinstance(r, dict) and isinstance(r.get("loss"), (int, float)) and not isinstance(r["loss"], bool):
                    sample["trained_loss"] = float(r["loss"])
    tok = run_tokenizer(run, data_dir)
    data = [IndexedDataset(DataPaths(p).prefix("train")) for p in sources]
    origins = [read_origin(p) for p in sources]
    for (j, w), s in zip(ids.tolist(), samples):
        s["source_index"] = j
        s["text"] = first_text(tok, data[j].tokens[w * cfg.data.seq_len:(w + 1) * cfg.data.seq_len + 1])
        for d in s["documents"]:
            if (j, d) in a.docs:
                continue
            info: dict[str, Any] = {"file": None, "offset": None, "kind": None, "text": first_text(tok, data[j][d])}
            if origins[j] is not None:
                (info["file"], info["offset"]), info["kind"] = origins[j].locate([d])[0], origins[j].kind_of([d])[0]
            a.docs[(j, d)] = info
    if any(o is None for o in origins):
        a.notes.append("no origin index in " + ", ".join(str(p) for p, o in zip(sources, origins) if o is None)
                       + ": documents are listed without file and offset (re-run prepare to get document origins)")
    return a


# ----------------------------------------------------------------------------- numbers
def robust_z(values: np.ndarray) -> np.ndarray:
    """(x - median) / (1.4826 MAD): a z-score that the outliers it looks for cannot inflate."""
    v = np.asarray(values, dtype=np.float64)
    med = float(np.median(v))
    mad = 1.4826 * float(np.median(np.abs(v - med)))
    if mad == 0:  # half or more of the values are equal: fall back to the mean deviation
        mad = float(np.mean(np.abs(v - med))) or 1.0
    return (v - med) / mad


def _global_batch(loader: Any, pos: list[int]) -> Any:
    loader.load_state(loader.state_at(tuple(pos)))
    return loader.next_batch()


def token_losses(model: Any, batch: Any) -> np.ndarray:
    """(B, T) fp32 NLL of every target token of `batch` under `model`."""
    from mindspore import Tensor

    from mspretrain.model.loss import token_nll

    as_t = lambda x: None if x is None else Tensor(x)
    logits = model(Tensor(batch.tokens[:, :-1]), as_t(batch.positions), as_t(batch.segments))
    return token_nll(logits, Tensor(batch.tokens[:, 1:]))[0].asnumpy()


def group_grad_norms(model: Any, batch: Any) -> dict[str, float]:
    """Norm of the gradient of the batch's mean token NLL, per parameter group (fp32, unscaled,
    before clipping: what the step's `grad_norm` measures over all groups)."""
    import mindspore as ms
    from mindspore import Tensor

    from mspretrain.model.groups import param_groups
    from mspretrain.model.loss import token_nll

    params = model.trainable_params()
    n = float(batch.tokens[:, 1:].size)

    def mean_nll(tokens: Any, positions: Any, segments: Any) -> Any:
        return token_nll(model(tokens[:, :-1], positions, segments), tokens[:, 1:])[0].sum() / n

    as_t = lambda x: None if x is None else Tensor(x)
    _, grads = ms.value_and_grad(mean_nll, None, params)(Tensor(batch.tokens), as_t(batch.positions),
                                                         as_t(batch.segments))
    sq: dict[str, float] = {}
    total = 0.0
    for p, g in zip(params, grads):
        s = float(np.sum(np.square(g.asnumpy().astype(np.float64))))
        total += s
        for group in sorted(param_groups(p.name, bool(getattr(model, "tied", False)))):
            sq[group] = sq.get(group, 0.0) + s
    return {**{k: math.sqrt(v) for k, v in sq.items()}, "total": math.sqrt(total)}


def split_losses(a: Analysis, nll: np.ndarray, seq_len: int) -> None:
    """Per-sample and per-document parts of the batch's token NLL (`nll`: (B, T), global order)."""
    # the detector's reference: the normal level the step jumped from (the batch's own median when the
    # run logged no loss before it)
    ref = a.reference if a.reference is not None else float(np.median(nll))
    n = nll.size
    ends = {j: doc_ends(p) for j, p in enumerate(a.sources)}
    docs: dict[tuple[int, int], list[float]] = {}
    for i, s in enumerate(a.samples):
        j, w = s["source_index"], s["window"]
        row = nll[i].astype(np.float64)
        a.sample_parts.append(Part(j, i, row.size, float(row.mean()), excess=float((row - ref).sum() / n)))
        targets = w * seq_len + 1 + np.arange(row.size)  # split index of each target token
        owner = np.searchsorted(ends[j], targets, side="right")
        for d in np.unique(owner):
            docs.setdefault((j, int(d)), []).extend(row[owner == d].tolist())
    for (j, d), vals in docs.items():
        v = np.asarray(vals)
        a.doc_parts.append(Part(j, d, v.size, float(v.mean()), excess=float((v - ref).sum() / n)))
    for parts in (a.sample_parts, a.doc_parts):
        for p, z in zip(parts, robust_z(np.array([p.loss for p in parts]))):
            p.z = float(z)
    a.doc_parts.sort(key=lambda p: -p.excess)
    a.batch_loss = float(nll.astype(np.float64).sum() / n)


def analyse(run: str | Path, step: int, *, history: int = HISTORY, losses: bool = True,
            out: str | Path | None = None, log: Callable[[str], None] = lambda s: None) -> Analysis:
    """The batch of step S, and (with `losses`) the replay to S - 1 and the losses and gradient norms."""
    from mspretrain.data.loader import Loader
    from mspretrain.forensics.replay import history_checkpoint

    a = describe_batch(run, step)
    if not losses:
        return a
    ckpt = history_checkpoint(a.run, step, history)
    start = int(ckpt.name.split("_")[1])
    if step - 1 - start < history:
        a.notes.append(f"--history {history}: the oldest kept checkpoint before step {step} is step {start}, so "
                       f"{step - 1 - start} step(s) of gradient history are replayed (checkpoint.keep_last / "
                       "keep_every keep older ones)")
    cfg = cfgmod.load(RunPaths(a.run).config)
    loader = Loader([(p, w) for p, w in zip(a.sources, plan_of_run(a.run, cfg)[0].weights)], split="train",
                    seq_len=cfg.data.seq_len, batch_size=a.global_batch, seed=cfg.train.seed,
                    reset_attention_at_eos=cfg.data.reset_attention_at_eos, token_dtype=cfg.data.token_dtype,
                    log=lambda s: None)

    def observe(trainer: Any, done: int) -> None:
        pos = [int(s["consumed"]) for s in trainer.loader.state()["sources"]]
        if done == step - 1 and pos != a.pos:
            a.notes.append(f"the replay reached step {step} at sample position {pos}, batches.jsonl says {a.pos}")
        batch = _global_batch(loader, a.pos if done == step - 1 else pos)
        a.groups[done + 1] = group_grad_norms(trainer.model, batch)
        if done == step - 1:
            split_losses(a, token_losses(trainer.model, batch), cfg.data.seq_len)

    a.replay = replay(a.run, start, step - 1 - start, out=out, log=log, observer=observe)
    return a


# ----------------------------------------------------------------------------- output
def _fmt_loss(v: Any) -> str:
    return f"{v:.4f}" if isinstance(v, (int, float)) and math.isfinite(v) else "-"


def format_analysis(a: Analysis, *, top: int = 10) -> str:
    loss = a.logged.get("loss")
    head = (f"step {a.step} of {a.run}: loss {_fmt_loss(loss)}" + (" (flagged as a spike)" if "spike" in a.logged else "")
            + f"; global batch of {a.global_batch} samples at sample position {a.pos}, {a.world} rank(s) x "
              f"{a.accum} micro-batch(es) of {a.micro}")
    lines = [head] + [f"note: {n}" for n in a.notes]
    if a.replay is not None:
        r = a.replay
        bad = r.first_difference()
        exact = "bit for bit" if bad is None and r.exact_expected else (
            f"to {TOLERANCE:g}" if bad is None else f"NOT reproduced from step {bad.step}")
        what = (f"replayed steps {r.start + 1}..{r.end} from checkpoint step_{r.start:06d} ({exact})" if r.end > r.start
                else f"no step replayed: checkpoint step_{r.start:06d} holds the weights")
        lines.append(f"{what}; batch loss at the weights of step {a.step - 1}: {_fmt_loss(a.batch_loss)} (logged {_fmt_loss(loss)})")
    by_sample = {p.ident: p for p in a.sample_parts}
    what = ("mean token NLL at the weights of the step before" if by_sample else
            "mean token NLL as the step computed it (spike record; rank 0's samples)")
    lines += ["", f"samples (loss: {what}; z: robust z-score in this batch)",
              f"  {'#':>3} {'rank':>4} {'micro':>5} {'source':<12} {'window':>7} {'loss':>7} {'z':>6}  documents  text"]
    for i, s in enumerate(a.samples):
        p = by_sample.get(i)
        lines.append(f"  {i:>3} {s['rank']:>4} {s['micro']:>5} {Path(s['source']).name[:12]:<12} {s['window']:>7} "
                     f"{_fmt_loss(p.loss if p else s.get('trained_loss')):>7} {(f'{p.z:+.1f}' if p else '-'):>6}  "
                     f"{','.join(map(str, s['documents'])):<9}  {s['text']}")
    if a.doc_parts:
        lines += ["", f"documents ranked by how much they raised the step's loss (top {min(top, len(a.doc_parts))} "
                      f"of {len(a.doc_parts)}; excess: their NLL above the rolling mean loss {_fmt_loss(a.reference)} / the batch's target tokens)",
                  f"  {'rank':>4} {'doc':>7} {'tokens':>6} {'loss':>7} {'z':>6} {'excess':>8}  origin  text"]
        for k, p in enumerate(a.doc_parts[:top], 1):
            info = a.docs.get((p.source, p.ident), {})
            doc = f"{p.source}:{p.ident}" if p.source else str(p.ident)
            where = f"{info['file']}:{info['offset']}" + (" (line)" if info.get("kind") == "row" else "") \
                if info.get("file") else "no origin index"
            lines.append(f"  {k:>4} {doc:>7} {p.tokens:>6} {p.loss:7.4f} {p.z:+6.1f} {p.excess:+8.4f}  {where}  "
                         f"{info.get('text', '')}")
    else:
        lines += ["", "documents:"] + [f"  {(f'{j}:{d}' if j else str(d)):>7}  "
                                      f"{(str(i['file']) + ':' + str(i['offset'])) if i['file'] else 'no origin index'}  {i['text']}"
                                      for (j, d), i in sorted(a.docs.items())]
    if a.groups.get(a.step):
        before = [a.groups[s] for s in sorted(a.groups) if s < a.step]
        lines += ["", f"gradient norm by parameter group at step {a.step} against the median of steps "
                      f"{min(a.groups)}..{a.step - 1} (fp32, unscaled, before clipping)" if before else
                  f"gradient norm by parameter group at step {a.step} (no replayed step before it to compare with)"]
        for name, v in a.groups[a.step].items():
            med = float(np.median([g[name] for g in before])) if before else math.nan
            ratio = f"{v / med:5.1f}x" if before and med > 0 else ""
            lines.append(f"  {name:<11} {v:10.4g}" + (f"  median {med:10.4g}  {ratio}" if before else ""))
    return "\n".join(lines)
