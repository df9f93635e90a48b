"""The errors of :class:`distkit.TrainerCLI`: jsonargparse's messages made to name the key, the
value, the expected type and the file it came from (with a "did you mean"), and the check that a
config's class paths name only subclasses of the declared bases (a config is data, not code). Local."""

from __future__ import annotations

import collections.abc
import contextlib
import difflib
import functools
import importlib
import inspect
import os
import re
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from jsonargparse import ArgumentParser

__all__: list[str] = []


# A value quoted in a message is shown whole up to this many characters (a few lines of a terminal),
# then cut with an ellipsis: enough for any option's value, not a pasted file.
_SHOWN_CHARS = 200


def shown(value: Any) -> str:
    """``value`` as a message quotes it: its repr, whole, or cut with ``...`` past 200 characters. Local.

    Example:
        >>> shown([0.9, 0.999])
        '[0.9, 0.999]'
    """
    text = repr(value)
    return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 3] + "..."


def explain(parser: ArgumentParser, err: BaseException, argv: list[str]) -> str:
    """jsonargparse's error, restated as key, value and expected type with the fix."""
    text = str(err)
    hidden = ("help", "config", "print_config", "print_shtab")
    actions = {a.dest: a for a in parser._actions if a.dest not in hidden and not a.dest.endswith(".help")}
    fix = "--help lists every option with its type and default."

    broken = _broken_config_file(argv)
    if broken is not None:
        return broken
    split = _split_by_the_shell(argv)
    if split is not None:
        return f"{split} {fix}"

    found = re.match(r"unrecognized arguments: (\S+)(?: (.*))?", text)
    if found:
        option, rest = found.group(1), found.group(2)
        key = option.lstrip("-")
        value: Any = None
        if "=" in key:
            key, value = key.split("=", 1)
        elif rest and not rest.startswith("-"):
            value = rest.split()[0]
        # The error's text joins the arguments with spaces: the value as given is argv's.
        value = _value_on_command_line(argv, key) or value
        return _unknown(key, value, actions, "on the command line", fix)

    inner = re.search(r"(?:Group '([^']+)' does not accept|Option '([^']+)' is not accepted)", text)
    if inner:
        outer = re.findall(r'Parser key "([^"]+)"', text)
        group = re.search(r"Group '([^']+)' does not accept option '([^']+)'", text)
        key = f"{group.group(1)}.{group.group(2)}" if group else ".".join([*outer[:1], inner.group(2)])
        # The value as given (on the command line, or in the file that has it), else as jsonargparse
        # shows it in its namespace.
        value, where = _value_on_command_line(argv, key), "on the command line"
        if value is None:
            value, path = _value_in_config_files(argv, key)
            where = f"in {path}" if path else ""
        if value is None:
            value = _value_in_namespace_text(text, key.rsplit(".", 1)[-1])
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

    unloaded = re.match(r"Parser key \"([^\"]+)\":\s*Unable to load config '(.*)'", text)
    groups = sections(parser)
    if unloaded and unloaded.group(1) in groups:
        key = unloaded.group(1)
        value = _value_on_command_line(argv, key)
        if value is None:
            value = _value_in_config_files(argv, key)[0]
        if value is None:
            value = unloaded.group(2)
        return f"{_not_a_section(key, value, argv, groups[key])} {fix}"

    keys = re.findall(r'Parser key "([^"]+)"', text)
    if keys:
        key = keys[0]
        for inner_key in keys[1:]:
            if inner_key != key:  # a nested error names its key again ("data" in "data")
                key = inner_key if inner_key.startswith(key + ".") else f"{key}.{inner_key}"
        given = re.search(r"(?:Given value|Got value): (.*)", text)
        value_text = given.group(1).strip() if given else None
        if value_text is not None:  # a nested error ends with the whole namespace: keep the value
            value_text = value_text.split(". Got value:")[0]
        action = actions.get(key)
        if value_text is None:
            value_text = _value_on_command_line(argv, key)
        unresolved = _unresolved_class(key, value_text, action, argv)
        if unresolved is not None:
            return f"{unresolved} {fix}"
        expected = _expected(action) if action is not None else _expected_from_text(text)
        quoted = shown(value_text) if value_text is not None else "the value given"
        where = where_to_fix(argv, key, "VALUE", value_text)
        return f"{key}: expected {expected}, got {quoted}. {where} {fix}"
    return f"{_tidy(text)}\n{fix}"


