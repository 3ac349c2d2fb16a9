"""A picture of an eval: per layer, K/V absmax against each configuration's clip level, SQNR,
and the fraction of K/V that saturated. matplotlib is an optional extra (`kvcalib[plot]`)."""

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
    plt, path = _pyplot(), check_plot_path(path)
    names = list(dict.fromkeys(row.name for row in result.rows))
    lengths = list(dict.fromkeys(row.length for row in result.rows))
    fig, axes = plt.subplots(
        1, len(names), figsize=(2.2 + 1.1 * len(lengths) * len(names), 4.2), squeeze=False
    )
    for ax, name in zip(axes[0], names):
        rows = {row.length: row for row in result.rows if row.name == name}
        grid = [
            [
                rows[length].by_depth[i][1] / max(rows[length].by_depth[i][2], 1)
                for length in lengths
            ]
            for i in range(len(result.depths))
        ]
        image = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
        for i in range(len(result.depths)):
            for j, length in enumerate(lengths):
                _, hit, n = rows[length].by_depth[i]
                ax.text(j, i, f"{hit}/{n}", ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(lengths)), [f"{length:,}" for length in lengths])
        ax.set_yticks(range(len(result.depths)), [f"{d:.0%}" for d in result.depths])
        ax.set_xlabel("context length (tokens)")
        if ax is axes[0][0]:
            ax.set_ylabel("needle depth")
        ax.set_title(_label(name), fontsize=9)
    fig.colorbar(image, ax=axes[0].tolist(), label="keys found")
    fig.suptitle(
        f"needle retrieval, FP8 KV on {result.target} (prefill: {result.prefill})", fontsize=10
    )
    return _save(fig, plt, path)


def plot_eval(result: Any, path: Path) -> Path:
    """Write a PNG for an `EvalResult` to `path` (atomically) and return the path."""
    plt, path = _pyplot(), check_plot_path(path)
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(4, 2, figsize=(12, 14))
    first = result.runs[0]
    layers = [s.layer for s in first.layers]
    for col, kind in enumerate(("k", "v")):
        ax = axes[0][col]
        ax.plot(
            layers,
            [getattr(s, kind).absmax for s in first.layers],
            "k-",
            lw=2,
            label=f"{kind.upper()} absmax",
        )
        for run in result.runs:
            ax.plot(
                layers,
                [getattr(s, kind).clip_at for s in run.layers],
                "--",
                label=f"clips above ({_label(run.name)})",
            )
        ax.set_yscale("log")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(
            f"{kind.upper()}: absmax on the eval text vs where each configuration saturates"
        )
        ax.legend(fontsize=7)
        metrics = (("sqnr_db", "SQNR (dB)"), ("clipped", "fraction clipped"))
        for row, (metric, title) in enumerate(metrics, start=1):
            ax = axes[row][col]
            for run in result.runs:
                ax.plot(
                    layers,
                    [_finite(getattr(getattr(s, kind), metric)) for s in run.layers],
                    "o-",
                    ms=3,
                    label=_label(run.name),
                )
            ax.set_title(f"{kind.upper()} {title}")
            ax.legend(fontsize=7)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    _query_and_summary(result, axes[3], layers)
    fig.suptitle(
        f"{result.checkpoint} on {result.target} (FP8 max {result.fp8_max:g}), {result.num_tokens:,} tokens: "
        + ", ".join(f"{_label(r.name)} ΔNLL {r.delta_nll:+.4f}" for r in result.runs),
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
        partial.unlink(missing_ok=True)
        raise UsageError(
            f"--plot: cannot write {path}: {exc.strerror or exc}",
            hint="pick a path in a directory you can write to, on a filesystem with room",
        ) from None
    finally:
        plt.close(fig)
        partial.unlink(missing_ok=True)
    return path


def _query_and_summary(result: Any, axes: Any, layers: list[int]) -> None:
    """Bottom row: Q SQNR per layer (FP8 attention runs) and ΔNLL, KL, top-1 of every run."""
    ax = axes[0]
    for run in result.runs:
        if run.layers and run.layers[0].q is not None:
            ax.plot(
                layers,
                [_finite(s.q.sqnr_db) for s in run.layers],
                "o-",
                ms=3,
                label=_label(run.name),
            )
    ax.set_title(
        "Q SQNR (dB), FP8 attention"
        if ax.lines
        else "Q: no FP8-attention run (eval --fp8-attention)"
    )
    ax.set_xlabel("layer")
    if ax.lines:
        ax.legend(fontsize=7)
    ax = axes[1]
    names = [_label(r.name) for r in result.runs]
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], [r.delta_nll for r in result.runs], width=0.4, label="ΔNLL")
    ax.bar([i + 0.2 for i in x], [r.kl for r in result.runs], width=0.4, label="KL")
    for i, r in enumerate(result.runs):
        ax.annotate(
            f"top-1 {r.top1:.1%}",
            (i, max(r.delta_nll, r.kl, 0)),
            ha="center",
            va="bottom",
            fontsize=7,
        )
    ax.set_xticks(list(x), [f"{n}\n{r.kind}" for n, r in zip(names, result.runs)], fontsize=7)
    ax.axhline(0, color="k", lw=0.5)
    ax.set_title("against the unquantised run: ΔNLL, KL (bars), top-1 agreement")
    ax.legend(fontsize=7)


def _finite(value: float) -> float:
    return value if math.isfinite(value) else float("nan")


def _label(name: str) -> str:
    return name if len(name) <= 28 else "…" + name[-27:]
