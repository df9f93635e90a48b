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


def check_bool(name: str, value: object, *, optional: bool = False) -> None:
    """Refuse a flag that is not True or False (or None, when ``optional``): a string read from a
    config file or the environment ("False", "0") is true to Python, so it would act as True."""
    if isinstance(value, bool) or (optional and value is None):
        return
    allowed = "True, False or None" if optional else "True or False"
    hint = (
        f" (a non-empty string is true to Python; parse it first, e.g. {name}=value.lower() == 'true')"
        if isinstance(value, str)
        else ""
    )
    raise TypeError(f"{name} must be {allowed}, got {type(value).__name__} {value!r}{hint}.")
