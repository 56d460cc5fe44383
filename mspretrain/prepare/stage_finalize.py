"""The stage before publish (`Finalize`): the scratch files gone, the shards' index files
written, the manifest built and written, every file durable. Redone whole after a kill: it is short."""
from __future__ import annotations

import json

from mspretrain.data.origin import cut_to, origin_name
from mspretrain.data.shards import ShardWriter
from mspretrain.data.tokenizer import Tokenizer
from mspretrain.paths import SPLITS
from mspretrain.prepare.modelfile import write_model
from mspretrain.prepare.publish import build_manifest, fsync_all
from mspretrain.prepare.quality import REFERENCE_LM
from mspretrain.prepare.resume import point
from mspretrain.prepare.stage import Run, Stage
from mspretrain.prepare.workdir import MANIFEST


class Finalize(Stage):
    name = "finalize"

    def run(self, r: Run, then: str | None) -> None:
        j, files = r.journal, r.files
        files.clean_scratch()  # (also what a kill just after a stage's commit left)
        saved = r.load_state("finalize")
        sink, tok_info = saved["sink"], saved["tok_info"]
        tok = r.tok if r.given is not None else Tokenizer.load(files.path(j.data["tokenizer_file"]))
        for s in SPLITS:
            ShardWriter.finish_resumed(files.path(s), r.dtype, j.data["writers"][s], fsync=False)  # prepare fsyncs every file at once
            if "origin_records" in j.data:  # the replay's move left the moved record's bytes (`OriginWriter.peek_last`)
                cut_to(files.path(origin_name(s)), j.data["origin_records"][s])
            point(f"finalized {s}")
        manifest = build_manifest(files.root, r.cfg, r.stats, sink, tok, tok_info, r.dtype)
        # the largest id per shard, counted while writing: `train` checks it against the vocabulary
        # instead of reading every shard (data/manifest.py, check_data_dir)
        manifest["max_token_id"] = {s: j.data["writers"][s]["max_token"] for s in SPLITS}
        if r.quality is not None:
            manifest["quality"] = r.quality.describe()
        if r.reference is not None:
            write_model(files.path(REFERENCE_LM), r.reference)
        manifest["inputs"] = [str(i) for i in r.inputs]
        manifest["warnings"] = j.warnings  # (the list the warnings below still go to)
        if r.seq_len:
            manifest["seq_len"] = r.seq_len
            for split in SPLITS:
                if manifest["tokens"][split] < r.seq_len + 1 and (split == "train" or r.cfg.valid_fraction > 0):
                    r.warn(f"the {split} split has {manifest['tokens'][split]} tokens, fewer than one window of seq_len + 1 = {r.seq_len + 1}")
        # what this prepare wrote: the only files a later `--overwrite` may remove or replace
        path = files.path(MANIFEST)
        manifest["outputs"] = sorted(files.outputs() + [path.name])
        path.write_text(json.dumps(manifest, ensure_ascii=False, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        # Files and their directory at once: nothing in `work` is visible before the publish stage,
        # so only "all durable before the rename" matters, not the order among them.
        fsync_all([*files.files(), files.root])
        j.commit(stage=then)
        r.manifest = manifest
