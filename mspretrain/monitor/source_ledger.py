"""Per-source ledger: training loss and tokens consumed per data source, against the mixing weights.

With several `data.sources`, a run's loss is a mix; this says which source it comes from and
whether each source got its share. Every `every` steps it adds to the step's metrics, for each
source j (its index in `data.sources`, named in `run_meta.json` `sources`):
- `source{j}/tokens`: tokens of source j trained on so far (samples x seq_len, all ranks);
- `source{j}/share`: its share of the samples so far, to compare with its weight;
- `source{j}/loss`: mean token NLL of source j's samples since the last record.

Design choices:
- The tokens and shares are exact: the global sample order is a pure function of the loader
  position (`data/order.py`), so the source of every sample of every rank is known on rank 0.
- The loss is rank 0's rows only (`_row_nll`, the per-sample NLL sums the step returns with
  the loss): exact on one process, on N ranks an estimate from 1/N of the batch. Gathering
  every rank's rows would add a collective to every step for a logged number; the stride
  schedule gives every rank a proportional slice of every source, so the estimate is unbiased.
"""
from __future__ import annotations

import numpy as np

from mspretrain.budget import position_of_row, step_samples
from mspretrain.data.order import SamplePlan
from mspretrain.monitor.callback import Callback, DataState, Values


class SourceLedger(Callback):
    """A train loop callback adding its keys in `post_step` (rank 0's metrics; a no-op with one source)."""

    def __init__(self, plan: SamplePlan, *, world: int, rank: int, micro: int, accum: int, seq_len: int,
                 every: int) -> None:
        self.plan, self.seq_len, self.every = plan, seq_len, max(1, every)
        self.global_batch = step_samples(micro, accum, world)
        # this rank's rows of a global batch, in the order the step returns them (budget.py)
        self.rows = np.array([position_of_row(k, rank=rank, micro=micro, world=world) for k in range(micro * accum)])
        n = len(plan.windows)
        self.loss_sum, self.count = np.zeros(n), np.zeros(n)

    def post_step(self, step: int, data_state: DataState, values: Values) -> None:
        if len(self.plan.windows) < 2:
            return
        pos = [int(s["consumed"]) for s in data_state["sources"]]
        src = self.plan.batch(pos, self.global_batch)[self.rows, 0]
        rows = values.get("_row_nll")
        if rows is not None and len(rows) == len(src):
            np.add.at(self.loss_sum, src, np.asarray(rows, dtype=np.float64) / self.seq_len)
            np.add.at(self.count, src, 1)
        if step % self.every:
            return
        after = self.plan.advance(pos, self.global_batch)
        total = max(1, sum(after))
        for j, consumed in enumerate(after):
            values[f"source{j}/tokens"] = float(consumed * self.seq_len)
            values[f"source{j}/share"] = consumed / total
            if self.count[j]:
                values[f"source{j}/loss"] = self.loss_sum[j] / self.count[j]
        self.loss_sum[:] = 0
        self.count[:] = 0