def explain_trainer_option(parser: ArgumentParser, err: BaseException, argv: list[str]) -> str:
    """The Trainer's refusal of an option's value (``max_epochs must be >= 1, got -1.``), said as a
    configuration error: which ``trainer.*`` key, where it was given and how to change it."""
    keys = {a.dest[len("trainer.") :] for a in parser._actions if a.dest.startswith("trainer.")}
    named = [name for name in re.findall(r"[A-Za-z_]\w*", str(err)) if name in keys]
    if not named:
        return f"invalid trainer options: {err} --help lists every option with its type and default."
    key = f"trainer.{named[0]}"
    where = where_to_fix(argv, key, "VALUE")
    return f"{key}: {err} {where} --help lists every option with its type and default."


def where_to_fix(argv: list[str], key: str, metavar: str, refused: str | None = None) -> str:
    """Where to change ``key``: the config file that set it, unless the command line did. Local.

    ``refused``: the value the parser refused, when known. A config file's value is checked as the
    file is read, so a value given elsewhere (the command line, another file) cannot mend it: a file
    holding the refused value is named even when the command line gives the key too."""
    on_line = _value_on_command_line(argv, key)
    if refused is not None and refused != on_line:
        paths = config_paths(argv)
        values = [_value_in_config_files([f"--config={path}"], key)[0] for path in paths]
        holding = [_holds(value, refused) for value in values]
        if any(holding):
            # Checked as its file is read: neither a later file nor the command line can mend it.
            first = holding.index(True)
            elsewhere = on_line is not None or sum(v is not None for v in values) > 1
            return f"Fix {key} in {paths[first]}" + (
                ": a --config file's values are checked as the file is read, so another value given "
                "for it elsewhere does not mend this one."
                if elsewhere
                else "."
            )
    _, in_file = _value_in_config_files(argv, key)
    if in_file is not None and on_line is None:
        return f"Fix {key} in {in_file}, or set it on the command line (--{key} {metavar})."
    return f"Set {key} on the command line (--{key} {metavar}) or in a --config file."


def _holds(value: Any, refused: str) -> bool:
    """Whether a config file's ``value`` is the ``refused`` one (a class given by its path too)."""
    if isinstance(value, dict):
        value = value.get("class_path")
    return value is not None and str(value) == refused


def _value_on_command_line(argv: list[str], key: str) -> str | None:
    """The last value ``argv`` gives ``--key`` (``--key VALUE``, ``--key=VALUE`` or ``--key+=VALUE``)."""
    value = None
    for i, arg in enumerate(argv):
        if arg == f"--{key}" and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith((f"--{key}=", f"--{key}+=")):
            value = arg.split("=", 1)[1]
    return value


def _unresolved_class(key: str, value: str | None, action: Any, argv: list[str]) -> str | None:
    """Why the class path in ``value`` (given for ``key``, typed by ``action``) names no class, with
    the closest name that does (a one-character slip: ``Adamw`` for ``AdamW``); ``None`` when the
    value names a class or is no class path."""
    if value is None or action is None:
        return None
    quoted = re.findall(r"class_path='([^']+)'", value)
    path = quoted[0] if quoted else value.strip().strip("'\"")
    if not re.fullmatch(r"[A-Za-z_][\w.]*", path):
        return None
    hint = getattr(action, "_typehint", None) or action.type
    bases = _bases(hint) or _bases(_item_hint(hint))
    if not bases or resolve(path, bases) is not None:
        return None
    why = _missing_part(path) or f"no subclass of {_names(bases)} is named {path!r}"
    close = _closest_class(path, bases)
    advice = (
        f"Did you mean {close}?" if close else f"Give a subclass of {_names(bases)} (a name or import path)."
    )
    return f"{key}: {path} names no class ({why}). {advice} {where_to_fix(argv, key, 'CLASS', path)}"


def _missing_part(path: str) -> str | None:
    """What of the dotted ``path`` does not exist: ``module torch.optim has no attribute 'Adamw'``."""
    if "." not in path:
        return None
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module = ".".join(parts[:cut])
        try:
            target: Any = importlib.import_module(module)
        except ImportError:
            continue
        name = module
        for part in parts[cut:]:
            if not hasattr(target, part):
                return f"{'module ' if inspect.ismodule(target) else ''}{name} has no attribute {part!r}"
            target, name = getattr(target, part), f"{name}.{part}"
        return None
    return f"no module named {parts[0]!r}"


