"""The resolved run configuration (``trainer.run_config``, set by :class:`distkit.TrainerCLI`) travels
with the run: every rank checks it holds the same one, the main process saves it beside the
checkpoints as ``<default_root_dir>/config.yaml``, and a resume checks it against the saved one.

Policy on resume (``docs/config.md``, "Resuming"): a changed ``model.*`` key, or another optimizer or
scheduler class, is refused before the checkpoint is loaded (the checkpoint holds the old model's
weights and the old optimizer's state, and silently training another model from them is the
mistake a config file makes easy). Any other change (``trainer.max_epochs``, ``data.*``, the
learning rate) is a warning listing old and new values: extending a run or lowering its learning
rate are what a resume is for.

Credentials never reach a file or a tracker: what is written (``config.yaml``), logged (the
hyperparameters) or compared (across ranks, on resume) is the configuration after
:func:`distkit._utils.secrets.redact_data`, the redaction of distkit's own messages (a URL's user part and
query values, values under credential names). The saved file is compared with the redacted new one,
so a rotated token is no change of the run. ``config.yaml`` has the checkpoints' mode (owner only,
``docs/config.md``).

Without a ``run_config`` (a Trainer built in Python) nothing here runs and nothing is written.
PyYAML is imported only then: it comes with jsonargparse (``distkit[config]``).
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distkit import runtime
from distkit._utils.fs import atomic_open
from distkit._utils.secrets import redact_data, redact_url
from distkit.checkpoint._commit import DEFAULT_FILE_MODE
from distkit.collectives import all_gather_object, broadcast_object
from distkit.errors import DistkitError
from distkit.trainer._run import checkpoint_callback

if TYPE_CHECKING:
    from distkit.trainer._run import Options

__all__: list[str] = []

_log = runtime.get_logger("distkit.trainer", main_process_only=True)

#: Name of the saved configuration, in the Trainer's ``default_root_dir``.
CONFIG_FILENAME = "config.yaml"

# Keys whose change is not a change of the run: how to resume, and how progress is shown.
_IGNORED = frozenset({"trainer.resume", "trainer.enable_progress_bar"})

_MISSING = "<absent>"

_HEADER = (
    "# The resolved configuration of this run, written by distkit.TrainerCLI (main process).\n"
    "# Credentials are *** here (URLs' user parts and query values, values under credential names):\n"
    "# give them again when you run it with: python <script> --config config.yaml\n"
)


def get_run_config(trainer: Options) -> dict[str, Any] | None:
    """The run configuration the Trainer carries, or ``None``. Local.

    Redacted (:func:`distkit._utils.secrets.redact_data`): this is the configuration as it is saved,
    logged and compared; the Trainer's own objects keep the real values.
    """
    config = getattr(trainer, "run_config", None)
    if config is not None and not isinstance(config, Mapping):
        raise TypeError(
            f"trainer.run_config must be a dict of the resolved configuration or None, got "
            f"{type(config).__name__}."
        )
    return None if config is None else redact_data(dict(config))


def config_path(trainer: Options) -> Path:
    """Where the run's configuration is saved: ``<default_root_dir>/config.yaml``. Local."""
    return Path(trainer.default_root_dir) / CONFIG_FILENAME


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings as one level of dotted keys: ``{"model": {"hidden": 8}}`` ->
    ``{"model.hidden": 8}``. Lists stay values. Local.

    Example:
        >>> flatten({"model": {"hidden": 8}, "optimizer": {"class_path": "torch.optim.SGD"}})
        {'model.hidden': 8, 'optimizer.class_path': 'torch.optim.SGD'}
    """
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def diff(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``dotted key -> (old, new)`` for every key whose value differs (``"<absent>"`` for a key one
    side lacks), ignoring ``trainer.resume`` and ``trainer.enable_progress_bar``. Local.

    Example:
        >>> diff({"model": {"hidden": 8}}, {"model": {"hidden": 16}})
        {'model.hidden': (8, 16)}
    """
    flat_old, flat_new = flatten(old), flatten(new)
    changed: dict[str, tuple[Any, Any]] = {}
    for key in sorted(set(flat_old) | set(flat_new)):
        if key in _IGNORED:
            continue
        before, after = flat_old.get(key, _MISSING), flat_new.get(key, _MISSING)
        if _canonical(before) != _canonical(after):
            changed[key] = (before, after)
    return changed


def is_refused(key: str) -> bool:
    """Whether a change of ``key`` refuses a resume: the model's arguments, the class of the
    optimizer, and the scheduler (class and arguments: a restored scheduler takes its settings back
    from the checkpoint, so new ones would be shown as applied and silently ignored). Local."""
    return (
        key == "model"
        or key.startswith("model.")
        or key in ("optimizer", "optimizer.class_path", "lr_scheduler")
        or key.startswith("lr_scheduler.")
    )


