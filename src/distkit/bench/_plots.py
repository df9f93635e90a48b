"""The benchmark's and the advisor's PNG plots: intervals as error bars, the ideal, the unfair marked.

matplotlib is imported inside the plotting functions (``pip install distkit[plot]``), and only its
object-oriented API is used, so plotting never changes the caller's pyplot state or backend.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from distkit._utils.fs import atomic_open
from distkit.bench._load import trust_line
from distkit.bench.profile import ScalingProfile
from distkit.bench.runner import BenchRow

# Small figures: the docs embed them, and each PNG stays well under 200 KB.
_FIGSIZE = (6.4, 4.2)
_DPI = 100
_OVER_COLOR = "tab:red"


def _figure(figsize: tuple[float, float] = _FIGSIZE) -> Any:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError("plots need matplotlib: pip install 'distkit[plot]'.") from err
    figure = Figure(figsize=figsize, dpi=_DPI, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _stamp(figure: Any, trust: str) -> None:
    """Write what the numbers can be trusted for into the figure itself (a plot shown alone)."""
    if trust:
        low = "confidence: low" in trust
        figure.text(0.01, 0.005, trust, fontsize="x-small", color="firebrick" if low else "dimgray",
                    ha="left", va="bottom")  # fmt: skip


def _save(figure: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_open(path, mode=0o644) as handle:
        figure.savefig(handle, format="png")
    return path


def _series(rows: Sequence[BenchRow]) -> dict[tuple[str, int], list[BenchRow]]:
    lines: dict[tuple[str, int], list[BenchRow]] = {}
    for row in rows:
        if row.status == "ok":
            lines.setdefault((row.strategy, row.batch_size), []).append(row)
    return {key: sorted(value, key=lambda r: r.world_size) for key, value in sorted(lines.items())}


def _title(rows: Sequence[BenchRow]) -> str:
    first = rows[0]
    where = f"CPU processes x {first.threads_per_rank} thread(s), gloo" if first.device == "cpu" else "GPUs"
    return f"{first.model} ({first.params:,} params), {where}"


def _styles(lines: dict[tuple[str, int], list[BenchRow]]) -> dict[tuple[str, int], dict[str, Any]]:
    # One colour per batch size, one marker and line style per strategy, the same in every plot.
    batches = sorted({batch for _, batch in lines})
    palette = [f"C{i % 10}" for i in range(len(batches))]
    look = {"single": ("s", ""), "dp": ("^", ":"), "ddp": ("o", "-")}
    return {
        (strategy, batch): {
            "color": palette[batches.index(batch)],
            "marker": look[strategy][0],
            "linestyle": look[strategy][1],
            "label": f"{strategy}, batch {batch}",
        }
        for strategy, batch in lines
    }


def _yerr(values: list[float], lows: list[float], highs: list[float]) -> list[list[float]]:
    def gap(a: float, b: float) -> float:
        return 0.0 if math.isnan(a) or math.isnan(b) else max(0.0, a - b)

    return [
        [gap(v, lo) for v, lo in zip(values, lows, strict=True)],
        [gap(hi, v) for v, hi in zip(values, highs, strict=True)],
    ]


def _draw(
    ax: Any,
    series: list[BenchRow],
    style: dict[str, Any],
    value: Callable[[BenchRow], float],
    low: Callable[[BenchRow], float] | None = None,
    high: Callable[[BenchRow], float] | None = None,
) -> None:
    xs = [r.world_size for r in series]
    ys = [value(r) for r in series]
    if low is None or high is None:
        ax.plot(xs, ys, **style)
    else:
        yerr = _yerr(ys, [low(r) for r in series], [high(r) for r in series])
        ax.errorbar(xs, ys, yerr=yerr, capsize=3, elinewidth=1, **style)
    over = [(x, y) for r, x, y in zip(series, xs, ys, strict=True) if r.oversubscribed]
    if over:
        ax.scatter(
            [x for x, _ in over],
            [y for _, y in over],
            s=140,
            facecolors="none",
            edgecolors=_OVER_COLOR,
            linewidths=1.5,
            zorder=5,
        )
    for r, x, y in zip(series, xs, ys, strict=True):
        if r.flag:
            ax.annotate(">100%?", (x, y), textcoords="offset points", xytext=(4, 6), fontsize="x-small")


def _mark_oversubscribed(ax: Any, rows: Sequence[BenchRow], sizes: list[int]) -> None:
    """Shade the world sizes at which every configuration oversubscribes the machine; legend entry."""
    over = {r.world_size for r in rows if r.status == "ok" and r.oversubscribed and r.strategy != "single"}
    if not over:
        return
    fair = [n for n in sizes if n not in over]
    start = min(over)
    below = [n for n in fair if n < start]
    left = (max(below) + start) / 2 if below else start - 0.5
    ax.axvspan(left, max(sizes) + 0.5, color=_OVER_COLOR, alpha=0.07, linewidth=0)
    ax.scatter([], [], s=140, facecolors="none", edgecolors=_OVER_COLOR, linewidths=1.5,
               label="oversubscribed (not recommended)")  # fmt: skip


def _finish(
    ax: Any, sizes: list[int], *, legend: bool = True, loc: str = "best", xlabel: str = "processes / devices"
) -> None:
    ax.set_xlabel(xlabel)
    ax.set_xticks(sizes)
    ax.set_xlim(min(sizes) - 0.5, max(sizes) + 0.5)
    ax.set_ylim(0, ax.get_ylim()[1] * 1.15)  # headroom, so that no point hides under the legend
    ax.grid(alpha=0.3)
    if legend:
        ax.legend(fontsize="x-small", loc=loc)


def plot_rows(rows: Sequence[BenchRow], out_dir: str | Path, *, trust: str = "") -> list[Path]:
    """Plot throughput, scaling efficiency and memory; return the PNG paths.

    Writes ``throughput.png`` (samples/s with the repetitions' intervals as error bars and each
    batch's ideal, N times the one-process rate), ``scaling_efficiency.png`` (speedup and
    efficiency with error bars against the ideal) and ``memory.png`` into ``out_dir``; nothing
    when no configuration was measured. Oversubscribed points are circled in red on a shaded
    band; efficiencies above 100 % carry a question mark. ``trust`` (the report's confidence and
    the machine's load) is written into every figure, so that a plot shown alone says how far it
    can be trusted.

    Raises:
        ImportError: matplotlib is not installed.

    Example:
        >>> plot_rows(result.rows, "distkit-bench")  # doctest: +SKIP
        [PosixPath('distkit-bench/throughput.png'), ...]
    """
    out = Path(out_dir)
    lines = _series(rows)
    if not lines:
        return []
    styles = _styles(lines)
    sizes = sorted({r.world_size for r in rows if r.status == "ok"})
    paths = []

    figure = _figure()
    ax = figure.add_subplot()
    for key, series in lines.items():
        _draw(ax, series, styles[key], lambda r: r.samples_per_s, lambda r: r.samples_per_s_low,
              lambda r: r.samples_per_s_high)  # fmt: skip
        if key[0] == "single" and len(sizes) > 1:
            base = series[0].samples_per_s
            ax.plot(sizes, [base * n for n in sizes], color=styles[key]["color"], linestyle="--", linewidth=1,
                    alpha=0.6, label=f"ideal, batch {key[1]}")  # fmt: skip
    _mark_oversubscribed(ax, rows, sizes)
    ax.set(ylabel="samples / s (median, range of repetitions)", title=f"Throughput: {_title(rows)}")
    ax.title.set_fontsize("medium")
    _finish(ax, sizes)
    _stamp(figure, trust)
    paths.append(_save(figure, out / "throughput.png"))

    figure = _figure((9.6, 4.2))
    speed_ax, eff_ax = figure.subplots(1, 2)
    top = max(sizes)
    speed_ax.plot([1, top], [1, top], "k--", linewidth=1, label="ideal")
    eff_ax.axhline(100, color="k", linestyle="--", linewidth=1, label="ideal")
    for key, series in lines.items():
        scaled = [r for r in series if not math.isnan(r.speedup)]
        if key[0] == "single" or not scaled:
            continue
        _draw(
            speed_ax,
            scaled,
            styles[key],
            lambda r: r.speedup,
            lambda r: r.speedup_low,
            lambda r: r.speedup_high,
        )
        _draw(eff_ax, scaled, styles[key], lambda r: 100 * r.efficiency, lambda r: 100 * r.efficiency_low,
              lambda r: 100 * r.efficiency_high)  # fmt: skip
    for ax in (speed_ax, eff_ax):
        _mark_oversubscribed(ax, rows, sizes)
    speed_ax.set(ylabel="speedup over one process", title="Speedup")
    eff_ax.set(ylabel="efficiency (%)", title="Scaling efficiency")
    _finish(speed_ax, sizes)
    _finish(eff_ax, sizes, legend=False)
    figure.suptitle(f"{_title(rows)}; error bars: range of repetitions", fontsize="medium")
    _stamp(figure, trust)
    paths.append(_save(figure, out / "scaling_efficiency.png"))

    figure = _figure()
    ax = figure.add_subplot()
    for key, series in lines.items():
        _draw(ax, series, styles[key], lambda r: r.memory_mib)
    _mark_oversubscribed(ax, rows, sizes)
    kind = rows[0].memory_kind or ("cpu_rss" if rows[0].device == "cpu" else "cuda_peak_allocated")
    ylabel = (
        "peak allocated per GPU (MiB)"
        if kind == "cuda_peak_allocated"
        else "resident memory per process (MiB)"
    )
    ax.set(ylabel=ylabel, title=f"Memory: {_title(rows)}")
    ax.title.set_fontsize("medium")
    _finish(ax, sizes, loc="lower right")
    _stamp(figure, trust)
    paths.append(_save(figure, out / "memory.png"))
    return paths


def plot_profiles(profiles: Sequence[ScalingProfile], path: str | Path, *, title: str = "") -> Path:
    """Plot predicted speedup against world size, one line per profile (batch size), with the ideal.

    Error bars are the predictions' intervals (every measured part at its least and its most
    favourable end). The figure states its confidence: the machine's load while the profiles
    were measured (the highest of them).

    Raises:
        ImportError: matplotlib is not installed.

    Example:
        >>> plot_profiles([profile], "predicted_scaling.png")  # doctest: +SKIP
        PosixPath('predicted_scaling.png')
    """
    figure = _figure()
    ax = figure.add_subplot()
    sizes = sorted({p.world_size for profile in profiles for p in profile.predictions})
    ax.plot([sizes[0], sizes[-1]], [sizes[0], sizes[-1]], "k--", linewidth=1, label="ideal")
    for profile in profiles:
        preds = profile.predictions
        values = [p.speedup for p in preds]
        ax.errorbar(
            [p.world_size for p in preds],
            values,
            yerr=_yerr(values, [p.speedup_low for p in preds], [p.speedup_high for p in preds]),
            capsize=3,
            marker="o",
            label=f"batch {profile.batch_size}: ratio {profile.ratio:.1f}",
        )
    ax.set(xlabel="ranks", ylabel="predicted speedup (error bars: interval)",
           title=title or "Predicted data-parallel speedup")  # fmt: skip
    ax.title.set_fontsize("medium")
    ax.set_xticks(sizes)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    loads = [p.load for p in profiles if not math.isnan(p.load)]
    _stamp(figure, trust_line(max(loads) if loads else math.nan))
    return _save(figure, Path(path))
