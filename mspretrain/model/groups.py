"""Parameter groups for staged training (`train.trainable`): which of our parameter names belong
to "embeddings", "attention", "mlp", "norms" or "lm_head".

Each parameter's group is a column of the parameter table (model/params.py): a name is matched
to its row by its structure (`layers.{i}.` and the rest exactly), not by substrings that a future
name could match by accident; an unknown name is an error rather than a silent "frozen" or
"trained".

With tied embeddings `embed.weight` is also the lm_head: it belongs to both groups and is trained
when either is selected (freezing it would silently freeze the other group too).
"""
from __future__ import annotations

from typing import Sequence

from mspretrain.errors import UserError
from mspretrain.model.params import groups_of

GROUPS: tuple[str, ...] = ("embeddings", "attention", "mlp", "norms", "lm_head")
ALL = "all"


def param_groups(name: str, tied: bool = False) -> frozenset[str]:
    """The groups one of our parameter names belongs to (one, or two for a tied embedding): its
    row's `group` in the parameter table (model/params.py); an unknown name is a ValueError."""
    return groups_of(name, tied)


def check_trainable(trainable: Sequence[str]) -> None:
    """One line for a list that is empty, names an unknown group, or mixes "all" with groups."""
    fix = f'set train.trainable to ["all"] or a list of {", ".join(GROUPS)}'
    if isinstance(trainable, str):
        raise UserError(f"train.trainable = {trainable!r} is not a list", fix)
    if not trainable:
        raise UserError("train.trainable is empty: nothing would be trained", fix)
    for g in trainable:
        if g != ALL and g not in GROUPS:
            raise UserError(f"train.trainable names an unknown group {g!r}", fix)
    if ALL in trainable and len(set(trainable)) > 1:
        raise UserError(f"train.trainable = {list(trainable)} mixes \"all\" with groups", fix)


def trainable_mask(names: Sequence[str], trainable: Sequence[str] | None, tied: bool = False) -> list[bool]:
    """For each parameter name, whether it is trained. None or ["all"]: every parameter."""
    if trainable is None or list(trainable) == [ALL]:
        return [True] * len(names)
    check_trainable(trainable)
    chosen = set(trainable)
    mask = [bool(param_groups(n, tied) & chosen) for n in names]
    if not any(mask):
        raise UserError(f"train.trainable = {list(trainable)} selects no parameter of this model", f"choose among {', '.join(GROUPS)}")
    return mask
