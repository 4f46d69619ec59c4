"""Pictures of a run where people would rather look than read, with the numbers they show.

``loss_curves``: the training and eval loss of a ``trainer_state.json`` (``gemport sft --plot``).
``write_parity``: a ``parity.Trajectory`` as ``parity.json`` (every figure of the comparison) and
``parity.png`` (the GPU recipe's and the port's loss and grad_norm per step, and their relative differences
against the bounds the verdict uses). The PNGs need matplotlib (``pip install 'gemport[plot]'``); files are
written atomically.
"""

from __future__ import annotations

import json
import os
import textwrap
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gemport._src.extras import require

_SIZE, _DPI = (7.0, 4.5), 80  # 560 x 360 pixels: a few tens of KB


def _figure(rows: int, cols: int, height: float = _SIZE[1]):
    require("matplotlib", "plotting")
    from matplotlib.figure import Figure  # no pyplot: no global state, no display backend

    from matplotlib.ticker import MaxNLocator  # optional: plot extra

    fig = Figure(figsize=(_SIZE[0], height), dpi=_DPI, layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax in axes.flat:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps
    return fig, axes


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fig.savefig(tmp, format="png")
    os.replace(tmp, path)
    return path


def _write_json(data: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def loss_curves(trainer_state: str | os.PathLike | Mapping[str, Any], out: str | os.PathLike) -> Path:
    """Plot ``loss`` and ``eval_loss`` of ``log_history`` against the step, as a PNG at ``out``.

    Args:
      trainer_state: a ``trainer_state.json`` path (HF's or ``gemport sft``'s) or its dict.
      out: the PNG path.

    Returns:
      ``out`` as a Path.

    Example: ``loss_curves("out/trainer_state.json", "out/loss.png")``
    """
    state = trainer_state if isinstance(trainer_state, Mapping) else json.loads(Path(trainer_state).read_text())
    history = state.get("log_history", [])
    fig, ((ax,),) = _figure(1, 1)
    for key, label, style in (("loss", "training loss", "-o"), ("eval_loss", "eval loss", "-s")):
        points = [(e["step"], e[key]) for e in history if key in e]
        if points:
            steps, values = zip(*points)
            ax.plot(steps, values, style, markersize=3, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"trainer_state.json: {state.get('global_step', 0)} of {state.get('max_steps', '?')} steps")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, Path(out))


def _relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), 1e-12) if a != b else 0.0


def parity_dict(trajectory: Any) -> dict[str, Any]:
    """Every figure of a ``parity.Trajectory``: per step the learning rate, loss and grad_norm of both sides,
    their relative differences, the step's measured floors and the bounds the verdict holds them to; the fixed
    tolerances (None where the floor judges); each module's final s*B@A difference, the measured floor and the
    bound; a DPO comparison's metrics per step (``check.dpo_parity.MetricRow`` with its bound); the verdict."""
    steps = []
    for r in trajectory.rows:
        row = dict(r._asdict())
        for name in ("learning_rate", "loss", "grad_norm"):
            row[f"{name}_relative"] = _relative(row[f"{name}_gpu"], row[f"{name}_port"])
            row[f"{name}_bound"] = trajectory.bound(r, name)
        steps.append(row)
    tolerances = {k: getattr(trajectory.tolerances, k) for k in ("loss", "grad_norm", "learning_rate", "adapter")}
    return {
        "ok": trajectory.ok,
        "first_disagreement": trajectory.first_disagreement(),
        "tolerances": tolerances,
        "steps": steps,
        "adapters": dict(trajectory.adapters),
        "adapter_floor": trajectory.adapter_floor,
        "floor_name": trajectory.floor_name,
        "adapter_tolerance": trajectory.adapter_tolerance if trajectory.adapters else None,
        # A DPO comparison's TRL metrics per step (gemport.check.dpo_parity.DPOTrajectory), each with its bound.
        "metrics": [dict(m._asdict(), bound=trajectory.metric_bound(m)) for m in getattr(trajectory, "metrics", ())],
    }


def parity_figure(trajectory: Any, out: str | os.PathLike) -> Path:
    """Plot a ``parity.Trajectory`` as a PNG at ``out``: loss and grad_norm per step of the GPU recipe and the
    port, and below their relative differences (log scale) with the bounds the verdict holds them to (a fixed
    tolerance, or a multiple of each step's measured floor).

    Returns:
      ``out`` as a Path.
    """
    data = parity_dict(trajectory)
    steps = [r["step"] for r in data["steps"]]
    fig, axes = _figure(2, 2, height=6.0)
    for col, name in enumerate(("loss", "grad_norm")):
        top, bottom = axes[0][col], axes[1][col]
        top.plot(steps, [r[f"{name}_gpu"] for r in data["steps"]], "-o", markersize=4, label="GPU recipe (TRL)")
        top.plot(steps, [r[f"{name}_port"] for r in data["steps"]], "--x", markersize=6, label="port (gemport)")
        top.set_title(name)
        top.grid(alpha=0.3)
        top.legend(fontsize="small")
        relative = [r[f"{name}_relative"] for r in data["steps"]]
        bottom.semilogy([s for s, v in zip(steps, relative) if v > 0], [v for v in relative if v > 0], "-o",
                        markersize=3, label="|port - GPU| / |GPU|")
        equal = [s for s, v in zip(steps, relative) if v == 0]
        if equal:  # no place on a log axis: marked at its bottom
            bottom.plot(equal, [min(r[f"{name}_bound"] for r in data["steps"]) * 1e-4] * len(equal), "v",
                        color="tab:green", label="equal (0)")
        bottom.step(steps, [r[f"{name}_bound"] for r in data["steps"]], where="mid", color="tab:red", linestyle=":",
                    label="tolerance" if data["tolerances"][name] is not None else "bound (x the floor)")
        bottom.set_xlabel("step")
        bottom.grid(alpha=0.3, which="both")
        bottom.legend(fontsize="small")
    axes[1][0].set_ylabel("relative difference")
    verdict = "agree" if data["ok"] else f"DISAGREE: {data['first_disagreement']}"
    if data["adapters"]:
        verdict += (f"; final adapters: largest s*B@A difference {max(data['adapters'].values()):.1e}, "
                    f"bound {data['adapter_tolerance']:.1e}")
    fig.suptitle(textwrap.fill(verdict, 100), fontsize="medium")
    return _save(fig, Path(out))


def write_parity(trajectory: Any, out_dir: str | os.PathLike) -> tuple[Path, Path | None]:
    """``out_dir/parity.json`` (``parity_dict``) and ``out_dir/parity.png`` (``parity_figure``; None when
    matplotlib is not installed). Returns the two paths."""
    out_dir = Path(out_dir)
    written = _write_json(parity_dict(trajectory), out_dir / "parity.json")
    try:
        require("matplotlib", "parity.png")
    except ImportError:
        return written, None
    return written, parity_figure(trajectory, out_dir / "parity.png")


__all__ = ["loss_curves", "parity_dict", "parity_figure", "write_parity"]
