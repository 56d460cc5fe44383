"""What every config section checks (finite numbers, 64-bit integers, `Literal` choices), and the
helpers the sections' own rules use: one `UserError` line naming the key and the fix."""
from __future__ import annotations

import functools
import math
from dataclasses import fields
from typing import Any, Literal, get_args, get_origin, get_type_hints

from mspretrain.errors import UserError

INT_LIMIT = 2**63  # integer keys must fit an int64 (see Section.__post_init__)
SEED_LIMIT = 2**32  # numpy's legacy seeding and MindSpore's set_seed take seeds in [0, 2**32)


def fail(key: str, problem: str, fix: str) -> None:
    raise UserError(f"{key} {problem}", fix)


def cap(section: Any, caps: dict[str, float], why: str) -> None:
    """Refuse values above a sane ceiling: a key that drives an allocation (n_layers=1e8 asks
    `plan` for terabytes of tables) or an update size (lr=1e308 trains to inf in one step) is a
    typo, not a setting; the ceilings sit far above any real model (a 1T-parameter Llama stays
    inside every one)."""
    for name, cap in caps.items():
        v = getattr(section, name)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v > cap:
            key = f"{section.SECTION}.{name}"
            fail(key, f"= {v:g} is above the limit of {cap:g} ({why})", f"check {key} for a typo (see docs/config-reference.md)")


def check_seed(section: Any, name: str) -> None:
    """A seed is a non-negative integer below 2**32 (numpy.random.seed and MindSpore's set_seed
    raise on anything else, after the run dir is made)."""
    v = getattr(section, name)
    if not 0 <= v < SEED_LIMIT:
        key = f"{section.SECTION}.{name}"
        fail(key, f"= {v} is not a seed between 0 and {SEED_LIMIT - 1}", f"give {key} a non-negative integer, e.g. {key}=1234")


def floor(section: Any, floors: dict[str, float], why: str) -> None:
    """Refuse positive values below what float32 keeps: norm_eps=1e-300 passes `> 0` and is 0.0 on
    the device (a division by zero waiting for an all-zero row)."""
    for name, floor in floors.items():
        v = getattr(section, name)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < floor:
            key = f"{section.SECTION}.{name}"
            fail(key, f"= {v:g} is below the floor of {floor:g} ({why})", f"check {key} for a typo (see docs/config-reference.md)")


@functools.lru_cache(maxsize=None)
def hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


def choices(cls: type, name: str) -> tuple[Any, ...]:
    """The allowed values of a `Literal` field (or of the items of a tuple of them); () if free."""
    typ = hints(cls)[name]
    if get_origin(typ) is tuple:
        typ = get_args(typ)[0]
    return get_args(typ) if get_origin(typ) is Literal else ()


class Section:
    """What every section checks, then the section's own rules (`check`).

    The finite-number check loops over the schema, so a new float key cannot skip it: NaN passes
    `x < 0`-style range checks (every comparison with NaN is False), and a NaN weight decay
    writes NaN weights into checkpoints that verify.
    """

    SECTION = ""  # the TOML section name, for the keys in error messages

    def __post_init__(self) -> None:
        for f in fields(self):
            key, value = f"{self.SECTION}.{f.name}", getattr(self, f.name)
            items = value if isinstance(value, tuple) else (value,)
            for v in items:
                if isinstance(v, float) and not math.isfinite(v):
                    fail(key, f"= {v} is not a finite number", f"give {key} a finite value (see docs/config-reference.md)")
                # TOML and Python ints are unbounded; every integer key ends in a numpy or
                # MindSpore int64 (a step counter, a seed, a shape), where 1e20 overflows with a
                # traceback deep in a run (or runs "forever"). No key has a use for such a value.
                if isinstance(v, int) and not isinstance(v, bool) and not -INT_LIMIT < v < INT_LIMIT:
                    fail(key, f"= {v} does not fit in 64 bits", f"check {key} for a typo (see docs/config-reference.md)")
            allowed = choices(type(self), f.name)
            for v in items if allowed else ():
                if v not in allowed:
                    fail(key, f"= {v!r} is not one of {', '.join(allowed)}", f"set {key} to one of: {', '.join(allowed)}")
        self.check()

    def check(self) -> None:
        """The section's own rules: its keys alone and how they combine within the section."""