_OPTIMIZER_ARGS = "optimizer.init_args."


def check_ranks_agree(trainer: Options) -> None:
    """Fail on every rank when the ranks hold different run configurations.

    Call it right after the process group is up, before DDP compares the parameters' shapes (a
    differing ``model.*`` would otherwise fail there, and a differing learning rate nowhere).
    Collective when the Trainer carries a ``run_config`` (every rank of a job made by
    :class:`distkit.TrainerCLI` does, as every rank runs the same script); a no-op without one or
    without a process group. Under ``torchrun`` and ``srun`` each rank parses its own command
    line and config files: a file that differs between nodes, or an option read from a per-rank
    environment variable, would train each rank with another configuration.

    Raises:
        DistkitError: On every rank: the ranks that differ from rank 0, with the keys and values.
    """
    config = get_run_config(trainer)
    if config is None or runtime.get_world_size() == 1:
        return
    everyone = all_gather_object(config)
    reference = everyone[0] or {}
    lines = []
    for rank, other in enumerate(everyone[1:], start=1):
        for key, (want, got) in diff(reference, other or {}).items():
            lines.append(f"  rank {rank}: {key} = {_shown(got)} (rank 0: {_shown(want)})")
    if lines:
        raise DistkitError(
            "the ranks parsed different configurations:\n"
            + "\n".join(lines[:20])
            + ("\n  ..." if len(lines) > 20 else "")
            + "\nEvery rank must get the same command line and the same config files (under torchrun "
            "and srun each rank parses its own): start every rank with the same arguments, make "
            "the config files identical on every node, and read no option from a per-rank "
            "environment variable."
        )


def check_resume(trainer: Options) -> list[str]:
    """Before the checkpoint is restored: refuse a resume of this run with a changed model
    configuration; return the optimizer settings the new configuration changed.

    Collective: call on every rank, after the checkpoint callback is set up and before the
    restore. The main process reads the saved ``config.yaml`` and decides; every rank raises the
    same error, or gets the same names (``["lr"]``), whose new values the caller puts into the
    restored optimizer (the checkpoint's state holds the old ones). A no-op without a
    ``run_config``.

    Raises:
        DistkitError: The resume would continue a run whose ``model.*`` keys, optimizer class or
            scheduler differ: the message lists the keys with their old and new values, and how
            to go on.

    Example:
        >>> check_resume(trainer)  # doctest: +SKIP
        ['lr']
    """
    config = get_run_config(trainer)
    if config is None:
        return []
    verdict = _verdict(trainer, config) if runtime.is_main_process() else None
    if runtime.get_world_size() > 1:
        verdict = broadcast_object(verdict)
    error, changed = verdict or (None, [])
    if error is not None:
        raise DistkitError(error)
    return changed


def save(trainer: Options, resumed_from: int | None) -> None:
    """After the restore: warn about the changed keys of a resumed run, and write ``config.yaml``.

    Local: the main process writes (atomically), the others do nothing. A no-op without a
    ``run_config``.

    Example:
        >>> save(trainer, resumed_from=None)  # doctest: +SKIP
    """
    config = get_run_config(trainer)
    if config is None or not runtime.is_main_process():
        return
    path = config_path(trainer)
    if resumed_from is not None and _continues_run(trainer):
        previous = _read(path)
        if previous is not None:
            changed = diff(previous, config)
            if changed:
                _log.warning(
                    "resuming at step %d with a configuration that differs from the one the run "
                    "started with (%s):\n%s\nGoing on with the new values; %s now holds them.",
                    resumed_from,
                    path,
                    _listing(changed),
                    CONFIG_FILENAME,
                )
    write(path, config)


def write(path: Path, config: Mapping[str, Any]) -> None:
    """Write ``config`` as YAML at ``path``, atomically (a reader never sees half a file), its
    credentials redacted, readable by the owner only. Local."""
    import yaml

    path.parent.mkdir(parents=True, exist_ok=True)
    data = redact_data(json.loads(json.dumps(dict(config), default=str)))
    text = _HEADER + yaml.safe_dump(data, sort_keys=False)
    # The checkpoints' mode (owner only): the one rule of the files distkit writes in a run
    # directory (docs/config.md, "Credentials and file modes").
    with atomic_open(path, mode=DEFAULT_FILE_MODE) as handle:
        handle.write(text.encode())


