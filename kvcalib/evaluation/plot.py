"""A picture of an eval: per layer, K/V absmax against each configuration's clip level, SQNR,
and the fraction of K/V that saturated; of the needle probe, keys found by depth and
length. matplotlib is an optional extra (`kvcalib[plot]`)."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvcalib.core.errors import UsageError
from kvcalib.core.paths import overlapping

__all__ = ["check_plot_path", "plot_eval", "plot_needle"]


def check_plot_path(path: Path, inputs: Sequence[str | Path] = ()) -> Path:
    """Refuse a --plot path that is no .png, has no directory, or lies in (or is) an input; before any work."""
    path = Path(path)
    if path.suffix.lower() != ".png":
        raise UsageError(
            f"--plot writes a PNG; {path} does not end in .png", hint="pass a path ending in .png"
        )
    if not path.parent.is_dir():
        raise UsageError(
            f"--plot: directory {path.parent} does not exist",
            hint="create it, or pick another path",
        )
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise UsageError(
            f"--plot: cannot write in {path.parent} (permission denied or read-only)",
            hint="pick a path in a directory you can write to",
        )
    for item in inputs:
        if os.path.lexists(item) and overlapping(path, Path(item)):
            raise UsageError(
                f"--plot {path} would write into the input {item}",
                hint="kvcalib never writes over its inputs; put the plot elsewhere",
            )
    return path


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("--plot needs matplotlib", hint="pip install 'kvcalib[plot]'") from None
    return plt


def plot_needle(result: Any, path: Path) -> Path:
    """Write the needle heatmaps (a NeedleResult), one per scale set: keys found by depth x length, atomically."""
    plt = _pyplot()  # the path: check_plot_path, before the work
    names = list(dict.fromkeys(row.name for row in result.rows))
    lengths = list(dict.fromkeys(row.length for row in result.rows))
    fig, axes = plt.subplots(
        1, len(names), figsize=(2.2 + 1.1 * len(lengths) * len(names), 4.2), squeeze=False
    )
    for ax, name in zip(axes[0], names):
        by_length = {row.length: row.by_depth for row in result.rows if row.name == name}
        counts = [[by_length[n][i][1:] for n in lengths] for i in range(len(result.depths))]
        grid = [[hit / max(n, 1) for hit, n in row] for row in counts]
        image = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
        for i, row in enumerate(counts):
            for j, (hit, n) in enumerate(row):
                ax.text(j, i, f"{hit}/{n}", ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(lengths)), [f"{length:,}" for length in lengths])
        ax.set_yticks(range(len(result.depths)), [f"{d:.0%}" for d in result.depths])
        ax.set_xlabel("context length (tokens)")
        ax.set_title(_label(name), fontsize=9)
    axes[0][0].set_ylabel("needle depth")
    fig.colorbar(image, ax=axes[0].tolist(), label="keys found")
    fig.suptitle(
        f"needle retrieval, FP8 KV on {result.target} (prefill: {result.prefill})", fontsize=10
    )
    return _save(fig, plt, path)


def plot_eval(result: Any, path: Path) -> Path:
    """Write a PNG for an `EvalResult` to `path` (atomically) and return the path: per layer and kind (K, V; Q with
    FP8 attention) the absmax against where each run saturates, the SQNR and the fraction clipped; each run's ΔNLL,
    KL and top-1 agreement in the title."""
    plt = _pyplot()  # the path: check_plot_path, before the work
    from matplotlib.ticker import MaxNLocator

    runs, layers = result.runs, [s.layer for s in result.runs[0].layers]
    kinds = "kvq" if any(r.layers[0].q is not None for r in runs) else "kv"
    fig, axes = plt.subplots(3, len(kinds), figsize=(6 * len(kinds), 11), squeeze=False)
    for col, kind in enumerate(kinds):
        upper = kind.upper()
        panels = {
            "clip_at": ": absmax vs where each run saturates",
            "sqnr_db": " SQNR (dB)",
            "clipped": " fraction clipped",
        }
        for row, (attr, title) in enumerate(panels.items()):
            ax = axes[row][col]
            for run in runs:
                stats = [getattr(s, kind) for s in run.layers]
                if stats[0] is not None and getattr(stats[0], attr) is not None:
                    points = [
                        v if math.isfinite(v := getattr(x, attr)) else math.nan for x in stats
                    ]
                    ax.plot(
                        layers, points, "--" if row == 0 else "o-", ms=3, label=_label(run.name)
                    )
            if row == 0 and ax.lines:
                absmax = [getattr(s, kind).absmax for s in runs[0].layers]
                ax.plot(layers, absmax, "k-", lw=2, label=f"{upper} absmax")
                ax.set_yscale("log")
            ax.set_title(upper + (title if ax.lines else ": not measured"), fontsize=9)
            ax.set_xlabel("layer")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            if ax.lines:
                ax.legend(fontsize=7)
    summary = (
        f"{_label(r.name)}: ΔNLL {r.delta_nll:+.4f}, KL {r.kl:.4f}, top-1 {r.top1:.1%}"
        for r in runs
    )
    fig.suptitle(
        f"{result.checkpoint} on {result.target} (FP8 max {result.fp8_max:g}), {result.num_tokens:,} tokens\n"
        + "; ".join(summary),
        fontsize=9,
    )
    fig.tight_layout()
    return _save(fig, plt, path)


def _save(fig: Any, plt: Any, path: Path) -> Path:
    """`fig` as a PNG at `path`, written beside it and renamed (never half a file), then closed."""
    partial = path.with_name(f".{path.name}.partial.png")
    try:
        fig.savefig(partial, dpi=90)
        os.replace(partial, path)
    except OSError as exc:
        raise UsageError(
            f"--plot: cannot write {path}: {exc.strerror or exc}",
            hint="pick a path in a directory you can write to, on a filesystem with room",
        ) from None
    finally:
        plt.close(fig)
        partial.unlink(missing_ok=True)
    return path


def _label(name: str) -> str:
    return name if len(name) <= 28 else "…" + name[-27:]
