"""The byte progress bar prepare's stages share (`stage_scan`, `stage_read`, `stage_encode`): tqdm on stderr, or None."""
from __future__ import annotations

import sys


def progress_bar(enabled: bool, total: int, desc: str):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
                dynamic_ncols=True, leave=False)