def _closest_class(path: str, bases: tuple[type, ...]) -> str | None:
    """The import path of the subclass of ``bases`` whose name is closest to ``path``'s last part
    (the same name in another case first), if one is close."""
    name = path.rsplit(".", 1)[-1]
    found: dict[str, type] = {}
    for base in bases:
        for cls in _subclasses(base):
            if not cls.__name__.startswith("_"):
                found.setdefault(cls.__name__, cls)
    same = [cls for known, cls in found.items() if known.lower() == name.lower()]
    if same:
        return public_path(same[0])
    close = difflib.get_close_matches(name, list(found), n=1, cutoff=0.75)
    return public_path(found[close[0]]) if close else None


def _subclasses(base: type) -> list[type]:
    """``base`` and its subclasses, as far as they are imported."""
    seen: dict[type, None] = {}  # in the order found
    stack = [base]
    while stack:
        cls = stack.pop()
        if cls in seen:
            continue
        seen[cls] = None
        with contextlib.suppress(TypeError):  # type.__subclasses__ needs an argument
            stack.extend(cls.__subclasses__())
    return list(seen)


def _unknown(key: str, value: Any, actions: Mapping[str, Any], where: str, fix: str, detail: str = "") -> str:
    top = sorted({dest.split(".")[0] for dest in actions})
    group = key.rpartition(".")[0]
    message = f"unknown key {key}"
    if where:
        message += f" {where}"
    if value is not None:
        message += f" (given {shown(value)})"
    message += "."
    # A group of options (trainer, optimizer), or one option holding classes (trainer.callbacks,
    # trainer.logger), whose init args the key names.
    if group and (group in top or group in actions):
        known = sorted(d for d in actions if d.startswith(group + ".") and not d.endswith(".help"))
        if not known:  # a class-path option: the init args of the class chosen
            known = _init_arg_names(detail, group)
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
        if close:
            message += _meant(key, close[0])
        if known:
            message += f" {group} accepts: " + ", ".join(k[len(group) + 1 :] for k in known[:40]) + "."
    else:
        parts = key.split(".")
        close = difflib.get_close_matches(parts[0], top, n=1, cutoff=0.6)
        if "" in parts:  # a dot too many (trainer..max_epochs)
            close = [".".join(part for part in parts if part)]
        elif close and close[0] == parts[0] and len(parts) > 2:
            # The first name is right: the slip is further in (optimizer.init_arg.lr).
            second = {d.split(".")[1] for d in actions if d.startswith(parts[0] + ".") and d.count(".")}
            second |= {"class_path", "init_args"}
            near = difflib.get_close_matches(parts[1], sorted(second), n=1, cutoff=0.6)
            close = [".".join([parts[0], near[0], *parts[2:]])] if near else []
        elif close:
            close = [".".join([close[0], *parts[1:]])]
        if close:
            message += _meant(key, close[0])
        message += " The top-level keys are: " + ", ".join(top) + "."
    return f"{message} {fix}"


def _meant(key: str, close: str) -> str:
    """The suggestion for an unknown ``key``; a known key given with one dash (``-trainer.x``)
    reads as unknown, and is told how to write it rather than suggested as itself."""
    if close == key:
        return f" It is a known key: write the option with two dashes, --{key}."
    return f" Did you mean {close}?"


def _init_arg_names(text: str, group: str) -> list[str]:
    """The init args the chosen class of a class-path option accepts (from the error's text)."""
    found = re.search(r"class_path[= ]'([^']+)'", text)  # "class_path='X'" or "class_path 'X'"
    if not found:
        return []
    module, _, name = found.group(1).rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
        params = list(inspect.signature(cls).parameters)
    except (ImportError, AttributeError, TypeError, ValueError):
        return []
    if group in ("optimizer", "lr_scheduler"):
        params = params[1:]  # the first (parameters, optimizer) is supplied by fit
    return [f"{group}.{p}" for p in params]


def _value_in_namespace_text(text: str, name: str) -> Any:
    """The value after ``name=`` in a Namespace's repr, whole: up to the comma or parenthesis that
    closes it, past those inside brackets or quotes (``betas=[0.9, 0.999]``)."""
    found = re.search(rf"\b{re.escape(name)}=", text)
    if found is None:
        return None
    depth, quote, escaped, end = 0, "", False, len(text)
    for index in range(found.end(), len(text)):
        char = text[index]
        if escaped:
            escaped = False
        elif quote:
            escaped = char == "\\"
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "([{":
            depth += 1
        elif char in ")]}" and depth:
            depth -= 1
        elif char in ",)]}" and not depth:  # the end of this value
            end = index
            break
    value = text[found.end() : end].strip()
    return value[1:-1] if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"" else value


