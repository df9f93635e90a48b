"""The errors of :class:`distkit.TrainerCLI`: jsonargparse's messages made to name the key, the
value, the expected type and the file it came from (with a "did you mean"). Local."""

from __future__ import annotations

import difflib
import importlib
import inspect
import re
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal

from jsonargparse import ArgumentParser

__all__: list[str] = []


def explain(parser: ArgumentParser, err: BaseException, argv: list[str]) -> str:
    """jsonargparse's error, restated as key, value and expected type with the fix."""
    text = str(err)
    hidden = ("help", "config", "print_config", "print_shtab")
    actions = {a.dest: a for a in parser._actions if a.dest not in hidden and not a.dest.endswith(".help")}
    fix = "--help lists every option with its type and default."

    broken = _broken_config_file(argv)
    if broken is not None:
        return broken

    found = re.match(r"unrecognized arguments: (\S+)(?: (.*))?", text)
    if found:
        option, rest = found.group(1), found.group(2)
        key = option.lstrip("-")
        value: Any = None
        if "=" in key:
            key, value = key.split("=", 1)
        elif rest and not rest.startswith("-"):
            value = rest.split()[0]
        return _unknown(key, value, actions, "on the command line", fix)

    inner = re.search(r"(?:Group '([^']+)' does not accept|Option '([^']+)' is not accepted)", text)
    if inner:
        outer = re.findall(r'Parser key "([^"]+)"', text)
        group = re.search(r"Group '([^']+)' does not accept option '([^']+)'", text)
        key = f"{group.group(1)}.{group.group(2)}" if group else ".".join([*outer[:1], inner.group(2)])
        value = _value_in_namespace_text(text, key.rsplit(".", 1)[-1])
        where = ""
        if value is None:
            value, path = _value_in_config_files(argv, key)
            where = f"in {path}" if path else "in a config file"
        return _unknown(key, value, actions, where, fix, text)

    found = re.search(r"the following arguments are required: (.*)", text)
    if found:
        lines = []
        for key in [k.strip() for k in found.group(1).split(",")]:
            expected = _expected(actions.get(key))
            lines.append(
                f"missing required value {key} (type {expected}, no default): give --{key} VALUE, "
                f"or set {key} in a --config file."
            )
        return " ".join(lines) + " " + fix

    keys = re.findall(r'Parser key "([^"]+)"', text)
    if keys:
        key = keys[0]
        for inner_key in keys[1:]:
            key = inner_key if inner_key.startswith(key + ".") else f"{key}.{inner_key}"
        given = re.search(r"(?:Given value|Got value): (.*)", text)
        value_text = given.group(1).strip() if given else None
        if value_text is not None:  # a nested error ends with the whole namespace: keep the value
            value_text = value_text.split(". Got value:")[0]
        action = actions.get(key)
        expected = _expected(action) if action is not None else _expected_from_text(text)
        shown = f"{value_text!r}" if value_text is not None else "the value given"
        return (
            f"{key}: expected {expected}, got {shown}. Set it on the command line (--{key} VALUE) or in "
            f"a --config file. {fix}"
        )
    return f"{_tidy(text)}\n{fix}"


def _unknown(key: str, value: Any, actions: Mapping[str, Any], where: str, fix: str, detail: str = "") -> str:
    top = sorted({dest.split(".")[0] for dest in actions})
    group = key.rpartition(".")[0]
    message = f"unknown key {key}"
    if where:
        message += f" {where}"
    if value is not None:
        message += f" (given {value!r})"
    message += "."
    if group and group in top:
        known = sorted(d for d in actions if d.startswith(group + ".") and not d.endswith(".help"))
        if not known:  # a class-path option: the init args of the class chosen
            known = _init_arg_names(detail, group)
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
        if close:
            message += f" Did you mean {close[0]}?"
        if known:
            message += f" {group} accepts: " + ", ".join(k[len(group) + 1 :] for k in known[:40]) + "."
    else:
        first = key.split(".")[0]
        close = difflib.get_close_matches(first, top, n=1, cutoff=0.6)
        if close:
            message += f" Did you mean {close[0]}{key[len(first) :]}?"
        message += " The top-level keys are: " + ", ".join(top) + "."
    return f"{message} {fix}"


