"""A tiny run with a planted bad document whose batch trips the spike detector, shared by
tests/forensics/test_replay.py and tests/forensics/test_spike.py (built once per run of the suite,
`built_once`, so the second module reuses the first one's run, in either xdist worker).

The bad document is one character outside the poems' vocabulary repeated BAD_CHARS times: under the
tiny data dir's tokenizer it becomes byte-fallback tokens the model never sees otherwise, so at
step ~14 their loss is well above the poems'. 300 repeats (~900 tokens, 29 of ~1,000 windows), not
the issue's 4,000: at this corpus size 4,000 repeats would be a third of the data and fill most
batches. SEED was found by searching the loader's plan (pure arithmetic, `data/order.py`) for a
seed whose first batch holding a bad window is step SPIKE_STEP, with 2 of its 4 samples bad; the
tests check that property from the plan, so a change of the data or the plan fails loudly here."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np

from tests.conftest import NO_EVAL, TINY, built_once, make_poems

BAD_CHAR, BAD_CHARS = "龘", 300
SEED, SPIKE_STEP, STEPS = 360, 14, 24
# lr 1e-2 so that the poems' loss falls well below the byte tokens' by step 14; spike.window 10 so
# the detector is armed from step 11; a checkpoint every 2 steps, all kept (replay starts anywhere)
ARGS = ("train.max_steps=24", f"train.seed={SEED}", "optim.lr=1e-2", "spike.window=10", "checkpoint.every=2",
        "checkpoint.keep_last=12", "train.log_every=1", "metrics.grad_norm_every=1", NO_EVAL)  # no test reads its eval


def planted_data(root: Path, tiny_data: Path) -> Path:
    from mspretrain.config import schema as cfgmod
    from mspretrain.prepare.prepare import prepare

    corpus = root / "corpus"
    corpus.mkdir(parents=True)
    (corpus / "poems.txt").write_text("\n\n".join(make_poems(1200)) + "\n", encoding="utf-8")
    (corpus / "bad.txt").write_text(BAD_CHAR * BAD_CHARS + "\n", encoding="utf-8")
    cfg = cfgmod.load(TINY).prepare
    cfg = replace(cfg, max_top_ngram_fraction=1.0, max_dup_line_fraction=1.0)  # keep the repetitive document
    out = root / "data"
    prepare([str(corpus)], out, cfg, tokenizer=str(tiny_data / "tokenizer.model"), workers=1, log=lambda s: None)
    return out


def bad_doc(data: Path) -> int:
    from mspretrain.data.shards import IndexedDataset

    ds = IndexedDataset(data / "train")
    return int(np.argmax(ds.lengths))


def planted_run(tmp_path_factory, tiny_data: Path) -> tuple[Path, Path]:
    """(run dir, data dir). Trained through build_trainer, which writes batches.jsonl and the spike
    record (RUN/spikes/) as every training run does."""
    def build(root: Path) -> None:
        from mspretrain.config import schema as cfgmod
        from mspretrain.train.build import build_trainer

        data = planted_data(root, tiny_data)
        cfg = cfgmod.apply_overrides(cfgmod.load(TINY), list(ARGS))
        trainer = build_trainer(cfg, data, root / "run", log=lambda s: None)  # it writes the spike record itself
        trainer.train()
        (root / "DONE").write_text(json.dumps({"bad_doc": bad_doc(data)}))
    root = built_once(tmp_path_factory, "planted", build)
    return root / "run", root / "data"


def losses(run: Path) -> dict[int, float]:
    out = {}
    for line in (run / "metrics.jsonl").read_text(encoding="utf-8").splitlines():
        rec = json.loads(line)
        if "loss" in rec:
            out[rec["step"]] = rec["loss"]
    return out
