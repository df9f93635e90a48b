"""How sure a benchmark is: intervals from repetitions, the A/A noise floor, and the decision rule.

Pure Python and pure functions, so the rule is tested on synthetic measurements: no torch, no
processes, no clock.

The rule, as ``distkit bench`` applies it:

- Every configuration is measured in ``R >= 3`` repetitions, interleaved with the others. Its value
  is the median of the repetitions; its interval is their range (the range of 3 covers the true
  median with probability 75 %, of 5 with 94 %), widened to at least the noise floor.
- The noise floor comes from an A/A test: the one-process baseline is measured twice in every
  repetition, at its start and at its end. The largest relative difference between the two is the
  floor: two configurations closer than that cannot be told apart in this run.
- A configuration is recommended only when its interval clears (lies entirely above) the interval
  of every other candidate. Otherwise the candidates whose intervals overlap the fastest one are
  tied, and the cheapest of them (fewest processes or devices) is named instead.

Example:
    >>> from distkit.bench.stats import Option, decide, spread
    >>> fast = Option("ddp x2", spread([200.0, 210.0, 205.0], floor=0.02), cost=(2,))
    >>> slow = Option("single", spread([100.0, 104.0, 98.0], floor=0.02), cost=(1,))
    >>> decide([fast, slow]).winner.label
    'ddp x2'
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["Decision", "Interval", "Option", "decide", "noise_floor", "ratio_spread", "spread"]


@dataclass(frozen=True)
class Interval:
    """A measured value and the interval it lies in.

    Attributes:
        value: The median of the repetitions.
        low: The lower end of the interval.
        high: The upper end.

    Example:
        >>> Interval(100.0, 95.0, 104.0).clears(Interval(90.0, 85.0, 94.0))
        True
    """

    value: float
    low: float
    high: float

    @property
    def half_width(self) -> float:
        """Half the interval's width relative to the value (0.05 means +-5 %); ``nan`` if unknown."""
        if not self.value or math.isnan(self.value):
            return math.nan
        return (self.high - self.low) / 2 / abs(self.value)

    def clears(self, other: Interval) -> bool:
        """True when this interval lies entirely above ``other``."""
        return self.low > other.high

    def contains(self, x: float) -> bool:
        """True when ``x`` lies in the interval (ends included)."""
        return self.low <= x <= self.high

    def scaled(self, factor: float) -> Interval:
        """The interval with every end multiplied by ``factor`` (> 0)."""
        return Interval(self.value * factor, self.low * factor, self.high * factor)

    @staticmethod
    def unknown() -> Interval:
        """An interval of a value that was not measured."""
        return Interval(math.nan, math.nan, math.nan)


def spread(values: Sequence[float], *, floor: float = 0.0) -> Interval:
    """The median of ``values`` and their range, widened to at least ``floor / 2`` each side.

    ``floor`` is the relative difference two measurements of the same thing may show (the A/A noise
    floor); each of two values compared may be off by half of it, so two intervals built this way
    overlap whenever their medians are closer than the floor.

    Args:
        values: One value per repetition (at least one).
        floor: Relative noise floor, e.g. 0.04 for 4 %; ``nan`` counts as 0.

    Returns:
        The interval; ``Interval.unknown()`` when ``values`` is empty.

    Example:
        >>> spread([100.0, 104.0, 101.0], floor=0.01)  # the range is wider than the floor
        Interval(value=101.0, low=100.0, high=104.0)
        >>> spread([100.0, 100.0, 100.0], floor=0.1)  # repetitions that agree by chance
        Interval(value=100.0, low=95.0, high=105.0)
    """
    clean = [v for v in values if not math.isnan(v)]
    if not clean:
        return Interval.unknown()
    median = statistics.median(clean)
    half = 0.0 if math.isnan(floor) else floor / 2
    return Interval(median, min(min(clean), median * (1 - half)), max(max(clean), median * (1 + half)))


