"""Keyword arguments a caller misspelt, named with the one meant.

Python (3.11, 3.12) says only "got an unexpected keyword argument 'timeout'". distkit's durations
end in ``_s`` (``timeout_s``: seconds, a number), so everyone who comes from torch's
``dist.barrier(timeout=...)`` types ``timeout=``; Lightning's users type its names
(``Trainer(gpus=2)``, ``fit(train_dataloaders=...)``). :func:`names_slips` wraps a public function
so that such a call fails with the same ``TypeError`` naming the argument meant. Only the failed
call does any work: a call that binds pays one Python call more.
"""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable, Mapping
from typing import ParamSpec, TypeVar

__all__ = ["names_slips"]

P = ParamSpec("P")
R = TypeVar("R")


def names_slips(meant: Mapping[str, str] | None = None) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorate a function so that a keyword argument it does not take is named with the one meant:
    ``meant`` maps other tools' names to what to write here; otherwise the closest parameter
    name, or the parameter that adds ``_s``."""

    def decorate(fn: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(fn)
        def call(*args: P.args, **kwargs: P.kwargs) -> R:
            try:
                return fn(*args, **kwargs)
            except TypeError:
                slip = _slip(fn, args, kwargs, meant or {})
                if slip is None:
                    raise
                raise TypeError(slip) from None

        return call

    return decorate


def _slip(
    fn: Callable[..., object], args: tuple[object, ...], kwargs: dict[str, object], meant: Mapping[str, str]
) -> str | None:
    """The message for a call of ``fn`` that names a keyword it does not take; None when the call
    binds (the TypeError came from inside ``fn``) or fails for another reason."""
    signature = inspect.signature(fn)
    try:
        signature.bind(*args, **kwargs)
    except TypeError:
        pass
    else:
        return None
    takes = [
        name
        for name, param in signature.parameters.items()
        if param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY) and name != "self"
    ]
    unknown = [name for name in kwargs if name not in signature.parameters]
    if not unknown:
        return None
    name = unknown[0]
    what = f"{fn.__qualname__.replace('.__init__', '')}() got an unexpected keyword argument {name!r}"
    if name in meant:
        return f"{what}: {meant[name]}."
    if f"{name}_s" in takes:
        return f"{what}. Did you mean {name}_s=? distkit's durations are seconds, as a number, named *_s."
    close = difflib.get_close_matches(name, takes, n=1, cutoff=0.6)
    if close:
        return f"{what}. Did you mean {close[0]}=?"
    return f"{what}; it takes {', '.join(takes)}."
