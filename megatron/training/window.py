"""The steps since the last log line, read from the device only when the loop needs them.

A backend's StepResult may hold device tensors (the loss, and with the native optimizer's
on-device skip also "updated?" and the grad norm), so a step that does not log never waits for
the device. `settle()` reads every step not read yet in one device-to-host copy and fills the
history rows with python values; the loop settles before each log line, before a save, and
every --max-skipped-in-a-row steps (so a diverging run stops within twice that many steps).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from megatron.training.backend import StepResult


@dataclass
class Settled:
    """What one settle() read: the rows now filled, and how many of those steps were skipped
    on the device after the LR schedule had already stepped for them."""

    rows: list[dict]
    device_skips: int


@dataclass
class Window:
    iters: int = 0
    seconds: float = 0.0
    rows: list[dict] = field(default_factory=list)  # this log window's history rows
    pending: list[tuple[dict, StepResult]] = field(default_factory=list)  # not read yet
    other_names: set[str] = field(default_factory=set)

    def add(self, step: StepResult, seconds: float, row: dict) -> None:
        self.iters += 1
        self.seconds += seconds
        self.rows.append(row)
        self.pending.append((row, step))
        self.other_names |= set(step.get("other_losses", {}))

    def settle(self) -> Settled:
        """One host read for the pending steps: their rows get the loss, the other losses,
        updated? and the grad norm (None where the step had none) as python values."""
        steps = [st for _, st in self.pending]
        names = sorted({n for st in steps for n in st.get("other_losses", {})})
        columns = [
            [st["lm_loss"] for st in steps],
            [st["updated"] for st in steps],
            [math.nan if st["grad_norm"] is None else st["grad_norm"] for st in steps],
            *([st.get("other_losses", {}).get(n, math.nan) for st in steps] for n in names),
        ]
        flat = [v for col in columns for v in col]
        device = next((v.device for v in flat if isinstance(v, torch.Tensor)), "cpu")
        as_one = [torch.as_tensor(v, dtype=torch.float64, device=device).reshape(()) for v in flat]
        values = torch.stack(as_one).tolist() if flat else []  # the one device-to-host copy
        n, rows = len(steps), [row for row, _ in self.pending]
        device_skips = 0
        for i, (row, st) in enumerate(self.pending):
            loss, updated, norm = values[i], values[n + i], values[2 * n + i]
            row["lm_loss"], row["updated"] = loss, bool(updated)
            # a device norm is NaN where the host one is None (gradients or loss inf/NaN)
            row["grad_norm"] = None if st["grad_norm"] is None or math.isnan(norm) else norm
            device_skips += isinstance(st["updated"], torch.Tensor) and not updated
            for j, name in enumerate(names):
                row[name] = values[(3 + j) * n + i]
        self.pending = []
        return Settled(rows, device_skips)

    def summary(self) -> dict:
        """The log line's figures over the window's (settled) rows: the mean finite loss, the
        count of non-finite ones, skipped steps, the last grad norm and the other losses'
        means."""
        losses = [row["lm_loss"] for row in self.rows]
        finite = [v for v in losses if math.isfinite(v)]
        norms = [row["grad_norm"] for row in self.rows if row["grad_norm"] is not None]
        iters = max(self.iters, 1)
        return {
            "loss": sum(finite) / len(finite) if finite else math.nan,
            "nan": len(losses) - len(finite),
            "skipped": sum(not row["updated"] for row in self.rows),
            "grad_norm": norms[-1] if norms else None,
            "others": {
                name: sum(row.get(name, math.nan) for row in self.rows) / iters
                for name in sorted(self.other_names)
            },
        }
