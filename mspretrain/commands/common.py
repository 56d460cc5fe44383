"""Helpers shared by the command adapters."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable

from mspretrain.config import schema as cfgmod
from mspretrain.config.schema import Config


def add_config_argument(p: argparse.ArgumentParser, required: bool = False) -> None:
    p.add_argument("--config", metavar="FILE", required=required,
                   help="TOML config (see configs/); section.key=value overrides may follow the options")


def add_quiet_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quiet", action="store_true", help="no progress bars, fewer lines")
    p.add_argument("--verbose", action="store_true", help="bring MindSpore's native logs back")


def load_config(args: argparse.Namespace) -> Config:
    """The config file (if any) with the command line's section.key=value overrides applied."""
    return cfgmod.load(getattr(args, "config", None), getattr(args, "overrides", ()))


def progress_enabled(args: argparse.Namespace) -> bool:
    return not getattr(args, "quiet", False) and sys.stderr.isatty()


def say(args: argparse.Namespace, text: str) -> None:
    if not getattr(args, "quiet", False):
        print(text, flush=True)


def existing_path(path: str, what: str, fix: str) -> Path:
    """`path` as a Path when it is a directory (every caller takes a run or data dir); else one line
    saying what it is instead: `checkpoints FILE` printed "no checkpoints" and exited 0."""
    from mspretrain.errors import UserError
    from mspretrain.fsutil import why_not

    p = Path(path)
    if not p.is_dir():
        raise UserError(f"{what} {p} {why_not(p, 'a directory')}", fix)
    return p


def refuse_overrides(args: argparse.Namespace, command: str, instead: str) -> None:
    """Commands that read a finished run take no section.key=value overrides: refuse them in one
    line rather than ignore them (an ignored argument is a wrong answer)."""
    from mspretrain.errors import UserError

    overrides = list(getattr(args, "overrides", ()) or ())
    if overrides:
        raise UserError(f"`mspretrain {command}` takes no config overrides (got {' '.join(overrides)}): it uses the run's saved config",
                        instead)


def refuse_data_dir(path: str, command: str) -> None:
    """A data dir also has a manifest.json: name the mix-up instead of "checkpoint does not verify"."""
    from mspretrain.errors import UserError

    p = Path(path)
    if (p / "manifest.json").is_file() and (p / "train.idx").is_file():
        raise UserError(f"{p} is a data dir (the output of `mspretrain prepare`), not a run or checkpoint",
                        f"pass the --run dir of `mspretrain train`, e.g. mspretrain {command} RUN_DIR"
                        + (f" --data {p}" if command == "eval" else ""))


def bounded(kind: type, low: float, high: float, *, what: str = "") -> Callable[[str], Any]:
    """An argparse `type=` for a numeric flag: the value parses as `kind` (int or float) and lies in
    [low, high], or argparse refuses it in one `error:` line (exit 2) before the command runs.

    Python ints and floats are unbounded where the numbers land (numpy seeds, int64 step counters,
    a worker pool, a port), and NaN passes every `x < 0` check, so each numeric flag of every
    command states its range here once instead of each command checking a few."""
    import math

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except (TypeError, ValueError, OverflowError):
            name = "a whole number" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"{text!r} is not {name}") from None
        if isinstance(value, float) and not math.isfinite(value) or not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{text} is outside [{_bound(low)}, {_bound(high)}]{what and ' (' + what + ')'}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its own messages
    return parse


def _bound(v: float) -> str:
    """A flag's limit as a user reads it: 1048576 rather than 1.04858e+06."""
    return str(int(v)) if float(v).is_integer() and abs(v) < 1e15 else f"{v:g}"
