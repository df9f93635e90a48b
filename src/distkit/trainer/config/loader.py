"""How :class:`distkit.TrainerCLI` reads YAML: as jsonargparse does, but refusing what a careless
config means otherwise than it says. Local.

- **A duplicate key** (``max_epochs:`` twice in one ``trainer:``, or two ``model:`` sections): PyYAML
  keeps the last and drops the first without a word.
- **``${NAME}`` in a value** (``default_root_dir: ${SCRATCH}/runs``): nothing expands it, so the run
  would use the text itself (a directory named ``${SCRATCH}``). distkit does not expand variables
  either: what a config says is what runs, and ``config.yaml`` records it.

- **A YAML 1.1 boolean word for a text option** (``model.activation: on``, ``name: no``): PyYAML
  reads ``yes``/``no``/``on``/``off`` unquoted as true and false, which jsonargparse refuses as
  "expected str, got 'True'", a value the file does not hold.

Each is refused naming the key, the file and the line. :func:`check_command_line` checks the files a
command line names (``--config run.yaml``, a section's own file: ``--data data.yaml``, or
``trainer: trainer.yaml`` in a config file) before jsonargparse reads them, naming each key in
full; the loader registered by :func:`parser_mode` checks every YAML text jsonargparse loads for
the parser (any other file, YAML given as a value on the command line), so none is left out.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from distkit.trainer.config.errors import config_files, shown

__all__: list[str] = []

#: The jsonargparse ``parser_mode`` under which :func:`load` is registered.
MODE = "distkit_yaml"

# ``${NAME}`` as a shell, docker compose or OmegaConf writes it (``${oc.env:X}``, ``${model.hidden}``).
_VARIABLE = re.compile(r"\$\{[^{}\s]+\}|\$[A-Za-z_]\w*")
_MERGE_TAG = "tag:yaml.org,2002:merge"
_STR_TAG = "tag:yaml.org,2002:str"
_BOOL_TAG = "tag:yaml.org,2002:bool"


class ConfigRefused(Exception):
    """A config text that reads as something else than it says; the message names the key, the file,
    the line and the fix. Not a loader error of jsonargparse's: it must not be taken for a plain
    string and parsed on."""


def parser_mode() -> str:
    """Register :func:`load` with jsonargparse (once; under its own mode name, so other parsers keep
    plain ``yaml``) and return the mode for ``ArgumentParser(parser_mode=...)``. Local."""
    from jsonargparse import get_loader, set_loader

    with contextlib.suppress(ValueError, KeyError):
        if get_loader(MODE) is load:
            return MODE
    import yaml

    set_loader(MODE, load, (yaml.YAMLError,))
    return MODE


def load(text: str, path: str = "") -> Any:
    """jsonargparse's YAML loader, after :func:`check_text` of a whole file: ``path`` when
    jsonargparse names it, else the regular file it is loading when ``text`` is all of it (a
    section's own file). jsonargparse also loads each string value through this loader, to see
    whether it holds YAML: such a text is a value (``name: "{a: 1, a: 2}"``), not a config, and is
    left as it is (the file or command line it came from was checked whole)."""
    from jsonargparse import get_loader

    where = str(path) if path else _loading_file()
    if where is not None and (path or _whole_file(where, text)):
        # Duplicate keys only: variables were looked for before parsing, in every file the command
        # line names, with the script's defaults exempt (a saved config.yaml holds them).
        check_text(text, where=where, variables=False)
    return get_loader("yaml")(text)


def _whole_file(path: str, text: str) -> bool:
    """Whether ``text`` is the whole of the regular file at ``path``."""
    try:
        stat = os.stat(path)
        return _file_text(path, stat.st_mtime_ns, stat.st_size) == text
    except (OSError, UnicodeDecodeError):
        return False


@functools.lru_cache(maxsize=16)
def _file_text(path: str, mtime_ns: int, size: int) -> str:
    """The text of a config file, read once per version: jsonargparse loads each string value of a
    file through the loader too, which asks :func:`_whole_file` each time."""
    with open(path, encoding="utf-8") as handle:
        return handle.read()


def check_command_line(
    argv: list[str],
    sections: Iterable[str],
    defaults: Mapping[str, Any] | None = None,
    text_options: Iterable[str] = (),
) -> None:
    """Refuse a duplicate key or a ``${NAME}`` in the config files of ``argv`` (``--config FILE``, and
    a section's own file: ``--data data.yaml``, or ``trainer: trainer.yaml`` in a config file, for a
    section in ``sections``) and a ``${NAME}`` in its values, before jsonargparse reads them, and a
    duplicate key in a mapping or list given as an option's value (``--optimizer '{...}'``), but
    for the ``text_options``, whose values are text (:class:`ConfigRefused`). A value equal to its
    key's default in ``defaults`` (flat, dotted keys) is the script's own, and not refused: a saved
    ``config.yaml`` or ``--print_config`` holds it. Local."""
    sections = set(sections)
    defaults = defaults or {}
    text = set(text_options)
    check_arguments(argv, defaults)
    for path in config_files(argv):
        check_file(path, defaults=defaults, text_options=text)
        for section, nested in _section_files(path, sections):
            check_file(nested, prefix=section, defaults=defaults, text_options=text)
    for index, argument in enumerate(argv):
        option, equals, value = argument.partition("=")
        if not option.startswith("--") or option in ("--config", "--print_config"):
            continue
        if not equals:
            value = argv[index + 1] if index + 1 < len(argv) else ""
        key = option[2:]
        if key in sections and os.path.isfile(value):
            check_file(value, prefix=key, defaults=defaults)
        elif key not in text and value.lstrip()[:1] in ("{", "["):
            # A mapping or a list: --trainer '{max_epochs: 3, max_epochs: 5}', --optimizer '{...}'.
            check_text(value, where="a value on the command line", prefix=key, variables=False)


def check_file(
    path: str,
    *,
    prefix: str = "",
    defaults: Mapping[str, Any] | None = None,
    text_options: Iterable[str] = (),
) -> None:
    """Refuse a duplicate key or a ``${NAME}`` in the YAML file at ``path``, whose keys are under
    ``prefix`` (``data`` for ``--data data.yaml``), a boolean word for one of the ``text_options``,
    or a file that is not UTF-8 text (:class:`ConfigRefused`); a file that cannot be read or is not
    YAML is left to the caller. Local."""
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except UnicodeDecodeError as err:
        raise ConfigRefused(
            f"the config file {path} is not UTF-8 text (byte {err.object[err.start]:#04x} at offset "
            f"{err.start}); save it as UTF-8."
        ) from None
    except OSError:
        return
    check_text(text, where=path, prefix=prefix, defaults=defaults, text_options=text_options)


def _section_files(path: str, sections: set[str]) -> list[tuple[str, str]]:
    """``(section, file)`` for each section the config file at ``path`` gives as the path of a file
    (``trainer: trainer.yaml``; jsonargparse reads it relative to ``path``)."""
    import yaml

    try:
        with open(path, encoding="utf-8") as handle:
            data = yaml.safe_load(handle)
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return []
    if not isinstance(data, dict):
        return []
    found = []
    for section, value in data.items():
        if section in sections and isinstance(value, str):
            nested = os.path.join(os.path.dirname(path), value)
            if os.path.isfile(nested):
                found.append((section, nested))
    return found


def check_arguments(argv: list[str], defaults: Mapping[str, Any] | None = None) -> None:
    """Refuse a ``${NAME}`` in a value on the command line (:class:`ConfigRefused`): the shell did
    not expand it (single quotes, or a launcher that runs no shell), and distkit does not; unless
    the value is its option's default in ``defaults``. Local."""
    for index, argument in enumerate(argv):
        found = _variable_in(argument)
        if found is None:
            continue
        option, equals, value = argument.partition("=")
        if not (equals and option.startswith("-")):
            option, value = (argv[index - 1], argument) if index else ("", argument)
        if _is_default(option.lstrip("-"), value, defaults or {}) or _variable_in(value) is None:
            continue
        if not option.startswith("-"):
            option = "the option"
        variable = found
        raise ConfigRefused(
            f"{option} is {shown(value)} on the command line: {variable} was not expanded (the shell "
            f"leaves it in single quotes, and a launcher that runs no shell leaves it as it is), and "
            f"distkit does not expand it, so the run would use that text as it is. Write the value out, "
            f'or let the shell expand it in double quotes: {option} "{_shell(value, variable)}".'
        )


def check_text(
    text: str,
    *,
    where: str,
    prefix: str = "",
    defaults: Mapping[str, Any] | None = None,
    variables: bool = True,
    text_options: Iterable[str] = (),
) -> None:
    """Raise :class:`ConfigRefused` for the first duplicate key of the YAML ``text`` (from ``where``,
    a file; its keys under ``prefix``), or with ``variables`` its first ``${NAME}`` value that is not
    its key's default in ``defaults``, or a boolean word (``yes``, ``off``) given for one of the
    ``text_options``; YAML that does not parse is left to the loader. Local."""
    import yaml

    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return
    if node is not None:
        checks = _Checks((defaults or {}) if variables else None, frozenset(text_options))
        _walk(node, prefix, where, checks, set())


class _Checks(NamedTuple):
    """What :func:`_walk` checks besides duplicate keys: ``${NAME}`` values unless they are their
    key's default (``defaults``; ``None``: not looked for), and boolean words for ``text`` options."""

    defaults: Mapping[str, Any] | None
    text: frozenset[str]


def _variable_in(value: str) -> str | None:
    """The first variable in ``value`` that a shell would have expanded: ``${NAME}``, or ``$NAME``
    for a variable set in this environment (``$HOME``, ``$SCRATCH``; an unset ``$name`` may be a
    template's, as in ``string.Template``)."""
    for found in _VARIABLE.finditer(value):
        text = found.group(0)
        if text.startswith("${") or text[1:] in os.environ:
            return text
    return None


def _is_default(key: str, value: Any, defaults: Mapping[str, Any]) -> bool:
    """Whether ``value`` is the default of ``key`` (``model.fmt``, or
    ``optimizer.init_args.lr`` as ``optimizer.lr``)."""
    for name in (key, key.replace(".init_args.", ".")):
        if name in defaults and defaults[name] == value:
            return True
    return False


def _walk(node: Any, key: str, where: str, checks: _Checks, seen: set[int]) -> None:
    """Check ``node`` and what is under it."""
    import yaml

    if id(node) in seen:  # an alias of a node already checked
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        first_line: dict[tuple[str, str], int] = {}
        for key_node, value_node in node.value:
            name = str(key_node.value) if isinstance(key_node, yaml.ScalarNode) else "?"
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != _MERGE_TAG:
                line, pair = key_node.start_mark.line + 1, (key_node.tag, name)
                if pair in first_line:
                    section = isinstance(value_node, yaml.MappingNode)
                    earlier = first_line[pair]
                    raise ConfigRefused(_duplicate(_join(key, name), where, earlier, line, section=section))
                first_line[pair] = line
            _walk(value_node, _join(key, name), where, checks, seen)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _walk(item, f"{key}[{index}]", where, checks, seen)
    elif checks.defaults is not None and isinstance(node, yaml.ScalarNode) and node.tag == _STR_TAG:
        found = _variable_in(str(node.value))
        if found is not None and not _is_default(key, str(node.value), checks.defaults):
            line = node.start_mark.line + 1
            raise ConfigRefused(_variable(key, str(node.value), found, where, line))
    elif (
        isinstance(node, yaml.ScalarNode)
        and node.tag == _BOOL_TAG
        and str(node.value).lower() not in ("true", "false")
        and key.replace(".init_args.", ".") in checks.text
    ):
        raise ConfigRefused(_boolean_word(key, str(node.value), where, node.start_mark.line + 1))


def _join(key: str, name: str) -> str:
    return f"{key}.{name}" if key else name


def _duplicate(key: str, where: str, first: int, second: int, *, section: bool) -> str:
    lines = f"lines {first} and {second}" if first != second else f"line {first}, twice"
    name = key.rpartition(".")[2]
    fix = f"Merge the two {name}: sections into one" if section else f"Keep one of the two {name}: values"
    return (
        f"duplicate key {key} in {where} ({lines}): YAML would keep the last and drop the first without "
        f"a word. {fix}."
    )


def _variable(key: str, value: str, variable: str, where: str, line: int) -> str:
    option = key.replace(".init_args.", ".") or "KEY"
    return (
        f"{key or 'the value'} in {where} (line {line}) is {shown(value)}: {variable} is not expanded "
        f"in a config file (distkit expands no variables: what the file says is what runs), so the run "
        f"would use that text as it is. Write the value out in the file, or take it out of the file and "
        f'give it on the command line, where the shell expands it: --{option} "{_shell(value, variable)}".'
    )


def _boolean_word(key: str, word: str, where: str, line: int) -> str:
    meant = "true" if word.lower() in ("yes", "on") else "false"
    name = key.rpartition(".")[2]
    return (
        f"{key} in {where} (line {line}) is {word} unquoted, which YAML reads as the boolean {meant}, "
        f'not as text, and this option takes text. Quote it for the text: {name}: "{word}".'
    )


def _shell(value: str, variable: str) -> str:
    """``value`` with ``${NAME}`` as a shell expands it in double quotes (``$NAME``); a ``$NAME``
    stays as it is."""
    name = variable[2:-1] if variable.startswith("${") else ""
    return value.replace(variable, f"${name}") if re.fullmatch(r"[A-Za-z_]\w*", name) else value


def _loading_file() -> str | None:
    """The config file jsonargparse is loading, from its (private) load stack; ``None`` when none
    is, or when this jsonargparse keeps no such stack (then the message names no file)."""
    with contextlib.suppress(ImportError, AttributeError, LookupError, TypeError, IndexError):
        stack = importlib.import_module("jsonargparse._util").config_load_stack.get()
        if stack:
            return str(stack[-1][1])
    return None
