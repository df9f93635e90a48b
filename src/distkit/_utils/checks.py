"""Checks of arguments shared by modules of several concerns. Local."""

from __future__ import annotations

__all__: list[str] = []


def check_int(name: str, value: object, minimum: int) -> int:
    """``value`` when it is an int (not a bool) >= ``minimum``; else the error that names ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int >= {minimum}, got {type(value).__name__} {value!r}.")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}.")
    return value