def _split_by_the_shell(argv: list[str]) -> str | None:
    """Why an option got a piece of a list or mapping: written unquoted with spaces
    (``--optimizer.betas [0.9, 0.999]``), the shell split it, and the option got ``[0.9,`` while
    ``0.999]`` became an argument of its own. ``None`` when no value is split so."""
    for index, argument in enumerate(argv[:-1]):
        option, equals, value = argument.partition("=")
        if not option.startswith("--"):
            continue
        start = index if equals else index + 1
        if not equals:
            value = argv[start] if start < len(argv) else ""
        if _open_brackets(value) <= 0:
            continue
        parts = [value]
        for following in argv[start + 1 :]:
            parts.append(following)
            if _open_brackets(" ".join(parts)) <= 0:
                whole = " ".join(parts)
                return (
                    f"{option}: the shell split the value {shown(whole)} at its spaces, so {option} got "
                    f"{shown(value)} and the rest became arguments of their own. Quote the value whole: "
                    f"{option} '{whole}' (or write it without spaces)."
                )
    return None


def _open_brackets(text: str) -> int:
    """How many brackets ``[``/``{`` of ``text`` are left open (quoted text aside)."""
    depth, quote = 0, ""
    for char in text:
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "[{":
            depth += 1
        elif char in "]}":
            depth -= 1
    return depth


def config_paths(argv: list[str]) -> list[str]:
    """The ``-c/--config`` files of ``argv``, in order. Local."""
    paths = []
    for i, arg in enumerate(argv):
        if arg in ("-c", "--config") and i + 1 < len(argv):
            paths.append(argv[i + 1])
        elif arg.startswith("--config="):
            paths.append(arg.split("=", 1)[1])
    return paths


def config_files(argv: list[str]) -> list[str]:
    """The ``-c/--config`` paths of ``argv`` that are regular files, which a check may read before
    jsonargparse does: a pipe (``--config <(envsubst < run.yaml)``, ``/dev/stdin``) is read once,
    by jsonargparse alone. Local."""
    return [path for path in config_paths(argv) if os.path.isfile(path)]


def _broken_config_file(argv: list[str]) -> str | None:
    """What is wrong with the first ``--config`` file that is missing, not valid YAML or without a
    setting (empty, or comments only), if any."""
    import yaml

    for path in config_paths(argv):
        if "\n" in path or path.lstrip().startswith("{"):
            continue  # jsonargparse also takes the config itself as the value
        try:
            with open(path, encoding="utf-8") as handle:
                loaded = yaml.safe_load(handle)
        except OSError as err:
            return f"cannot read the config file {path}: {err.strerror or err}. Give the path of a YAML file."
        except yaml.YAMLError as err:
            detail = " ".join(str(err).split())
            return f"the config file {path} is not valid YAML: {detail}. Fix it at that line."
        if loaded is None:
            return (
                f"the config file {path} holds no settings (it is empty, or only comments). Write the "
                f"options in it (--print_config prints every option with its value), or leave out "
                f"--config {path}."
            )
    return None


def _value_in_config_files(argv: list[str], key: str) -> tuple[Any, str | None]:
    """The value of ``key`` in the ``--config`` files of ``argv``, and the (last) file that has it."""
    import yaml

    value, where = None, None
    for path in config_paths(argv):
        try:
            with open(path, encoding="utf-8") as handle:
                node: Any = yaml.safe_load(handle)
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            continue
        found = _find(node, key.split("."))
        if found is not None:
            value, where = found, path
    return value, where


def _find(node: Any, parts: list[str]) -> Any:
    """The value at ``parts`` in a loaded config, looking into lists (``trainer.callbacks``) and the
    ``init_args`` of a class path on the way."""
    if not parts:
        return node
    if isinstance(node, list):
        return next((v for v in (_find(item, parts) for item in node) if v is not None), None)
    if not isinstance(node, dict):
        return None
    if parts[0] in node:
        return _find(node[parts[0]], parts[1:])
    return _find(node["init_args"], parts) if isinstance(node.get("init_args"), dict) else None


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
    # A dotted name, not the sentence after it: "Expected a tuple with 2 elements. Got value: ...".
    found = re.findall(r"Expected a (<class '[^']+'>|[\w ]+(?:\.\w+)*)", text)
    return " | ".join(_tidy(f) for f in found) if found else "a value of another type"


def _tidy(text: str) -> str:
    text = re.sub(r"<class '(?:builtins\.)?([^']+)'>", r"\1", text)
    text = text.replace("collections.abc.", "").replace("typing.", "")
    return text.replace("NoneType", "None")