def hyperparams(trainer: Options, derived: Mapping[str, Any]) -> dict[str, Any]:
    """What the loggers record (``hparams.json``): the full run configuration, with what the
    Trainer derived at set-up (world size, effective batch size, ...) under ``"run"``; only the
    derived values without a ``run_config``. Local.

    Example:
        >>> hyperparams(trainer, {"world_size": 2})  # doctest: +SKIP
        {'model': {...}, 'data': {...}, 'optimizer': {...}, 'trainer': {...}, 'run': {'world_size': 2}}
    """
    config = get_run_config(trainer)
    if config is None:
        return redact_data(dict(derived))  # type: ignore[no-any-return]
    return {**copy.deepcopy(config), "run": redact_data(dict(derived))}


def _verdict(trainer: Options, config: Mapping[str, Any]) -> tuple[str | None, list[str]] | None:
    """For a resume that continues this run: the refusal's message when its model configuration
    (or its optimizer's class, or its scheduler) changed, and the optimizer settings that changed."""
    if trainer.resume is None or not _continues_run(trainer):
        return None
    path = config_path(trainer)
    previous = _read(path)
    if previous is None:
        return None
    changed = diff(previous, config)
    refused = {key: values for key, values in changed.items() if is_refused(key)}
    settings = [key[len(_OPTIMIZER_ARGS) :] for key in changed if key.startswith(_OPTIMIZER_ARGS)]
    if not refused:
        return None, settings
    checkpoint = _checkpoint_to_resume(trainer)
    if checkpoint is None:  # nothing to resume from: a fresh start, whatever config.yaml says
        return None
    first_key, (old_value, _) = next(iter(refused.items()))
    root = os.fspath(trainer.default_root_dir)
    resume = redact_url(str(trainer.resume))
    what = "model configuration" if any(k.startswith("model") for k in refused) else "configuration"
    return (
        f"resume={resume!r} continues the run in {redact_url(root)} (from {redact_url(checkpoint)}), "
        f"but the {what} changed since that run started ({path}):\n"
        f"{_listing(refused)}\n"
        f"The checkpoint holds the old model's weights, optimizer state and scheduler state (whose "
        f"settings a restore puts back). To continue that run, give the old values back (e.g. "
        f"{_flag(first_key, old_value)}); to train with the changed values, start a new run in "
        f"another directory (e.g. --trainer.default_root_dir {root.rstrip('/')}-2).",
        settings,
    )


def _continues_run(trainer: Options) -> bool:
    """Whether ``trainer.resume`` continues the run of this ``default_root_dir`` (not a new run
    started from another run's weights)."""
    from distkit.trainer._loop.state import _is_inside

    resume = trainer.resume
    if resume is None:
        return False
    if resume == "auto":
        return True
    checkpoint = checkpoint_callback(trainer.callbacks)
    inside_checkpoints = (
        checkpoint is not None
        and checkpoint.directory is not None
        and _is_inside(resume, checkpoint.directory)
    )
    return inside_checkpoints or _is_inside(resume, trainer.default_root_dir)


def _checkpoint_to_resume(trainer: Options) -> str | None:
    """The checkpoint the restore will load, or ``None`` when ``resume="auto"`` finds none."""
    if trainer.resume != "auto":
        return trainer.resume
    checkpoint = checkpoint_callback(trainer.callbacks)
    if checkpoint is None or checkpoint.manager is None:
        return None  # the restore itself says that resume="auto" needs checkpointing
    return checkpoint.manager.latest()  # type: ignore[no-any-return]


def _read(path: Path) -> dict[str, Any] | None:
    """The saved configuration, or ``None`` when there is none (or it cannot be read: warned)."""
    if not path.exists():
        return None
    import yaml

    try:
        with open(path, encoding="utf-8") as handle:
            loaded = yaml.safe_load(handle)
    except (OSError, yaml.YAMLError) as err:
        _log.warning("cannot read the saved configuration %s (%s); not comparing with it", path, err)
        return None
    return loaded if isinstance(loaded, dict) else None


def _listing(changed: Mapping[str, tuple[Any, Any]]) -> str:
    return "\n".join(f"  {key}: {_shown(old)} -> {_shown(new)}" for key, (old, new) in changed.items())


def _flag(key: str, value: Any) -> str:
    """The command-line option that sets ``key`` back to ``value``."""
    if key.endswith(".class_path"):
        key = key[: -len(".class_path")]
    key = key.replace(".init_args.", ".")
    return f"--{key} {_shown(value)}"


def _shown(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, default=str)


def _canonical(value: Any) -> str:
    # YAML and JSON agree on these; tuples and lists compare alike.
    return json.dumps(value, sort_keys=True, default=str)
