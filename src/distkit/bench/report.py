"""What a benchmark leaves behind: a CSV, PNG plots and a plain-language recommendation.

matplotlib is imported inside the plotting functions (``pip install distkit[plot]``), and only its
object-oriented API is used, so plotting never changes the caller's pyplot state or backend.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from distkit._fs import atomic_open
from distkit.bench.profile import ScalingProfile, _pays
from distkit.bench.runner import BenchRow

__all__ = ["plot_profiles", "plot_rows", "recommend", "write_csv"]

# Small figures: the docs embed them, and each PNG stays well under 200 KB.
_FIGSIZE = (6.4, 4.2)
_DPI = 100
# Efficiency from which scaling counts as near-linear.
_GOOD = 0.8


def write_csv(rows: Sequence[dict[str, Any]], path: str | Path, columns: Sequence[str]) -> Path:
    """Write ``rows`` (dictionaries) to ``path`` atomically, with ``columns`` as the header."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=list(columns), extrasaction="ignore")
    writer.writeheader()
    for item in rows:
        writer.writerow({k: _cell(v) for k, v in item.items()})
    with atomic_open(path, mode=0o644) as handle:
        handle.write(text.getvalue().encode())
    return path


def _cell(value: Any) -> Any:
    if isinstance(value, float):
        return "" if math.isnan(value) else f"{value:.6g}"
    return value


def _figure() -> tuple[Any, Any]:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError("plots need matplotlib: pip install 'distkit[plot]'.") from err
    figure = Figure(figsize=_FIGSIZE, dpi=_DPI, layout="constrained")
    FigureCanvasAgg(figure)
    return figure, figure.add_subplot()


def _series(rows: Sequence[BenchRow]) -> dict[tuple[str, int], list[BenchRow]]:
    lines: dict[tuple[str, int], list[BenchRow]] = {}
    for row in rows:
        if row.status == "ok":
            lines.setdefault((row.strategy, row.batch_size), []).append(row)
    return {key: sorted(value, key=lambda r: r.world_size) for key, value in sorted(lines.items())}


def _title(rows: Sequence[BenchRow]) -> str:
    first = rows[0]
    where = "CPU processes, gloo" if first.device == "cpu" else "GPUs"
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


def plot_rows(rows: Sequence[BenchRow], out_dir: str | Path) -> list[Path]:
    """Plot throughput, scaling efficiency (against the ideal) and memory; return the PNG paths.

    Writes ``throughput.png``, ``scaling_efficiency.png`` and ``memory.png`` into ``out_dir``;
    nothing when no configuration was measured.

    Raises:
        ImportError: matplotlib is not installed.
    """
    out = Path(out_dir)
    lines = _series(rows)
    if not lines:
        return []
    styles = _styles(lines)
    sizes = sorted({r.world_size for r in rows if r.status == "ok"})
    paths = []

    figure, ax = _figure()
    for key, series in lines.items():
        ax.plot([r.world_size for r in series], [r.samples_per_s for r in series], **styles[key])
        if key[0] == "single" and len(sizes) > 1:
            base = series[0].samples_per_s
            ax.plot(
                sizes,
                [base * n for n in sizes],
                color=styles[key]["color"],
                linestyle="--",
                linewidth=1,
                alpha=0.6,
                label=f"ideal, batch {key[1]}",
            )
    ax.set(xlabel="processes / devices", ylabel="samples / s", title=f"Throughput: {_title(rows)}")
    ax.set_xticks(sizes)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    paths.append(_save(figure, out / "throughput.png"))

    figure = _figure()[0]
    figure.clear()
    speed_ax, eff_ax = figure.subplots(1, 2)
    top = max(sizes)
    speed_ax.plot([1, top], [1, top], "k--", linewidth=1, label="ideal")
    eff_ax.axhline(100, color="k", linestyle="--", linewidth=1, label="ideal")
    for key, series in lines.items():
        scaled = [r for r in series if not math.isnan(r.speedup)]
        if key[0] == "single" or not scaled:
            continue
        speed_ax.plot([r.world_size for r in scaled], [r.speedup for r in scaled], **styles[key])
        eff_ax.plot([r.world_size for r in scaled], [100 * r.efficiency for r in scaled], **styles[key])
    speed_ax.set(xlabel="processes / devices", ylabel="speedup over single", title="Speedup")
    eff_ax.set(xlabel="processes / devices", ylabel="efficiency (%)", title="Scaling efficiency")
    for ax in (speed_ax, eff_ax):
        ax.set_xticks(sizes)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    speed_ax.legend(fontsize="small")
    figure.suptitle(_title(rows), fontsize="medium")
    paths.append(_save(figure, out / "scaling_efficiency.png"))

    figure, ax = _figure()
    for key, series in lines.items():
        ax.plot([r.world_size for r in series], [r.memory_mib for r in series], **styles[key])
    kind = rows[0].memory_kind or ("cpu_rss" if rows[0].device == "cpu" else "cuda_peak_allocated")
    ylabel = (
        "peak allocated per GPU (MiB)"
        if kind == "cuda_peak_allocated"
        else "resident memory per process (MiB)"
    )
    ax.set(xlabel="processes / devices", ylabel=ylabel, title=f"Memory: {_title(rows)}")
    ax.set_xticks(sizes)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    paths.append(_save(figure, out / "memory.png"))
    return paths


