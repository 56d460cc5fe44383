"""`prepare`: raw text in, a verified data dir out (tokenizer, Megatron shards, manifest).

The parts, in the order a run meets them:
- `sources.py` finds the input files and reads them as documents, counting per file;
- `pipeline.py` runs the chain of stages (`stage*.py`: [the score scan,] read + clean, dedup,
  replay, [train the tokenizer, encode,] finalize, publish): `pool.py` cuts the work into chunks
  and runs `workers.py` on them in input order, `sink.py` dedups and splits, `spool.py` holds
  pass 1's documents while the tokenizer is trained, `data/shards.py` writes the Megatron files;
- `resume.py` keeps the progress journal: the same command, run again after a kill, resumes
  where the last commit was; another command against the half-done work is refused;
- `publish.py` builds the manifest and puts the data dir in place (a crash never leaves one
  that looks finished, and `--overwrite` replaces only what an earlier prepare wrote);
- `inspect.py` summarises a data dir (`prepare --inspect`).
"""
from __future__ import annotations

import errno
import os
import shutil
import time
from pathlib import Path
from typing import Callable

from mspretrain.config.schema import PrepareConfig
from mspretrain.data.tokenizer import Tokenizer
from mspretrain.errors import UserError
from mspretrain.fsutil import locked_beside
from mspretrain.prepare import pipeline, publish, rescore, resume, scoring, sources, stage_publish
from mspretrain.prepare import quality as quality_models
from mspretrain.prepare.pool import WorkerDied
from mspretrain.prepare.publish import WRITE_ERRNOS, check_out


def check_names(names: list[str]) -> None:
    """Refuse, before any work, a path whose name is not valid UTF-8 (Python keeps its bytes as
    lone surrogates): the manifest, which is UTF-8 JSON and names every input, could not hold it,
    and prepare used to crash only after all its work."""
    for name in names:
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            shown = name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
            raise UserError(f"the file name '{shown}' is not valid UTF-8, so the manifest cannot record it",
                            "rename it to UTF-8 (e.g. `convmv -f gbk -t utf-8 --notest FILE`), or move it out of the inputs") from None


def _tokenizer_id(given: Tokenizer | None) -> tuple[str, str] | None:
    return None if given is None else (str(given.path), given.sha256())


def _quality_id(cfg: PrepareConfig, scores_from: str | None = None) -> dict | None:
    """The quality models' identity for the fingerprint; None when a model cannot be loaded (then
    the run is not the one that was published, and `prepare` refuses the model in one line)."""
    try:
        stage = scoring.QualityStage.load(cfg, quality_models.reference_lm(cfg)[0] if cfg.lm_reference else None)
        return _identity(stage, scores_from)
    except (UserError, OSError):
        return None


def _identity(stage: scoring.QualityStage | None, scores_from: str | None) -> dict | None:
    """The fingerprint's `quality`: the models, and the sidecar `--scores-from` takes scores from
    (a rerun with another one must not resume; the output does not depend on it)."""
    if stage is None:
        return None
    return {**stage.identity(), **({"scores_from": rescore.source_identity(scores_from)} if scores_from else {})}


def _discard(journal: resume.Journal) -> None:
    """A run that failed cleanly (an error, not a kill) leaves nothing behind."""
    try:
        journal.wait()  # a background commit must not write the journal after it was removed
    except BaseException:  # noqa: BLE001 (its error is not the one being reported)
        pass
    shutil.rmtree(journal.work, ignore_errors=True)
    journal.remove()


