"""The one way to add per-step work to the train loop: a `Callback` with named hooks.

In the manner of OLMo-core's trainer callbacks (`olmo_core/train/callbacks/callback.py`): the
loop (`train/trainer.py`) calls each hook of every callback, in the order the callbacks were
given, at one place each; every hook is a no-op here, so an observer overrides only the ones it
needs. The console line, the metrics logger, the step meter, the profiler, the heartbeat, the
periodic eval, the batch log, the source ledger and the spike record are all callbacks; what the
loop drives and does not merely observe (the compiled step, the loader, the loss scaler, the lr
schedule, the checkpoints, the spike policy) are its parts (`train/parts.py`).

One step, in order (`step` is always the number of the step being run, from 1):
- `pre_load_batch(step)`: before its micro-batches are fetched;
- `pre_step(step)`: fetched, before the compiled step runs;
- `post_train_batch(step, values)`: the step ran and the loop's counters moved; may add
  measurements to `values` (the spike policy reads them next);
- `post_step(step, data_state, values)`: after the spike policy acted (a rewind has already moved
  the loop's counter back: `values["rewind"]` says to which step); may add keys to `values`.
  `data_state` is the loader's state *before* the step: the loader is a pure function of it, so it
  names the global batch's samples exactly;
- `log_metrics(step, values)`: the step's record is complete; keys starting with `_` (`_row_nll`:
  this rank's per-sample NLL sums) are for callbacks, never written;
- `pre_checkpoint(step)` / `post_checkpoint_saved(step, path)`: around a save (`path` None on a
  rank that writes no checkpoint directory).
Around the session: `pre_train(start)`, `post_train(step)` (the loop finished and its final
checkpoint is handed over), `on_error(step, exc)` (the loop ends on an exception), `retry()` (after
an OSError from a callback's hook, once the loop has checkpointed: write what is pending), and
`close()`, always last.

A hook that writes a run file raises OSError naming it when the disk is full: the loop then saves
a checkpoint, calls `retry()` and `log_metrics`, and stops in one line (`Trainer._stop_on_write_error`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

DataState = dict[str, Any]  # `Loader.state()`: per-source consumed counts, the seed, world, batch size, seq_len
Values = dict[str, Any]  # the step's metrics (loss, lr, grad_norm, ...) and `_` keys for callbacks only


class Callback:
    """Per-step work, observed: every hook does nothing unless overridden."""

    def pre_train(self, start: int) -> None:
        """The session starts after step `start` (0, or the step resumed from)."""

    def pre_load_batch(self, step: int) -> None:
        """Step `step` starts: its micro-batches are fetched next."""

    def pre_step(self, step: int) -> None:
        """The micro-batches of `step` are fetched: the compiled step runs next."""

    def post_train_batch(self, step: int, values: Values) -> None:
        """`step` ran; may add measurements to `values` (before the spike policy sees them)."""

    def post_step(self, step: int, data_state: DataState, values: Values) -> None:
        """The step's observers (see the module docstring); may add keys to `values`."""

    def log_metrics(self, step: int, values: Values) -> None:
        """The step's record is complete (every callback has added its keys)."""

    def pre_checkpoint(self, step: int) -> None:
        """The state after `step` is about to be saved."""

    def post_checkpoint_saved(self, step: int, path: Path | None) -> None:
        """The state after `step` was handed to the checkpoint writer (`path`: its directory)."""

    def post_train(self, step: int) -> None:
        """The loop ended normally after `step` (its final checkpoint handed over)."""

    def on_error(self, step: int, exc: BaseException) -> None:
        """The loop ends on `exc` after `step`."""

    def retry(self) -> None:
        """Write what a failed write left pending (the loop has made room and checkpointed)."""

    def close(self) -> None:
        """Always called last, also after an error: release files and threads."""
