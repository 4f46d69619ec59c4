"""The compared steps and their verdict: each quantity held to a multiple of the floor measured in the run.

``Trajectory`` holds what a comparison (``check.parity``'s for SFT, ``check.dpo_parity``'s for DPO) measured: per
step both sides' learning rate, loss and grad_norm with the step's floors (``StepRow``, ``step_floors``), and each
module's final s*B@A difference with the adapter floor; ``Tolerances`` fixes a bound instead of a floor.
"""

import dataclasses
import math
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np

from gemport.errors import GemportError

FLOOR_MULTIPLE = 10
"""How far beyond the floors measured in the run (``StepRow.loss_floor``, ``StepRow.grad_norm_floor``,
``Trajectory.adapter_floor``) the port may land: each floor is one draw of the noise between two correct runs
of the recipe, the port's distance another."""

LEAST_FLOOR = float(np.finfo(np.float32).eps)
"""The least relative floor: one float32 unit of the quantity. Two runs can log the same loss to the bit (a step
whose sums round alike), and a floor of 0 would call any port wrong; a float32 value is only known to a unit."""

LEAST_ADAPTER_TOLERANCE = 5e-4
"""The least default adapter bound: the fixed one held before the floor was measured. It was kept because on a
Gemma 3 1B miniature, padded, the pairs ended 1.1e-5 apart while the port ended 3.0e-4 from the GPU recipe; the
cause was the port's Adam bias corrections (optax's in float32, ~1e-5 off; ``gemport.optim.adam``), and with
them as torch computes them the port ends 2.6e-5 away, within the float64 floor (4.5e-5)."""


@dataclasses.dataclass(frozen=True)
class Tolerances:
    """Fixed relative tolerances, each chosen instead of the floor measured in the run: loss, grad_norm and
    learning rate per step; each module's final s*B@A (max-abs difference over the GPU delta's max-abs).

    loss, grad_norm: None (the default) for ``FLOOR_MULTIPLE`` times the step's floor (``StepRow.loss_floor``,
    ``StepRow.grad_norm_floor``: how far the GPU recipe's run logged them from its own run again, computing the
    same thing with other roundings: ``frame.Floor``), or a fixed bound (``gemport parity --rtol``). The floors are
    measured and printed either way unless every bound is fixed.
    learning_rate: the schedule is arithmetic on both sides (HF's in float64, the port's in float32): a few
    float32 units.
    adapter: None (the default) for ``FLOOR_MULTIPLE`` times the floor ``frame.compare`` measures in the run
    (``Trajectory.adapter_floor``), at least ``LEAST_ADAPTER_TOLERANCE``. Adam maps an element whose gradient is
    near its epsilon (1e-8) almost linearly to its update, so float32 noise of 1e-9 on such a gradient moves
    that element by a tenth of the learning rate: how far two correct float32 runs end apart depends on the
    recipe and the data, and no fixed bound holds for all.
    """

    loss: float | None = None
    grad_norm: float | None = None
    learning_rate: float = 1e-6
    adapter: float | None = None


class StepRow(NamedTuple):
    """One step on both sides: HF's logged learning rate, loss and grad_norm, and the port's; and the step's
    relative floors (None when not measured): how far the GPU recipe's own second run (``frame.Floor``)
    logged its loss and grad_norm from the first, at least ``LEAST_FLOOR``."""

    step: int
    learning_rate_gpu: float
    learning_rate_port: float
    loss_gpu: float
    loss_port: float
    grad_norm_gpu: float
    grad_norm_port: float
    loss_floor: float | None = None
    grad_norm_floor: float | None = None


def relative(a, b):
    """|a - b| / |a| (a: the GPU recipe's value), 0 where they are equal."""
    return abs(a - b) / max(abs(a), 1e-12) if a != b else 0.0


def summed(terms: int) -> float:
    """The relative float32 rounding of a sum of ``terms`` numbers of one sign, from the arithmetic: pairwise
    summation (XLA's and torch's reductions) rounds it by at most ``ceil(log2(terms))`` units, and two correct
    runs that sum in another order land up to that far apart with no error of either. At least one unit
    (``LEAST_FLOOR``)."""
    return max(1, math.ceil(math.log2(max(terms, 1)))) * LEAST_FLOOR