def prepare(inputs: list[str], out_dir: str | Path, cfg: PrepareConfig, *, tokenizer: str | None = None,
            overwrite: bool = False, workers: int | None = None, progress: bool = False,
            log: Callable[[str], None] = print, seq_len: int | None = None, ray=None, scores_from: str | None = None) -> dict:
    """Clean, dedup, tokenize `inputs` into the data dir `out_dir`; returns the manifest.

    `tokenizer`: an existing `tokenizer.model` / `tokenizer.json` (or a dir holding one);
    otherwise a SentencePiece BPE of `cfg.vocab_size` is trained on a sample. `seq_len` is only
    used to warn when a split is shorter than one training window. `ray`: a connected
    `raypool.RayCluster` (the caller's, which closes it) to run the chunks on; `workers` is then
    its CPU count. `scores_from`: a data dir prepared with the same quality models from the
    same inputs, whose `quality.scores` gives every document's scores (`rescore.py`): only the
    thresholds are applied again.
    """
    t0 = time.time()  # `cfg` checked itself when it was built (config.PrepareConfig.check)
    cores = len(os.sched_getaffinity(0))
    workers = max(1, int(workers if workers is not None else cores)) if ray is None else ray.cpus
    if workers > cores and ray is None:  # more processes than cores only adds memory and switching: never a fork bomb
        log(f"warning: --workers {workers} is more than the {cores} cores this process may use; using {cores}")
        workers = cores
    out = Path(out_dir).expanduser()
    stats = sources.SourceStats()
    named = sources.discover_named(inputs, stats)
    paths = [p for p, _ in named]
    check_names([*inputs, *(str(p) for p in paths), *(n for _, n in named), str(out)])
    made = [d for d in reversed(out.parents) if not d.exists()]  # parents this call creates (taken away again on a refusal)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create {out.parent}: {exc.strerror or exc}", "choose an --out in a directory you can write to") from None
    try:
        # one prepare per --out at a time (as `train` locks a run dir): a second one would resume the
        # first's live work dir; the lock file `.NAME.lock` beside it goes when this run ends
        with locked_beside(out.with_name(f".{out.name}.lock"), "prepare", f"--out {out}", log):
            return _prepare(inputs, out, cfg, named=named, stats=stats, tokenizer=tokenizer, overwrite=overwrite, workers=workers,
                            progress=progress, log=log, seq_len=seq_len, ray=ray, scores_from=scores_from, t0=t0)
    except UserError:
        for d in reversed(made):  # a refused prepare leaves no new directory behind
            try:
                d.rmdir()
            except OSError:
                break
        raise


