"""The one writer and the one reader of a slice's stored name, `NAME@START:STOP`: elements
[START, STOP) of the flattened tensor NAME, stored 1-D. Optimizer-state slices (ZeRO-1/2 split
parameters, ZeRO-3), ZeRO-3's per-rank weight files and the EMA's per-rank files all use it, and
checkpoints re-cut across layouts by it (checkpoint/model_shards.py). A whole tensor keeps its
plain name, so a checkpoint without slices is written as it always was.
"""
from __future__ import annotations

import re

from mspretrain.errors import UserError

_RANGE_RE = re.compile(r"^([0-9]{1,19}):([0-9]{1,19})$")
_REREAD = "resume from another checkpoint (`mspretrain checkpoints RUN --verify` lists them)"


def shard_key(name: str, start: int, stop: int) -> str:
    """The stored name of elements [start, stop) of the flattened `name`, e.g.
    `exp_avg.lm_head.weight@0:68108288`."""
    return f"{name}@{start}:{stop}"


def parse_shard_key(key: str) -> tuple[str, tuple[int, int] | None]:
    """(name, [start, stop) or None for a whole tensor) of a stored key; a range that is not two
    whole numbers start <= stop is a one-line error (a hostile or damaged file)."""
    name, sep, rng = key.rpartition("@")
    if not sep:
        return key, None
    m = _RANGE_RE.match(rng)
    if not m or int(m.group(1)) > int(m.group(2)):
        raise UserError(f"the checkpoint's tensor {key[:120]!r} names no element range START:STOP of whole numbers", _REREAD)
    return name, (int(m.group(1)), int(m.group(2)))


def is_slice(key: str) -> bool:
    """Whether a stored key names a slice (the EMA stores slices 1-D, whole tensors in their shape)."""
    return parse_shard_key(key)[1] is not None