def plot_profiles(profiles: Sequence[ScalingProfile], path: str | Path, *, title: str = "") -> Path:
    """Plot predicted speedup against world size, one line per profile (batch size), with the ideal.

    Raises:
        ImportError: matplotlib is not installed.
    """
    figure, ax = _figure()
    sizes = sorted({p.world_size for profile in profiles for p in profile.predictions})
    ax.plot([sizes[0], sizes[-1]], [sizes[0], sizes[-1]], "k--", linewidth=1, label="ideal")
    for profile in profiles:
        preds = profile.predictions
        ax.plot(
            [p.world_size for p in preds],
            [p.speedup for p in preds],
            marker="o",
            label=f"batch {profile.batch_size}: ratio {profile.ratio:.1f}",
        )
    ax.set(xlabel="ranks", ylabel="predicted speedup", title=title or "Predicted data-parallel speedup")
    ax.set_xticks(sizes)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return _save(figure, Path(path))


def _save(figure: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_open(path, mode=0o644) as handle:
        figure.savefig(handle, format="png")
    return path


def _fmt_rate(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def recommend(rows: Sequence[BenchRow]) -> str:
    """A plain-language reading of benchmark rows: what is fastest, and whether scaling pays.

    Added processes (or GPUs) count as worth it when each brings at least half of one's speed
    (``speedup - 1 >= (N - 1) / 2``); near-linear scaling is 80 % efficiency or more.
    """
    ok = [r for r in rows if r.status == "ok"]
    lines = []
    if not ok:
        lines.append("Nothing was measured: every configuration was skipped.")
    else:
        best = max(ok, key=lambda r: r.samples_per_s)
        lines.append(f"Fastest: {_where(best)}: {_fmt_rate(best.samples_per_s)} samples/s{_gain(best)}.")
        scaled = [r for r in ok if r.strategy != "single" and r.world_size > 1 and not math.isnan(r.speedup)]
        for strategy in ("ddp", "dp"):
            mine = [r for r in scaled if r.strategy == strategy]
            if not mine:
                continue
            top = max(r.world_size for r in mine)
            by_batch = sorted((r for r in mine if r.world_size == top), key=lambda r: r.batch_size)
            effs = ", ".join(
                f"{r.speedup:.2f}x ({r.efficiency:.0%}) at batch {r.batch_size}" for r in by_batch
            )
            if min(r.efficiency for r in by_batch) >= _GOOD:
                verdict = "scales well"
            elif any(_pays(r.speedup, r.world_size) for r in by_batch):
                verdict = "pays at some batch sizes"
            elif max(r.speedup for r in by_batch) > 1:
                verdict = "pays poorly: each added process brings less than half of its speed"
            else:
                verdict = "is slower than one process: communication outweighs compute"
            lines.append(f"{strategy} on {top}: {verdict}; {effs}.")
            if len(by_batch) > 1 and by_batch[-1].efficiency > by_batch[0].efficiency:
                lines.append(
                    "Larger batches per process scale better: the all-reduce per step stays the same "
                    "while compute grows."
                )
        if any(r.efficiency < _GOOD for r in scaled):
            lines.append(
                "To scale better: raise the batch per process, or accumulate gradients over several "
                "steps with DDP's no_sync() so the all-reduce runs once per several batches; "
                "`distkit bench --profile` shows the compute/communication ratio behind these numbers."
            )
        worth = [r for r in scaled if _pays(r.speedup, r.world_size)]
        singles = [r for r in ok if r.strategy == "single"]
        if worth:
            pick = max(worth, key=lambda r: r.samples_per_s)
            lines.append(f"Recommendation: {_where(pick)}{_gain(pick)}.")
        elif singles:
            pick = max(singles, key=lambda r: r.samples_per_s)
            lines.append(
                f"Recommendation: one process at batch {pick.batch_size}; more processes add less than half "
                f"of a process each, or slow training down."
            )
    for row in rows:
        if row.status == "skipped":
            lines.append(f"{row.strategy}: skipped, {row.note}.")
    first = rows[0] if rows else None
    if first is not None and first.device == "cpu":
        lines.append(
            f"Measured with CPU processes over gloo, {first.threads_per_rank} torch thread(s) each; "
            f"on GPUs compute is faster and NCCL overlaps communication, so run distkit bench there too."
        )
    # Skipped configurations repeat per world size and batch size; keep the first line of each.
    return "\n".join(dict.fromkeys(lines))


def _where(row: BenchRow) -> str:
    if row.strategy == "single":
        return f"single, one process at batch {row.batch_size}"
    unit = "GPUs" if row.strategy == "dp" else "processes"
    return f"{row.strategy} on {row.world_size} {unit} at batch {row.batch_size}"


def _gain(row: BenchRow) -> str:
    if row.strategy == "single" or math.isnan(row.speedup):
        return ""
    return f" ({row.speedup:.2f}x one process, {row.efficiency:.0%} efficiency)"