def _prepare(inputs: list[str], out: Path, cfg: PrepareConfig, *, named: list, stats: sources.SourceStats, tokenizer: str | None,
             overwrite: bool, workers: int, progress: bool, log: Callable[[str], None], seq_len: int | None, ray,
             scores_from: str | None, t0: float) -> dict:
    """`prepare` under the lock of its --out."""
    paths = [p for p, _ in named]
    journal = resume.Journal(out)
    interrupted = journal.read()  # (a journal of that name that is not prepare's is refused here, in one line)
    if interrupted is not None and interrupted.get("stage") == stage_publish.Publish.name and journal.work.is_dir() \
            and publish.restore_old(out):  # killed between the whole-dir swap's two renames: as before that publish
        log(f"the interrupted prepare was killed while replacing {out}: its previous data dir is back, publishing again")
    names = [n for _, n in named]

    def fingerprint(given: Tokenizer | None, quality: dict | None) -> dict:
        return resume.fingerprint(inputs, paths, names, cfg, _tokenizer_id(given), seq_len, quality)

    done = stage_publish.already_published(
        journal, out, lambda: fingerprint(Tokenizer.load(tokenizer) if tokenizer else None, _quality_id(cfg, scores_from)), log)
    if done is not None:
        return done
    check_out(out, overwrite, paths)
    given = Tokenizer.load(tokenizer) if tokenizer else None
    if given is not None and given.eos_id < 0:
        raise UserError(f"tokenizer {tokenizer} has no end-of-sequence token", "use a tokenizer with an EOS token such as </s>")
    warnings = journal.warnings

    def warn(msg: str) -> None:
        if len(warnings) < 100:
            warnings.append(msg)
        log(f"warning: {msg}")

    work = journal.work
    # the quality models, loaded (and a missing or corrupt one refused) before anything is written
    # (prepare.lm_reference: the perplexity model counted here, from the files named; written to the data dir)
    reference = quality_models.reference_lm(cfg) if cfg.lm_reference else None
    quality = scoring.QualityStage.load(cfg, reference[0] if reference else None)
    source = rescore.open_source(scores_from, quality, cfg, names, paths) if scores_from else None
    fp = fingerprint(given, _identity(quality, scores_from))
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        # a work dir left by a killed run of this command is resumed; of another, refused
        journal.open(fp)
    except OSError as exc:
        raise UserError(f"cannot create {work}: {exc.strerror}", "choose an --out in a directory you can write to") from None
    if stage_publish.torn(journal):
        log("the interrupted prepare was killed while publishing file by file: starting over")
        _discard(journal)  # its journal says the work dir is prepare's
        journal.open(fp)
    try:
        if source is not None:  # another data dir's scores: the fractions' thresholds from them, and no scan
            quality = rescore.resolve(quality, source)
        manifest = pipeline.run(paths, names, work, cfg, given, workers, progress, log, warn, stats, journal, ray=ray,
                                quality=quality, out=out, inputs=inputs, seq_len=seq_len, reference=reference[1] if reference else None)
    except OSError as exc:
        _discard(journal)
        if exc.errno in WRITE_ERRNOS:  # disk full, file too large, quota, read-only, permission
            where = exc.filename or work
            fix = (f"free disk space where {out} goes (or choose another --out), then run the same command"
                   if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT) else
                   f"fix the permissions of {where} (or choose another --out)")
            raise UserError(f"prepare stopped: {exc.strerror} ({where}); nothing was published", fix) from None
        raise
    except WorkerDied:
        # as after a kill -9 of the whole command: the work dir and its journal stay (the last
        # commit's background fsyncs finished first), and the same command resumes from them
        try:
            journal.wait()
        except BaseException:  # noqa: BLE001 (a failed last commit leaves the one before it: still a resume)
            pass
        raise
    except BaseException:
        _discard(journal)
        raise
    tok = manifest["tokens"]
    log(f"wrote {out}: {manifest['documents']['train']:,} + {manifest['documents']['valid']:,} documents, "
        f"{tok['train']:,} train + {tok['valid']:,} valid tokens, {manifest['chars_per_token']:.2f} chars/token "
        f"({time.time() - t0:.1f} s)")
    line = quality_summary(manifest)
    if line:
        log(line)
    return manifest


def quality_summary(manifest: dict) -> str | None:
    """The summary's line on what the quality filters dropped (None when none was on), with each
    threshold a fraction resolved to: prepare's own output says it, not only `--inspect`."""
    q = manifest.get("quality")
    if not isinstance(q, dict):
        return None
    dropped = manifest.get("dropped") if isinstance(manifest.get("dropped"), dict) else {}
    parts = []
    for reason, key, what in (("contaminated", "decontam", "decontamination"), ("language", "language", "language"),
                              ("perplexity", "perplexity", "perplexity"), ("quality", "classifier", "classifier")):
        if key in q:
            parts.append(f"{what} {int(dropped.get(reason, 0)):,}")
    extra = []
    if isinstance(q.get("classifier"), dict) and q["classifier"].get("top_fraction"):
        extra.append(f"quality_top_fraction {q['classifier']['top_fraction']} -> threshold {q['classifier'].get('threshold'):.4g}")
    if isinstance(q.get("perplexity"), dict) and q["perplexity"].get("quantiles"):
        extra.append(f"ppl_quantiles -> [{q['perplexity'].get('min'):.4g}, {q['perplexity'].get('max'):.4g}]")
    return (f"quality filters dropped {sum(int(dropped.get(r, 0)) for r in ('contaminated', 'language', 'perplexity', 'quality')):,} "
            f"of {manifest.get('documents_in', 0):,} documents read ({', '.join(parts)})" + (f"; {'; '.join(extra)}" if extra else "")
            + "; see them with prepare --inspect")