def _init_arg_names(text: str, group: str) -> list[str]:
    """The init args the chosen class of a class-path option accepts (from the error's text)."""
    found = re.search(r"class_path='([^']+)'", text)
    if not found:
        return []
    module, _, name = found.group(1).rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
        params = list(inspect.signature(cls).parameters)[1:]  # the first is supplied by fit
    except (ImportError, AttributeError, TypeError, ValueError):
        return []
    return [f"{group}.{p}" for p in params]


def _value_in_namespace_text(text: str, name: str) -> Any:
    found = re.search(rf"\b{re.escape(name)}=('[^']*'|[^,)]+)", text)
    return found.group(1).strip("'") if found else None


def _config_paths(argv: list[str]) -> list[str]:
    paths = []
    for i, arg in enumerate(argv):
        if arg in ("-c", "--config") and i + 1 < len(argv):
            paths.append(argv[i + 1])
        elif arg.startswith("--config="):
            paths.append(arg.split("=", 1)[1])
    return paths


def _broken_config_file(argv: list[str]) -> str | None:
    """What is wrong with the first ``--config`` file that is missing or not valid YAML, if any."""
    import yaml

    for path in _config_paths(argv):
        if "\n" in path or path.lstrip().startswith("{"):
            continue  # jsonargparse also takes the config itself as the value
        try:
            with open(path, encoding="utf-8") as handle:
                yaml.safe_load(handle)
        except OSError as err:
            return f"cannot read the config file {path}: {err.strerror or err}. Give the path of a YAML file."
        except yaml.YAMLError as err:
            detail = " ".join(str(err).split())
            return f"the config file {path} is not valid YAML: {detail}. Fix it at that line."
    return None


def _value_in_config_files(argv: list[str], key: str) -> tuple[Any, str | None]:
    """The value of ``key`` in the ``--config`` files of ``argv``, and the (last) file that has it."""
    import yaml

    value, where = None, None
    for path in _config_paths(argv):
        try:
            with open(path, encoding="utf-8") as handle:
                node: Any = yaml.safe_load(handle)
        except (OSError, yaml.YAMLError):
            continue
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node is not None:
            value, where = node, path
    return value, where


def _expected(action: Any) -> str:
    if action is None:
        return "a value"
    hint = getattr(action, "_typehint", None)
    if hint is None:
        hint = action.type
    if hint is None and action.choices:
        return " | ".join(repr(c) for c in action.choices)
    return _type_name(hint) if hint is not None else "a value"


def _type_name(hint: Any) -> str:
    """``int | None`` for ``Optional[int]``, ``Sequence[int]``, ``'step' | 'epoch'``..."""
    if hint is type(None):
        return "None"
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union or origin is types.UnionType:
        return " | ".join(_type_name(a) for a in args)
    if origin is Literal:
        return " | ".join(repr(a) for a in args)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        if not args:
            return name
        inner = ", ".join("..." if a is Ellipsis else _type_name(a) for a in args)
        return f"{name}[{inner}]"
    if isinstance(hint, type):
        return hint.__name__
    if isinstance(hint, list):
        return "[" + ", ".join(_type_name(a) for a in hint) + "]"
    return str(hint).replace("typing.", "")


def _expected_from_text(text: str) -> str:
    subtypes = re.search(r"Subtypes: \[(.*)\]", text)
    if subtypes:
        return _tidy(subtypes.group(1)).replace(", ", " | ")
    found = re.findall(r"Expected a (<class '[^']+'>|[\w. ]+)", text)
    return " | ".join(_tidy(f) for f in found) if found else "a value of another type"


def _tidy(text: str) -> str:
    text = re.sub(r"<class '(?:builtins\.)?([^']+)'>", r"\1", text)
    text = text.replace("collections.abc.", "").replace("typing.", "")
    return text.replace("NoneType", "None")