# ------------------------------------------------------------------------------------------------
# Class paths: a config is data, not code
#
# jsonargparse calls what a class path names when it instantiates the config: a class with its init
# args, and also, where the option's type allows it, a function (any callable under a ``Callable``
# type, one whose return annotation fits under a class type, anything under ``Any``). A config file
# could then run ``os.system`` on every rank. The check below runs on the parsed configuration,
# before anything is instantiated: every class path must name a class that is a subclass of the
# base its position declares, and a function or other callable named by the config is refused,
# unless the script allowed it (``TrainerCLI(allow_callables=...)``). Importing the module a class
# path names runs that module's top level, as in LightningCLI: that is the trust model
# (``docs/config.md``, "What a config may run").

_NO_BASES: tuple[type, ...] = ()
# Classes that are values, not bases: a class path is never needed for them.
_LEAF_TYPES = (str, bytes, bool, int, float, complex, type(None))


class _Refused(Exception):
    """A class path or callable the config may not name; the message says which and why."""


def untrusted_class_path(
    parser: ArgumentParser, config: Any, allowed: Sequence[Any], argv: list[str]
) -> str | None:
    """The first class path (or function) in the parsed ``config`` that names something other than
    a subclass of the base its key declares, as an error message; ``None`` when there is none.

    Local; calls nothing the config names (it imports the modules, which jsonargparse did already).
    """
    for action in _typed_actions(parser):
        try:
            value = config.get(action.dest) if hasattr(config, "get") else None
        except (KeyError, AttributeError):
            continue
        try:
            _check(value, action._typehint, action.dest, action.default, allowed, raw=False)
        except _Refused as refused:
            where = _value_in_config_files(argv, action.dest)[1]
            return f"{refused} (in {where})" if where else str(refused)
    return None


def misshapen_sections(argv: list[str], parser: ArgumentParser | None = None) -> str | None:
    """Why a ``--config`` file's section (``model:``, ``data:``, ``trainer:`` or a group of the
    parser's), or an ``init_args``, is not a mapping of argument names, or ``None``. jsonargparse takes
    a list there and, when an option such as ``--model.hidden 16`` comes after, drops it for a mapping
    of that option alone: the other values the file meant (``model: [32, 0.9]``'s 0.9) are lost
    without a word (and ``trainer: [1, 2]`` failed later with a TypeError). A section may be the path
    of its own YAML file, relative to the config file (``model: model.yaml``). Local."""
    import yaml

    groups = sections(parser) if parser is not None else {"model": [], "data": []}
    for path in config_files(argv):
        try:
            with open(path, encoding="utf-8") as handle:
                data: Any = yaml.safe_load(handle)
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            continue  # jsonargparse names these
        if not isinstance(data, dict):
            continue
        # (optimizer: null too: a fit needs one; lr_scheduler: null is "none", as meant.)
        empty = next((key for key in [*groups, "optimizer"] if key in data and data[key] is None), None)
        if empty is not None:
            # YAML reads `trainer:` with nothing after it (every line below commented out) as null,
            # and jsonargparse then drops every default of the section: the script's own too.
            fix = (
                "Give it a class_path (and init_args), or delete the line to keep the script's"
                if empty == "optimizer"
                else f"Give it its arguments, write {empty}: {{}} for none, or delete the line"
            )
            return (
                f"{empty}: in {path} is empty, which YAML reads as null: the run would lose every "
                f"{empty} default, the script's included. {fix}."
            )
        shapes = [(key, data.get(key), groups[key]) for key in groups]
        shapes += [
            (f"{key}.init_args", data[key].get("init_args"), [])
            for key in ("optimizer", "lr_scheduler")
            if isinstance(data.get(key), dict)
        ]
        for key, value, arguments in shapes:
            if value is None or isinstance(value, dict):
                continue
            own_file = isinstance(value, str) and not key.endswith(".init_args")
            if own_file and os.path.isfile(os.path.join(os.path.dirname(path), value)):
                continue  # the section's own file: jsonargparse reads it
            nor = " nor the path of a YAML file" if own_file else ""
            kind = type(value).__name__
            return (
                f"{key} in {path} is {'an' if kind[0] in 'aeiou' else 'a'} {kind} ({shown(value)}), not a "
                f"mapping of argument names to values{nor}: write each argument by name, {key}: "
                f"{_example(arguments)}.{_accepts(key, arguments) or ' --print_config shows the names.'}"
            )
    return None


