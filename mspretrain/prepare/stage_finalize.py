"""The last stage of prepare's pipeline (`Finalize`): the scratch files gone, the shards' index
files written, the manifest built. Redone whole after a kill: it is short."""
from __future__ import annotations

import shutil

from mspretrain.data.origin import cut_to, origin_name
from mspretrain.data.shards import ShardWriter
from mspretrain.data.tokenizer import Tokenizer
from mspretrain.paths import SPLITS
from mspretrain.prepare.publish import build_manifest
from mspretrain.prepare.resume import point
from mspretrain.prepare.stage import PIECES, REPLAY_PIECES, Run, Stage


class Finalize(Stage):
    name = "finalize"

    def run(self, r: Run, then: str | None) -> None:
        j, work = r.journal, r.work
        for child in r.removing:
            child.wait()
        r.spool_path.unlink(missing_ok=True)  # (a kill just after the replay's commit left them)
        for name in (PIECES, PIECES + ".trash", REPLAY_PIECES, "dedup.tmp", "dedup.tmp.trash"):
            shutil.rmtree(work / name, ignore_errors=True)
        saved = r.load_state("finalize")
        sink, tok_info = saved["sink"], saved["tok_info"]
        tok = r.tok if r.given is not None else Tokenizer.load(work / j.data["tokenizer_file"])
        for s in SPLITS:
            ShardWriter.finish_resumed(work / s, r.dtype, j.data["writers"][s], fsync=False)  # prepare fsyncs every file at once
            if "origin_records" in j.data:  # the replay's move left the moved record's bytes (`OriginWriter.peek_last`)
                cut_to(work / origin_name(s), j.data["origin_records"][s])
            point(f"finalized {s}")
        manifest = build_manifest(work, r.cfg, r.stats, sink, tok, tok_info, r.dtype)
        # the largest id per shard, counted while writing: `train` checks it against the vocabulary
        # instead of reading every shard (data/manifest.py, check_data_dir)
        manifest["max_token_id"] = {s: j.data["writers"][s]["max_token"] for s in SPLITS}
        r.manifest = manifest