def step_floors(logs, again, names, absolute=(), least=None):
    """Per step, {name: floor}: the largest distance so far between two correct runs' logged values of ``name``
    (``logs``, ``again``: their log entries, step by step), relative and at least ``least[name]`` (default
    ``LEAST_FLOOR``); absolute for the names in ``absolute`` (a share, such as DPO's ``rewards/accuracies``,
    whose runs may agree exactly). The largest so far: two runs that happen to land close at one step say
    nothing of the next."""
    least = least or {}
    out, worst = [], {}
    for log, other in zip(logs, again):
        for k in names:
            a, b = float(log[k]), float(other[k])
            distance = abs(a - b) if k in absolute else max(relative(a, b), least.get(k, LEAST_FLOOR))
            worst[k] = max(worst.get(k, distance), distance)
        out.append(dict(worst))
    return out


@dataclasses.dataclass(frozen=True)
class Trajectory:
    """The compared steps, each HF module's final adapter difference, and the tolerances; ``ok`` and
    ``first_disagreement`` judge them (steps first, then the final adapters).

    floor_name: what the run's floors compare, e.g. ``"TRL float64 vs float32"``.
    adapter_floor: the largest final s*B@A difference (same measure as ``adapters``) within the pairs of
    correct runs ``frame.compare`` trains (the GPU recipe's two runs; for SFT in float32 also the port with and
    without ``parity.FLOOR_PADDING`` more padding columns); at least float32's epsilon. ``adapter_tolerance`` is
    ``FLOOR_MULTIPLE`` times it, and at least ``LEAST_ADAPTER_TOLERANCE``, unless ``tolerances.adapter`` fixes
    one.
    """

    rows: tuple
    tolerances: Tolerances
    adapters: Mapping = dataclasses.field(default_factory=dict)
    adapter_floor: float | None = None
    floor_name: str | None = None

    @property
    def adapter_tolerance(self):
        """The bound on each module's final s*B@A difference: ``tolerances.adapter``, or ``FLOOR_MULTIPLE`` x
        ``adapter_floor`` and at least ``LEAST_ADAPTER_TOLERANCE``."""
        if self.tolerances.adapter is not None:
            return self.tolerances.adapter
        if self.adapter_floor is None:
            raise GemportError("Trajectory: no adapter tolerance: set Tolerances(adapter=) or measure adapter_floor")
        return max(LEAST_ADAPTER_TOLERANCE, FLOOR_MULTIPLE * self.adapter_floor)

    def bound(self, row, name):
        """The relative bound on ``name`` (``"learning_rate"``, ``"loss"``, ``"grad_norm"``) at ``row``: the
        fixed tolerance if one is set, else ``FLOOR_MULTIPLE`` x the step's floor."""
        fixed = getattr(self.tolerances, name)
        if fixed is not None:
            return fixed
        floor = getattr(row, f"{name}_floor")
        if floor is None:
            raise GemportError(f"Trajectory: no {name} tolerance: set Tolerances({name}=) or measure the step floors")
        return FLOOR_MULTIPLE * floor

    def multiples(self, name):
        """Per step, the port's relative distance on ``name`` (``"loss"``, ``"grad_norm"``) in units of the
        step's floor (None where no floor was measured)."""
        return [None if getattr(r, f"{name}_floor") is None
                else relative(getattr(r, f"{name}_gpu"), getattr(r, f"{name}_port")) / getattr(r, f"{name}_floor")
                for r in self.rows]

    def disagreements(self):
        """Every (step, quantity, gpu, port, relative difference, bound) beyond its bound, in step order."""
        found = []
        for row in self.rows:
            for name in ("learning_rate", "loss", "grad_norm"):
                gpu, port = getattr(row, f"{name}_gpu"), getattr(row, f"{name}_port")
                rel, bound = relative(gpu, port), self.bound(row, name)
                if not rel <= bound:
                    found.append((row.step, name, gpu, port, rel, bound))
        for module, rel in self.adapters.items():
            if not rel <= self.adapter_tolerance:
                found.append(("final", f"adapter {module} s*B@A", None, None, rel, self.adapter_tolerance))
        return found

    @property
    def ok(self):
        return not self.disagreements()

    def first_disagreement(self):
        """A sentence naming the first step and quantity that disagree, or None."""
        found = self.disagreements()
        if not found:
            return None
        step, name, gpu, port, rel, bound = found[0]
        if step == "final":
            return f"after the last step: {name} differs by {rel:.2e} (relative) > {bound:.2g}"
        row = next(r for r in self.rows if r.step == step)
        floor = getattr(row, f"{name}_floor", None)
        by = (f" = {rel / floor:.3g} x the floor {floor:.2g}" if floor is not None and getattr(self.tolerances, name)
              is None else "")
        return (f"step {step}: {name} {port:.6g} (port) vs {gpu:.6g} (GPU recipe), relative {rel:.2e}{by} > "
                f"{bound:.2g}")

    def table(self):
        """The per-step table: learning rate, loss and grad_norm on both sides, relative differences and their
        multiples of the step's floor; the final adapters; the verdict."""
        floors = all(r.loss_floor is not None for r in self.rows)
        lines = [f"{'step':>4} {'lr':>10} {'loss GPU':>11} {'loss port':>11} {'rel':>8} "
                 f"{'grad_norm GPU':>13} {'grad_norm port':>14} {'rel':>8}"
                 + (f" {'loss/floor':>10} {'gn/floor':>8}" if floors else "")]
        for r, lm, gm in zip(self.rows, self.multiples("loss"), self.multiples("grad_norm")):
            lines.append(f"{r.step:>4} {r.learning_rate_gpu:>10.3e} {r.loss_gpu:>11.6f} {r.loss_port:>11.6f} "
                         f"{relative(r.loss_gpu, r.loss_port):>8.1e} {r.grad_norm_gpu:>13.6f} "
                         f"{r.grad_norm_port:>14.6f} {relative(r.grad_norm_gpu, r.grad_norm_port):>8.1e}"
                         + (f" {lm:>10.2f} {gm:>8.2f}" if floors else ""))
        if self.adapters:
            worst = max(self.adapters, key=self.adapters.get)
            floor = "" if self.adapter_floor is None else (
                f" = {self.adapters[worst] / self.adapter_floor:.3g} x the floor {self.adapter_floor:.1e}")
            lines.append(f"final adapters: {len(self.adapters)} modules, largest s*B@A difference "
                         f"{self.adapters[worst]:.1e} ({worst}){floor}")
        if self.floor_name:
            lines.append(f"floor: {self.floor_name}, per step (at least {LEAST_FLOOR:.2g}, one float32 unit)")
        verdict = self.first_disagreement()
        lines.append("agree within " + ", ".join(self._bounds()) if verdict is None else f"DISAGREE at {verdict}")
        return "\n".join(lines)

    def _bounds(self):
        """What the verdict held each quantity to, as words."""
        out = []
        for name in ("loss", "grad_norm"):
            fixed = getattr(self.tolerances, name)
            if fixed is not None:
                out.append(f"{name} {fixed:.2g}")
            elif self.rows:
                worst = max(self.multiples(name))
                out.append(f"{name} {FLOOR_MULTIPLE:g} x the floor (at most {worst:.3g} x)")
        out.append(f"learning_rate {self.tolerances.learning_rate:.2g}")
        if self.adapters:
            if self.tolerances.adapter is not None or self.adapter_floor is None:
                out.append(f"adapter {self.adapter_tolerance:.2g}")
            else:
                out.append(f"adapter {FLOOR_MULTIPLE:g} x the floor, at least {LEAST_ADAPTER_TOLERANCE:.2g} "
                           f"(at most {max(self.adapters.values()) / self.adapter_floor:.3g} x)")
        return out

    def __str__(self):
        return self.table()


__all__ = ["FLOOR_MULTIPLE", "LEAST_ADAPTER_TOLERANCE", "LEAST_FLOOR", "StepRow", "Tolerances", "Trajectory", "relative",
           "step_floors"]
