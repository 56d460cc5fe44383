"""The parts the train loop drives, as Protocols: what `Trainer` calls on each and nothing more.

`train/build.py: build_trainer` wires the real ones (named after each Protocol); tests and
`replay` give their own (a scripted step, a loader that swaps samples, a schedule at recorded lrs).
What the loop only observes is a `monitor/callback.Callback` instead.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, Sequence

if TYPE_CHECKING:
    from mspretrain.data.loader import Batch


class StepOutcome(Protocol):
    """What one optimizer step returns (`step/step.StepResult`)."""
    loss: float
    grad_norm: float
    finite: bool  # False: overflow, the update was skipped
    row_nll: Any  # this rank's per-sample NLL sums (numpy), or None
    moe: dict[str, float] | None  # expert-load metrics of a MoE model


class CompiledStep(Protocol):
    """`step/step.TrainStep` / `step/tp.TPTrainStep`: forward, backward, reduction, update."""

    def run(self, micro: Sequence[tuple[Any, Any, Any]], lr: float, scale: float) -> StepOutcome: ...


class BatchSource(Protocol):
    """`data/loader.Loader` (or `forensics/drop_docs.DropDocsLoader`): this rank's micro-batches in order."""

    def next_batch(self) -> Batch: ...

    def state(self) -> dict[str, Any]: ...


class LossScale(Protocol):
    """`step/loss_scale.LossScaler`."""
    scale: float

    def update(self, finite: bool) -> None: ...

    def state(self) -> dict[str, Any]: ...

    def load_state(self, state: dict[str, Any]) -> None: ...


class LrSchedule(Protocol):
    """`schedule.Schedule`: the lr after `applied` optimizer updates."""
    kind: str
    warmup: int
    total: int

    def __call__(self, applied: int) -> float: ...


class Checkpoints(Protocol):
    """`train/checkpointing.CheckpointManager`: when to save, saving and loading the full state."""

    @property
    def stall_s(self) -> list[float]: ...

    def due(self, step: int, total: int) -> bool: ...

    def save(self, step: int, train_state: dict[str, Any]) -> Path | None: ...

    def load(self, ckpt: Path, *, restore_data: bool) -> dict[str, Any]: ...

    def after_update(self) -> None: ...

    def rewind_target(self) -> Path | None: ...

    def latest_name(self) -> str: ...

    def failed(self, exc: Any) -> None: ...

    def wait(self) -> None: ...

    def close(self) -> None: ...


class SpikeState(Protocol):
    """`monitor/spikes.SpikeDetector`: the rolling windows a checkpoint carries."""
    nonfinite_streak: int

    def state(self) -> dict[str, Any]: ...

    def load_state(self, state: dict[str, Any]) -> None: ...


class SpikeGuard(Protocol):
    """`train/spike_policy.SpikePolicy`: continue, rewind or stop after each step's loss."""
    detector: SpikeState
    loss_spikes: int

    def observe(self, step: int, loss: float, grad_norm: float, values: dict[str, Any]) -> str: ...