def sections(parser: ArgumentParser) -> dict[str, list[str]]:
    """The groups of options that take a mapping or a file of their own (``model``, ``data``,
    ``trainer`` and the groups a subclass added), each with its arguments as a message lists them:
    ``{"data": ["samples (int)", "seed (int)"], ...}``. Local."""
    actions = {action.dest: action for action in parser._actions}
    found: dict[str, list[str]] = {}
    for dest, action in actions.items():
        children = [d for d in actions if d.startswith(f"{dest}.") and not d.endswith(".help")]
        if hasattr(action, "_typehint") or not children:
            continue
        direct = [d for d in children if "." not in d[len(dest) + 1 :]]
        found[dest] = [f"{d[len(dest) + 1 :]} ({_expected(actions[d])})" for d in direct]
    return found


def _example(arguments: list[str]) -> str:
    """``{hidden: ..., dropout: ...}``: a mapping of a section's first arguments."""
    names = [argument.split(" ", 1)[0] for argument in arguments[:2]] or ["name"]
    more = ", ..." if len(arguments) > 2 or not arguments else ""
    return "{" + ", ".join(f"{name}: ..." for name in names) + more + "}"


def _accepts(key: str, arguments: list[str]) -> str:
    if not arguments:
        return ""
    listed = ", ".join(arguments[:12])
    if len(arguments) > 12:
        listed += f" and {len(arguments) - 12} more (--help lists them)"
    return f" {key} accepts: {listed}."


def _not_a_section(key: str, value: Any, argv: list[str], arguments: list[str]) -> str:
    """What a section (``data``) given something other than a mapping or a file of one gets told:
    the value, where, what belongs there (its arguments by name) and how to write it."""
    example = _example(arguments)
    if _value_on_command_line(argv, key) is not None:
        first = arguments[0].split(" ", 1)[0] if arguments else "NAME"
        where, fix = "on the command line", f"--{key}.{first} VALUE, or all as a mapping, --{key} '{example}'"
    else:
        _, path = _value_in_config_files(argv, key)
        where, fix = (f"in {path}" if path else "in a config file"), f"{key}: {example}"
    missing = f" (no file {value!r} exists)" if isinstance(value, str) and not os.path.exists(value) else ""
    return (
        f"{key} {where} is {shown(value)}, not a mapping of argument names to values nor the path of a "
        f"YAML file holding one{missing}: give each argument by name, {fix}.{_accepts(key, arguments)}"
    )


def untrusted_in_raw_input(parser: ArgumentParser, argv: list[str], allowed: Sequence[Any]) -> str | None:
    """Like :func:`untrusted_class_path`, on the raw ``--config`` files and ``--key VALUE`` options
    of ``argv``: why a config that jsonargparse could not parse was refused, when the reason is a
    class path naming a function."""
    import yaml

    actions = _typed_actions(parser)
    for path in config_paths(argv):
        try:
            with open(path, encoding="utf-8") as handle:
                data: Any = yaml.safe_load(handle)
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            continue
        for action in actions:
            node: Any = data
            for part in action.dest.split("."):
                node = node.get(part) if isinstance(node, dict) else None
            refused = _raw_refusal(action, node, allowed)
            if refused is not None:
                return f"{refused} (in {path})"
    by_option = {f"--{action.dest}": action for action in actions}
    for index, argument in enumerate(argv):
        option, equals, text = argument.partition("=")
        action = by_option.get(option)
        if action is None:
            continue
        if not equals:
            if index + 1 >= len(argv):
                continue
            text = argv[index + 1]
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            value = text
        refused = _raw_refusal(action, value, allowed)
        if refused is not None:
            return f"{refused} (on the command line)"
    return None


def _raw_refusal(action: Any, value: Any, allowed: Sequence[Any]) -> str | None:
    if value is None:
        return None
    try:
        _check(value, action._typehint, action.dest, action.default, allowed, raw=True)
    except _Refused as refused:
        return str(refused)
    return None


def _typed_actions(parser: ArgumentParser) -> list[Any]:
    hidden = ("help", "config", "print_config", "print_shtab")
    return [
        a
        for a in parser._actions
        if hasattr(a, "_typehint") and a.dest not in hidden and not a.dest.endswith(".help")
    ]