def ratio_spread(values: Sequence[float], *, floor: float = 0.0) -> Interval:
    """Like :func:`spread` for a ratio of two measurements (a speedup): widened to ``floor`` each side.

    The A/A floor is itself the spread of a ratio of two measurements, so a speedup, measured the
    same way, carries all of it.

    Example:
        >>> ratio_spread([1.5, 1.6, 1.55], floor=0.1).low
        1.395
    """
    return spread(values, floor=2 * floor)


def noise_floor(pairs: Iterable[tuple[float, float]]) -> float:
    """The largest relative difference between two measurements of the same configuration.

    Args:
        pairs: ``(first, second)`` measurements of one configuration, taken in one repetition (the
            A/A test).

    Returns:
        ``max |a - b| / mean(a, b)``; ``nan`` without pairs.

    Example:
        >>> round(noise_floor([(100.0, 104.0), (98.0, 99.0)]), 4)
        0.0392
    """
    diffs = [abs(a - b) / ((a + b) / 2) for a, b in pairs if a + b > 0]
    return max(diffs) if diffs else math.nan


@dataclass(frozen=True)
class Option:
    """One candidate configuration for the decision.

    Attributes:
        label: How the text names it, e.g. ``"ddp on 2 processes at batch 64"``.
        throughput: Its samples/s interval.
        cost: Sorts cheapest first, e.g. ``(processes, strategy order)``.
    """

    label: str
    throughput: Interval
    cost: tuple[float, ...] = ()


@dataclass(frozen=True)
class Decision:
    """What the decision rule concluded.

    Attributes:
        fastest: The candidate with the highest median throughput.
        runner_up: The next highest, or ``None`` for a single candidate.
        tied: The fastest and every candidate whose interval overlaps it, fastest first.
        cheapest: The cheapest of ``tied``.
        noise: The relative half-width the comparison was judged at (0.05 means +-5 %).
    """

    fastest: Option
    runner_up: Option | None
    tied: tuple[Option, ...]
    cheapest: Option
    noise: float

    @property
    def significant(self) -> bool:
        """True when the fastest candidate's interval clears every other's."""
        return len(self.tied) == 1

    @property
    def winner(self) -> Option | None:
        """The recommended candidate, or ``None`` when no difference is significant."""
        return self.fastest if self.significant else None


def decide(options: Sequence[Option]) -> Decision:
    """Apply the decision rule: recommend the fastest only if its interval clears every other's.

    Args:
        options: The eligible candidates (measured, not oversubscribed, not implausible).

    Returns:
        The :class:`Decision`; ``winner`` is ``None`` when intervals overlap.

    Raises:
        ValueError: ``options`` is empty, or a throughput is not a number.

    Example:
        >>> a = Option("a", Interval(100.0, 96.0, 104.0), (1,))
        >>> b = Option("b", Interval(102.0, 99.0, 106.0), (2,))
        >>> d = decide([a, b])
        >>> d.winner is None, d.cheapest.label
        (True, 'a')
    """
    if not options:
        raise ValueError("decide() needs at least one candidate; every configuration was excluded.")
    for option in options:
        if math.isnan(option.throughput.value):
            raise ValueError(f"candidate {option.label!r} has no measured throughput.")
    ranked = sorted(options, key=lambda o: o.throughput.value, reverse=True)
    fastest, others = ranked[0], ranked[1:]
    tied = (fastest, *(o for o in others if not fastest.throughput.clears(o.throughput)))
    cheapest = min(tied, key=lambda o: (o.cost, -o.throughput.value))
    judged = tied if len(tied) > 1 else ranked[:2]
    widths = [o.throughput.half_width for o in judged if not math.isnan(o.throughput.half_width)]
    return Decision(
        fastest=fastest,
        runner_up=others[0] if others else None,
        tied=tied,
        cheapest=cheapest,
        noise=max(widths) if widths else math.nan,
    )
