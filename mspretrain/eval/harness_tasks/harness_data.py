"""The data of mspretrain's own small lm-eval tasks (this directory's YAML files): rows of
../data/zh_generic.jsonl (questions written by the project), read from the installed package so
the tasks run anywhere, offline, with no dataset cache. lm-eval imports this file through the
YAMLs' `custom_dataset: !function harness_data.load`."""
from __future__ import annotations

import json
from pathlib import Path

ROWS = Path(__file__).resolve().parents[1] / "data" / "zh_generic.jsonl"


def load(**kwargs):
    import datasets

    rows = [json.loads(line) for line in ROWS.read_text(encoding="utf-8").splitlines() if line.strip()]
    for r in rows:
        r["answer"] = r["choices"][r["label"]]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