def _check(value: Any, hint: Any, key: str, default: Any, allowed: Sequence[Any], *, raw: bool) -> None:
    """Raise :class:`_Refused` when ``value`` (at ``key``, typed ``hint``) names what it may not."""
    if _is_spec(value):
        _check_spec(value, hint, key, allowed, raw=raw)
    elif isinstance(value, str):
        # Parsed, a string is data (jsonargparse has made the import paths it accepted into objects,
        # and keeps a default's as text). Raw, at a key that takes no text, it is an import path.
        if raw and "." in value and _bases(hint) and not _accepts_text(hint):
            _check_spec({"class_path": value}, hint, key, allowed, raw=True)
    elif isinstance(value, _LEAF_TYPES):
        return
    elif inspect.isclass(value) or inspect.ismodule(value):
        return  # a class as a value (``type[X]`` options) is not called by the config
    elif isinstance(value, (list, tuple, set, frozenset)):
        item = _item_hint(hint)
        for index, element in enumerate(value):
            _check(element, item, f"{key}[{index}]", None, allowed, raw=raw)
    elif isinstance(value, Mapping) or _is_namespace(value):
        items = value.items() if isinstance(value, Mapping) else vars(value).items()
        for name, element in items:
            _check(element, _value_hint(hint, name), f"{key}.{name}", None, allowed, raw=raw)
    elif callable(value):
        if value is default or _is_allowed(value, allowed):
            return
        bases = _bases(hint)
        if bases and not _is_routine(value) and isinstance(value, bases):
            return  # an importable instance of the declared base: nothing is called to get it
        raise _Refused(_refusal(key, _import_path(value), value, bases, hint))


def _check_spec(spec: Any, hint: Any, key: str, allowed: Sequence[Any], *, raw: bool) -> None:
    path = str(spec["class_path"])
    bases = _bases(hint)
    target = resolve(path, bases)
    if target is None:
        if raw:
            return  # jsonargparse's own error says it cannot be imported
        raise _Refused(
            f"{key}: class_path {path} cannot be imported, so it cannot be checked against "
            f"{_names(bases) or 'a base class'}. Give the full import path of a class."
        )
    subclass = bool(bases) and inspect.isclass(target) and _is_subclass(target, bases)
    if not subclass and not _is_allowed(target, allowed):
        raise _Refused(_refusal(key, path, target, bases, hint))
    init_args = _get(spec, "init_args")
    if init_args:
        parameters = _parameters(target)
        items = init_args.items() if isinstance(init_args, Mapping) else vars(init_args).items()
        for name, element in items:
            element_hint, element_default = parameters.get(name, (Any, None))
            _check(element, element_hint, f"{key}.init_args.{name}", element_default, allowed, raw=raw)
    extra = _get(spec, "dict_kwargs")
    if extra:
        _check(dict(extra), Any, f"{key}.dict_kwargs", None, allowed, raw=raw)


def _refusal(key: str, path: str, target: Any, bases: tuple[type, ...], hint: Any) -> str:
    if not bases:
        found = (
            f"{path} is refused: the type of {key} ({_type_name(hint)}) declares no base class to "
            f"check it against"
        )
    elif inspect.isclass(target):
        found = f"{path} is not a subclass of {_names(bases)}"
    else:
        found = f"{path} is {_kind(target)}, not a subclass of {_names(bases)}"
    fix = "" if bases else f"Give plain data at {key}, or type that option with its values' base class. "
    return (
        f"{key}: {found}. Nothing was called: a config is data, so its class paths name classes of the "
        f"declared type only. {fix}To let a config name this callable on purpose (a factory), allow it "
        f"in the script: TrainerCLI(..., allow_callables=[{path!r}])."
    )


def _kind(target: Any) -> str:
    if isinstance(target, functools.partial):
        return "a functools.partial"
    if inspect.isbuiltin(target):
        return "a built-in function"
    if inspect.isroutine(target):
        return "a function"
    return f"an object of type {type(target).__name__}"


def _is_routine(value: Any) -> bool:
    return inspect.isroutine(value) or isinstance(value, functools.partial)


def _is_allowed(target: Any, allowed: Sequence[Any]) -> bool:
    return any(target is entry for entry in allowed)


def _is_spec(value: Any) -> bool:
    if isinstance(value, Mapping):
        return "class_path" in value and isinstance(value["class_path"], str)
    return _is_namespace(value) and isinstance(getattr(value, "class_path", None), str)


def _is_namespace(value: Any) -> bool:
    return type(value).__name__ == "Namespace" and hasattr(value, "__dict__")


def _get(spec: Any, name: str) -> Any:
    return spec.get(name) if isinstance(spec, Mapping) else getattr(spec, name, None)


