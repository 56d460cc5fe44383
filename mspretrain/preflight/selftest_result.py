"""A selftest's result: each check's `Check` (its status, detail and numbers), the `Context` every
check reads, and the JSON document read back (`plan --from-selftest`).

Statuses: "passed" / "failed" (it ran here and its numbers are in the result); "needs Ascend"
(this machine cannot run it; never reported as passed); "skipped" (it could run but an earlier
result or an option made it pointless, said why).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from mspretrain.config.schema import Config
from mspretrain.errors import UserError
from mspretrain.fsutil import read_json

PASSED, FAILED, NEEDS_ASCEND, SKIPPED = "passed", "failed", "needs Ascend", "skipped"
STATUSES = (PASSED, FAILED, NEEDS_ASCEND, SKIPPED)


@dataclass
class Check:
    name: str
    status: str
    detail: str
    seconds: float = 0.0
    data: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        out = {"name": self.name, "status": self.status, "detail": self.detail, "seconds": round(self.seconds, 2)}
        out.update(self.data)
        return out


@dataclass
class Context:
    """What every check may read: the config, the resolved target, the run dir's scratch space."""
    cfg: Config
    target: str  # "cpu" | "ascend"
    work: Path
    quick: bool = False
    devices: int = 1
    vocab_note: str = ""
    results: dict[str, Any] = field(default_factory=dict)  # numbers later checks use



def timed(name: str, fn: Callable[[], Check]) -> Check:
    """`fn()` with its seconds; a check that raises is a failed check with the reason."""
    t0 = time.perf_counter()
    try:
        check = fn()
    except UserError as exc:
        check = Check(name, FAILED, f"{exc.cause} ({exc.fix})" if getattr(exc, "fix", None) else str(exc))
    except Exception as exc:  # a check that crashes is a failed check, with the reason, not a traceback
        check = Check(name, FAILED, f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}")
    check.seconds = time.perf_counter() - t0
    return check



def failed(doc: dict[str, Any]) -> bool:
    return any(c["status"] == FAILED for c in doc["checks"])


def format_table(doc: dict[str, Any]) -> str:
    width = max(len(c["name"]) for c in doc["checks"])
    lines = [f"{'check':<{width}}  {'status':<12}  {'time':>6}  detail"]
    for c in doc["checks"]:
        lines.append(f"{c['name']:<{width}}  {c['status']:<12}  {c['seconds']:>5.1f}s  {c['detail']}")
    n = {s: sum(c["status"] == s for c in doc["checks"]) for s in STATUSES}
    lines.append(f"{n[PASSED]} passed, {n[FAILED]} failed, {n[NEEDS_ASCEND]} need Ascend, {n[SKIPPED]} skipped "
                 f"in {doc['seconds']:.0f} s on {doc['target']}"
                 + ("" if doc["target"] == "ascend" else " — this is not a verdict on a 910B node"))
    return "\n".join(lines)


def read_selftest(path: str | Path) -> dict[str, Any]:
    """A selftest JSON as written by `mspretrain selftest --json`; one-line errors otherwise."""
    p = Path(path)
    if not p.is_file():
        from mspretrain.fsutil import why_not

        raise UserError(f"selftest file {p} {why_not(p)}", "write one with `mspretrain selftest --config CFG --out selftest.json`")
    doc = read_json(p, "pass the output of `mspretrain selftest --json`")
    if not isinstance(doc, dict) or not isinstance(doc.get("checks"), list):
        raise UserError(f"{p} is not a selftest result (no \"checks\" list)", "pass the output of `mspretrain selftest --json`")
    return doc


def measured_tokens_per_s(doc: dict[str, Any], cfg: Config, source: str = "the selftest") -> float:
    """tokens/s per device measured by the selftest's decoder-layer check, for the plan of `cfg`."""
    tps = doc.get("tokens_per_s_per_device")
    if not isinstance(tps, (int, float)) or tps <= 0:
        layer = next((c for c in doc["checks"] if c.get("name") == "decoder layer"), {})
        raise UserError(f"{source} has no measured tokens/s (decoder layer: {layer.get('status', 'missing')})",
                        "run `mspretrain selftest --json` with the same config on the target device")
    measured = doc.get("config") or {}
    m = cfg.model
    mine = {"dim": m.dim, "n_heads": m.n_heads, "seq_len": cfg.data.seq_len, "dtype": cfg.precision.dtype}
    differ = [f"{k} {measured.get(k)} vs {v}" for k, v in mine.items() if measured.get(k) is not None and measured.get(k) != v]
    if differ:
        raise UserError(f"{source} measured another shape ({', '.join(differ)})",
                        "run the selftest with the config you plan (same model, data.seq_len and precision.dtype)")
    return float(tps)