def _bases(hint: Any) -> tuple[type, ...]:
    """The classes a class path at a position typed ``hint`` must subclass (none for ``Any``)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Annotated:
        return _bases(args[0])
    if origin is typing.Union or origin is types.UnionType:
        return tuple(dict.fromkeys(base for arg in args for base in _bases(arg)))
    if origin is collections.abc.Callable:
        return _bases(args[-1]) if args else _NO_BASES
    if origin is not None or not isinstance(hint, type):
        return _NO_BASES  # containers, Literal, type[X], Any, forward references
    if hint in _LEAF_TYPES or hint is object or hint.__module__ in ("builtins", "collections.abc", "typing"):
        return _NO_BASES
    return (hint,)


def _accepts_text(hint: Any) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Annotated:
        return _accepts_text(args[0])
    if origin is typing.Union or origin is types.UnionType:
        return any(_accepts_text(arg) for arg in args)
    return hint is str or hint is Any or hint is object


def _item_hint(hint: Any) -> Any:
    """The type of the items of a list at a position typed ``hint``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Annotated:
        return _item_hint(args[0])
    if origin is typing.Union or origin is types.UnionType:
        items = [_item_hint(arg) for arg in args if _is_sequence_type(arg)]
        return _union(items)
    if origin is tuple:
        kept = [arg for arg in args if arg is not Ellipsis]
        return _union(kept)
    if origin is not None and _is_sequence_type(hint) and args:
        return args[0]
    return Any


def _union(hints: list[Any]) -> Any:
    """``Union[hints]`` (built from a list, which the ``X | Y`` syntax cannot), ``Any`` for none."""
    return typing.Union[tuple(hints)] if hints else Any  # noqa: UP007


def _is_sequence_type(hint: Any) -> bool:
    origin = typing.get_origin(hint) or hint
    iterable = isinstance(origin, type) and issubclass(origin, collections.abc.Iterable)
    return iterable and origin not in (str, bytes)


def _value_hint(hint: Any, name: str) -> Any:
    """The type of the value under ``name`` of a mapping at a position typed ``hint``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Annotated:
        return _value_hint(args[0], name)
    if origin is typing.Union or origin is types.UnionType:
        values = [_value_hint(arg, name) for arg in args if _is_mapping_type(arg) or _bases(arg)]
        return _union(values)
    if origin is not None and _is_mapping_type(hint) and len(args) == 2:
        return args[1]
    bases = _bases(hint)
    if len(bases) == 1:  # a mapping where a class is expected: its init args (implicit class_path)
        return _parameters(bases[0]).get(name, (Any, None))[0]
    return Any


def _is_mapping_type(hint: Any) -> bool:
    origin = typing.get_origin(hint) or hint
    return isinstance(origin, type) and issubclass(origin, collections.abc.Mapping)


def _is_subclass(target: type, bases: tuple[type, ...]) -> bool:
    try:
        return issubclass(target, bases)
    except TypeError:  # a base that is a non-runtime Protocol
        return False


def _parameters(target: Any) -> dict[str, tuple[Any, Any]]:
    """``name -> (type hint, default)`` of what calling ``target`` takes (a class: its ``__init__``)."""
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return {}
    try:
        hints = typing.get_type_hints(target.__init__ if inspect.isclass(target) else target)
    except Exception:  # an annotation that does not resolve: such parameters count as Any
        hints = {}
    found: dict[str, tuple[Any, Any]] = {}
    for name, parameter in signature.parameters.items():
        annotation = hints.get(name, parameter.annotation)
        if annotation is inspect.Parameter.empty or isinstance(annotation, str):
            annotation = Any
        default = None if parameter.default is inspect.Parameter.empty else parameter.default
        found[name] = (annotation, default)
    return found


def resolve(path: str, bases: tuple[type, ...]) -> Any:
    """What ``path`` names: an import path, or a class name jsonargparse resolves among the
    subclasses of ``bases`` (``SGD``); ``None`` when it names nothing."""
    if "." not in path:
        for base in bases:
            found = _subclass_named(base, path)
            if found is not None:
                return found
        return None
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            target: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attribute in parts[cut:]:
                target = getattr(target, attribute)
        except AttributeError:
            return None
        return target
    return None


def _subclass_named(base: type, name: str) -> type | None:
    return next((cls for cls in _subclasses(base) if cls.__name__ == name), None)


def public_path(obj: Any) -> str:
    """``torch.optim.Optimizer`` rather than ``torch.optim.optimizer.Optimizer``: the shortest
    module path that exports ``obj`` under its name. Local."""
    module, name = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not module or not name:
        return repr(obj)
    parts = module.split(".")
    for cut in range(1, len(parts)):
        parent = ".".join(parts[:cut])
        try:
            if getattr(importlib.import_module(parent), name, None) is obj:
                return f"{parent}.{name}"
        except ImportError:
            continue
    return f"{module}.{name}"


def _import_path(obj: Any) -> str:
    if isinstance(obj, functools.partial):
        return "functools.partial"
    return public_path(obj)


def _names(bases: tuple[type, ...]) -> str:
    return " or ".join(public_path(base) for base in bases)
