"""A command line and config files for a training script, read from type hints by jsonargparse.

:class:`TrainerCLI` is the one entry point: it turns the script's model and data classes (or
functions), an optimizer and scheduler choice, and :class:`distkit.Trainer`'s keyword arguments into
``--config run.yaml`` files (several, later ones win), dotted overrides (``--trainer.max_epochs 5
--model.hidden 256``), ``--print_config`` and ``--help``, then runs ``trainer.fit``. The parsing,
type checking, YAML and ``--help`` are jsonargparse's (the library under LightningCLI; why it and
not a config system of our own: ``docs/config.md``). What is ours: the option layout, clearer
errors, one output per job under a launcher, and the resolved configuration carried by the Trainer
(``trainer.run_config``), which every rank checks alike, the main process saves beside the
checkpoints, and a resume compares (:mod:`distkit.trainer.config.run_config`).

This module imports jsonargparse, an optional extra: ``pip install 'distkit[config]'``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import io
import os
import posixpath
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal, NoReturn

import torch
from torch import nn

try:
    from jsonargparse import ActionConfigFile, ArgumentParser, Namespace
except ImportError as _err:  # pragma: no cover - depends on the environment
    raise ImportError(
        "distkit.TrainerCLI needs jsonargparse: pip install 'distkit[config]' "
        "(or pip install 'jsonargparse[signatures]')."
    ) from _err

from distkit import runtime
from distkit._utils.secrets import Scrubber, redact_url
from distkit.checkpoint._errors import ForeignCheckpointError
from distkit.seeding import seed_everything
from distkit.trainer.config import errors as _config_errors, loader as _config_loader
from distkit.trainer.trainer import Trainer

__all__ = ["TrainerCLI"]

# Trainer attributes set by code, not by a command line (and kwargs a later Trainer may add for it).
_TRAINER_SKIP = {"run_config", "config"}

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]


class TrainerCLI:
    """Build a run from the command line and config files, then train it.

    The options come from type hints and docstrings (jsonargparse reads them), under one prefix
    each: ``model.*`` (the arguments of ``model``), ``data.*`` (of ``data``), ``optimizer`` (a class
    path and its init args, as LightningCLI's: ``--optimizer SGD --optimizer.lr 0.1``),
    ``lr_scheduler`` (likewise, or ``null``), ``scheduler_interval`` and ``trainer.*``
    (:class:`distkit.Trainer`'s keyword arguments). ``-c/--config FILE`` reads YAML files (several
    allowed, later ones win; command-line options after them win over them), ``--print_config``
    prints the resolved YAML and exits, ``--help`` lists every option with type, default and
    docstring. With ``trainer.seed`` set, ``seed_everything(seed)`` runs before the model and data
    are built, so every rank (and every run) starts from the same weights.

    Local: parsing and building communicate nothing. Under ``torchrun`` or ``srun`` every rank
    parses its own command line (``--help``, ``--print_config`` and parse errors print on rank 0
    only, errors on every rank with ``[rank R/W]``); ``fit`` then checks that every rank holds the
    same configuration and fails on every rank naming the keys that differ. Under plain ``python``
    with ``--trainer.strategy ddp --trainer.devices N`` the command line is parsed once and ``fit``
    sends the built objects to the processes it starts. The resolved configuration
    (:attr:`run_config`) rides on the Trainer: ``fit`` saves it as ``<default_root_dir>/config.yaml``
    (main process), logs it as the hyperparameters, and on a resume refuses a changed ``model.*``
    and warns about other changes (``docs/config.md``).

    A config is data, not code: every class path in it (``optimizer``, ``lr_scheduler``,
    ``trainer.callbacks``, ``trainer.logger``, an option typed ``nn.Module``...) must name a subclass
    of the base its key declares, checked before anything is instantiated. A function, a built-in,
    a ``functools.partial`` or any class of another type is refused (exit code 2, naming the key and
    the base), unless the script lists it in ``allow_callables``. Importing the module a class path
    names runs that module's top level, as in LightningCLI (``docs/config.md``, "What a config may
    run"). What the run writes or sends from the config (``config.yaml``, the hyperparameters, error
    messages) has its credentials redacted.

    Subclass and override :meth:`add_arguments_to_parser` to add options of your own (read them
    from :attr:`config` afterwards).

    Args:
        model: A ``torch.nn.Module`` class, or a function returning a module; its typed arguments
            become ``model.*``.
        data: A class or function whose typed arguments become ``data.*``. What it returns (or the
            instance) gives the data for ``fit``: an object with ``train_dataset()`` and optionally
            ``val_dataset()`` methods, a ``(train, val)`` tuple, or the training data alone. Each
            is a dataset (loaded and sharded by the Trainer) or a DataLoader.
        optimizer: The default optimizer: a class (``torch.optim.AdamW``), a
            ``functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)`` or a
            ``{"class_path": ..., "init_args": {...}}`` mapping. The command line may choose another.
        lr_scheduler: The default scheduler, in the same forms, or ``None`` for none.
        scheduler_interval: Default of ``scheduler_interval``: step the scheduler every optimizer
            ``"step"`` or every ``"epoch"``.
        loss_fn: ``loss_fn(output, target)`` for plain models (code, so not an option).
        metrics: Extra validation metrics of plain models, as ``Trainer.fit`` takes them.
        trainer_defaults: Defaults of the Trainer's options for this script, e.g.
            ``{"max_epochs": 10, "strategy": "ddp"}`` (still overridable).
        args: The arguments to parse; ``sys.argv[1:]`` when ``None``.
        run: Parse, build and call :meth:`fit`; ``False`` only parses and builds (call
            :meth:`fit` yourself, or use the objects).
        description: The first line of ``--help``; the main script's docstring when ``None``.
        allow_callables: Functions (or other callables, or classes of another type) that a config
            may name where a subclass of the declared base is expected, e.g. a factory
            ``make_optimizer(params) -> Optimizer`` for ``optimizer``: the objects, or their import
            paths. The script's author decides this, not the config.

    Attributes:
        parser: The jsonargparse ``ArgumentParser``.
        config: The parsed configuration (a jsonargparse ``Namespace``; ``config.trainer.max_epochs``).
        run_config: The resolved configuration as plain YAML-able data: what ``--print_config``
            shows, ``config.yaml`` holds and the loggers record.
        model: The model built from ``model.*``.
        data: What ``data`` returned.
        train_data: The training data given to ``fit``.
        val_data: The validation data given to ``fit``, or ``None``.
        trainer: The :class:`distkit.Trainer` built from ``trainer.*`` (its ``run_config`` set).
        optimizer: A function making the chosen optimizer from the parameters.
        lr_scheduler: A function making the chosen scheduler from the optimizer, or ``None``.
        scheduler_interval: ``"step"`` or ``"epoch"``.

    Raises:
        SystemExit: Code 2 after printing what is wrong with the command line or a config file: an
            unknown key (with the value given, and the keys that exist), a value of the wrong type
            (with the expected type), a missing required value, a class path that names something
            other than a subclass of its key's base, a key written twice in a config file (with
            both lines), a ``${NAME}`` in a value (expanded by no one), a ``trainer.resume`` where no
            checkpoint exists. Code 0 after ``--help`` or ``--print_config``.
        ValueError: An import path in ``allow_callables`` that does not import.
        ImportError: jsonargparse is not installed (``pip install 'distkit[config]'``).

    Example:
        >>> # train.py: python train.py --config run.yaml --trainer.max_epochs 5 --model.hidden 256
        >>> import distkit, torch
        >>> class MLP(torch.nn.Module):
        ...     def __init__(self, hidden: int = 64, dropout: float = 0.1):
        ...         super().__init__()
        ...         self.net = torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.Dropout(dropout),
        ...                                        torch.nn.Linear(hidden, 10))
        ...     def forward(self, x):
        ...         return self.net(x)
        >>> if __name__ == "__main__":
        ...     loss = torch.nn.functional.cross_entropy
        ...     distkit.TrainerCLI(MLP, load_digits, loss_fn=loss)  # doctest: +SKIP
    """

    # The command line and what it resolved to.
    parser: ArgumentParser
    config: Namespace
    run_config: dict[str, Any]

    # What was built from it: the arguments of Trainer.fit.
    model: nn.Module
    data: Any
    train_data: Any
    val_data: Any
    trainer: Trainer
    optimizer: OptimizerFactory
    lr_scheduler: SchedulerFactory | None
    scheduler_interval: str

    def __init__(
        self,
        model: type[nn.Module] | Callable[..., nn.Module],
        data: type | Callable[..., Any],
        *,
        optimizer: Any = torch.optim.AdamW,
        lr_scheduler: Any = None,
        scheduler_interval: Literal["step", "epoch"] = "step",
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        metrics: Mapping[str, Callable[[torch.Tensor, torch.Tensor], Any]] | None = None,
        trainer_defaults: Mapping[str, Any] | None = None,
        args: Sequence[str] | None = None,
        run: bool = True,
        description: str | None = None,
        allow_callables: Iterable[Callable[..., Any] | str] = (),
    ) -> None:
        if not callable(model):
            raise TypeError(f"model must be an nn.Module class or a function returning one, got {model!r}.")
        if not callable(data):
            raise TypeError(f"data must be a class or a function returning the data, got {data!r}.")
        if scheduler_interval not in ("step", "epoch"):
            raise ValueError(f"scheduler_interval must be 'step' or 'epoch', got {scheduler_interval!r}.")
        self._model_factory = model
        self._data_factory = data
        self._loss_fn = loss_fn
        self._metrics = dict(metrics) if metrics is not None else None
        self._allowed = _allowed_callables(allow_callables)

        self.parser = self._make_parser(
            description, optimizer, lr_scheduler, scheduler_interval, dict(trainer_defaults or {})
        )
        self.add_arguments_to_parser(self.parser)
        argv = list(sys.argv[1:] if args is None else args)
        self.config = self._parse(argv)
        self.run_config = self._resolved(self.config)
        self._build(argv)
        if run:
            self.fit()

    # ------------------------------------------------------------------------------------------
    # For subclasses and callers

    def add_arguments_to_parser(self, parser: ArgumentParser) -> None:
        """Add options of your own (``parser.add_argument("--tag", type=str, default="")``) or
        links (``parser.link_arguments("data.num_classes", "model.num_classes")``). Does nothing
        by default; called before parsing.

        Example:
            >>> class MyCLI(TrainerCLI):
            ...     def add_arguments_to_parser(self, parser):
            ...         parser.add_argument("--warmup_epochs", type=int, default=0)
        """

    def fit(self) -> None:
        """Run ``trainer.fit`` with the built model, data, optimizer and scheduler.

        Collective, as :meth:`distkit.Trainer.fit`.

        Example:
            >>> cli = TrainerCLI(MLP, load_digits, run=False)  # doctest: +SKIP
            >>> cli.fit()  # doctest: +SKIP
        """
        self.trainer.fit(
            self.model,
            self.train_data,
            self.val_data,
            optimizer=self.optimizer,
            loss_fn=self._loss_fn,
            lr_scheduler=self.lr_scheduler,
            scheduler_interval=self.scheduler_interval,
            metrics=self._metrics,
        )

    # ------------------------------------------------------------------------------------------
    # Parser

    def _make_parser(
        self,
        description: str | None,
        optimizer: Any,
        lr_scheduler: Any,
        scheduler_interval: str,
        trainer_defaults: dict[str, Any],
    ) -> ArgumentParser:
        if description is None:
            main_doc = getattr(sys.modules.get("__main__"), "__doc__", None) or ""
            description = main_doc.strip().split("\n\n")[0] or "Train a model with distkit."
        # Our loader refuses a duplicate key in every YAML text the parser reads, and a ${NAME} in a file.
        parser = ArgumentParser(
            description=description, exit_on_error=False, parser_mode=_config_loader.parser_mode()
        )
        parser.add_argument(
            "-c",
            "--config",
            action=ActionConfigFile,
            help="A YAML config file (model, data, optimizer, lr_scheduler, trainer); several "
            "allowed, later ones and the options after them win.",
        )
        _add_factory(parser, self._model_factory, "model")
        _add_factory(parser, self._data_factory, "data")
        parser.add_argument(
            "--optimizer",
            type=Callable[[Iterable], torch.optim.Optimizer],
            default=_class_spec(optimizer, "optimizer"),
            help="The optimizer: a class path (or a torch.optim name) and its init args, e.g. "
            "--optimizer SGD --optimizer.lr 0.1. The parameters are the model's.",
        )
        parser.add_argument(
            "--lr_scheduler",
            type=Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler] | None,
            default=_class_spec(lr_scheduler, "lr_scheduler"),
            help="The learning-rate scheduler (class path and init args) or null for none, e.g. "
            "--lr_scheduler StepLR --lr_scheduler.step_size 10.",
        )
        parser.add_argument(
            "--scheduler_interval",
            type=Literal["step", "epoch"],
            default=scheduler_interval,
            help="Step the scheduler after every optimizer step or every epoch.",
        )
        skip = _TRAINER_SKIP & set(inspect.signature(Trainer.__init__).parameters)
        parser.add_class_arguments(Trainer, "trainer", instantiate=False, skip=skip)
        unknown = set(trainer_defaults) - {
            a.dest.split(".", 1)[1] for a in parser._actions if a.dest.startswith("trainer.")
        }
        if unknown:
            raise ValueError(
                f"trainer_defaults has keys that are not Trainer arguments: {sorted(unknown)}; see "
                f"help(distkit.Trainer)."
            )
        if trainer_defaults:
            parser.set_defaults({f"trainer.{k}": v for k, v in trainer_defaults.items()})
        return parser

    def _parse(self, argv: list[str]) -> Namespace:
        with _piped_configs(argv) as (readable, self._copies):
            try:
                return self._parse_files(readable)
            finally:
                self._copies = {}

    def _parse_files(self, argv: list[str]) -> Namespace:
        env = _launch_env()
        try:
            _config_loader.check_command_line(
                argv, _config_errors.sections(self.parser), self._defaults(), _text_options(self.parser)
            )
        except _config_loader.ConfigRefused as slip:
            self._fail(str(slip), env, argv)
        misshapen = _config_errors.misshapen_sections(argv, self.parser)
        if misshapen is not None:
            self._fail(misshapen, env, argv)
        # --help and --print_config print once per job, not once per rank.
        quiet = io.StringIO() if env[0] != 0 else None
        try:
            with contextlib.redirect_stdout(quiet) if quiet is not None else contextlib.nullcontext():
                config = self.parser.parse_args(argv)
            resume = getattr(getattr(config, "trainer", None), "resume", None)
            if resume in ("None", "null") and not os.path.exists(resume):
                # jsonargparse reads --trainer.resume null as the text 'None' (its type is a path or
                # None): the command line meant no resume, as `resume: null` in a file gives.
                config.trainer.resume = None
        except SystemExit:
            raise
        except _config_loader.ConfigRefused as slip:  # in a file that a file or an option names
            self._fail(str(slip), env, argv)
        except Exception as err:  # jsonargparse's ArgumentError, or a TypeError of a config value
            refused = _config_errors.untrusted_in_raw_input(self.parser, argv, self._allowed)
            self._fail(refused or _config_errors.explain(self.parser, err, argv), env, argv)
        # Before anything is instantiated: a class path names a subclass of its key's base, and a
        # function only when the script allowed it (docs/config.md, "What a config may run").
        refused = _config_errors.untrusted_class_path(self.parser, config, self._allowed, argv)
        if refused is not None:
            self._fail(refused, env, argv)
        if env[0] == 0:
            for key in ("optimizer", "lr_scheduler"):
                _warn_carried_defaults(key, self.parser.get_defaults().get(key), config.get(key))
        return config

    def _fail(self, message: str, env: tuple[int, int], argv: list[str]) -> NoReturn:
        rank, world_size = env
        prefix = f"[rank {rank}/{world_size}] " if world_size > 1 else ""
        # The message quotes what was given: its credentials go, as in distkit's other messages.
        message = _given_options(argv).text(message)
        for copy, given in getattr(self, "_copies", {}).items():  # a piped config, as it was given
            message = message.replace(copy, given)
        print(f"{self.parser.prog}: error: {prefix}{message}", file=sys.stderr)
        raise SystemExit(2)

    def _defaults(self) -> dict[str, Any]:
        """The parser's defaults by dotted key (``model.fmt``): the script's own values."""
        try:
            return dict(self.parser.get_defaults().items())
        except Exception:  # a default jsonargparse cannot build: nothing is exempt
            return {}

    def _resolved(self, config: Namespace) -> dict[str, Any]:
        import yaml

        text = _dump(self.parser, config)
        resolved = yaml.safe_load(text) or {}
        resolved.pop("config", None)
        return resolved

    # ------------------------------------------------------------------------------------------
    # Building

    def _build(self, argv: list[str]) -> None:
        trainer_args = self.config.trainer
        seed = getattr(trainer_args, "seed", None)
        if seed is not None:
            # Before the model exists: the same initial weights on every rank and in every run.
            seed_everything(seed)
        init = _instantiate(self.parser, self.config)
        self.model = _call(self._model_factory, init.model)
        if not isinstance(self.model, nn.Module):
            raise TypeError(f"model returned {type(self.model).__name__}, not a torch.nn.Module.")
        self.data = _call(self._data_factory, init.data)
        self.train_data, self.val_data = _split_data(self.data)
        self.optimizer = init.optimizer
        self.lr_scheduler = init.lr_scheduler
        self.scheduler_interval = init.scheduler_interval
        try:
            self.trainer = Trainer(**_namespace_dict(init.trainer))
        except (ValueError, TypeError) as err:
            # The Trainer's own checks of its options (a value out of range, an unknown strategy):
            # a slip in the config or on the command line, said as one, not as a traceback.
            self._fail(_config_errors.explain_trainer_option(self.parser, err, argv), _launch_env(), argv)
        missing = _missing_resume(self.trainer.resume, argv)
        if missing is not None:
            self._fail(missing, _launch_env(), argv)
        if self.trainer.max_epochs is None and self.trainer.max_steps is None:
            # An empty `max_epochs:` in a file reads as null; fit would say so as a traceback.
            self._fail(_no_length(argv), _launch_env(), argv)
        # The Trainer carries it to fit's set-up (and to the processes fit starts): saved as
        # config.yaml, logged as hparams, compared on resume and across ranks.
        self.trainer.run_config = self.run_config


# ------------------------------------------------------------------------------------------------
# Helpers


@contextlib.contextmanager
def _piped_configs(argv: list[str]) -> Iterator[tuple[list[str], dict[str, str]]]:
    """``argv`` with each ``--config`` that is a pipe (``<(envsubst < run.yaml)``, ``/dev/stdin``)
    read once into a private temporary copy, which the checks and jsonargparse can each read; and
    ``{copy: the path given}``, for messages to name the given one. The copies go afterwards."""
    piped = [
        path
        for path in _config_errors.config_paths(argv)
        if os.path.exists(path) and not os.path.isfile(path) and not os.path.isdir(path)
    ]
    if not piped:
        yield argv, {}
        return
    with tempfile.TemporaryDirectory(prefix="distkit-config-") as directory:  # 0700
        copies: dict[str, str] = {}
        readable = list(argv)
        for index, path in enumerate(piped):
            with open(path, "rb") as source:
                text = source.read()
            copy = os.path.join(directory, f"config-{index}.yaml")
            with os.fdopen(os.open(copy, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as handle:
                handle.write(text)
            copies[copy] = path
            readable = [
                copy if arg == path else f"--config={copy}" if arg == f"--config={path}" else arg
                for arg in readable
            ]
        yield readable, copies


def _text_options(parser: ArgumentParser) -> set[str]:
    """The options whose value is text (``--model.fmt``): a value there that reads as YAML
    (``'{epoch, epoch}'``) is text, not a mapping to check."""
    found = set()
    for action in parser._actions:
        hint = getattr(action, "_typehint", None) or action.type
        if hint is str or hint == (str | None):
            found.add(action.dest)
    return found


def _no_length(argv: list[str]) -> str:
    """Why fit cannot start when trainer.max_epochs and trainer.max_steps are both null, and where
    to set one: the config file that empties max_epochs (``max_epochs:``), if one does."""
    import yaml

    emptied = None
    for path in _config_errors.config_paths(argv):
        try:
            with open(path, encoding="utf-8") as handle:
                trainer = (yaml.safe_load(handle) or {}).get("trainer")
        except (OSError, UnicodeDecodeError, yaml.YAMLError, AttributeError):
            continue
        if isinstance(trainer, dict) and "max_epochs" in trainer:
            emptied = path if trainer["max_epochs"] is None else None
    fix = "--trainer.max_epochs N or --trainer.max_steps N"
    if emptied is not None:
        return (
            f"trainer.max_epochs is empty (null) in {emptied} and trainer.max_steps is not set: fit "
            f"needs one of them to know when to stop. Give a number there, or on the command line ({fix})."
        )
    return (
        f"trainer.max_epochs and trainer.max_steps are both null: fit needs one of them to know when "
        f"to stop. Set one on the command line ({fix}) or in a --config file."
    )


def _missing_resume(resume: str | None, argv: list[str]) -> str | None:
    """Why ``trainer.resume`` names no checkpoint (a path or URL where nothing exists, or a URL
    distkit cannot read), or ``None``. The Trainer finds it only in ``fit``, after the process group
    and the loaders are up, as a ``FileNotFoundError`` traceback; a config's slip is said before."""
    from distkit.checkpoint._files import _missing_hint, _read_manifest, _storage_for

    if resume is None or resume == "auto":
        return None
    with contextlib.suppress(ValueError):  # unreadable launcher variables: said elsewhere
        if runtime.get_env().num_nodes > 1:
            # A path may exist on some nodes' disks only. fit's restore then names the ranks that
            # lack it, on every rank at once; an exit here would leave the other nodes waiting for
            # this one in the process group's set-up, up to its timeout.
            return None
    where = _config_errors.where_to_fix(argv, "trainer.resume", "PATH")
    try:
        storage, path = _storage_for(resume)
    except ValueError as err:  # a file:// URL a slash short, an unknown protocol
        return f"trainer.resume: {err} {where}"
    except Exception:  # fsspec's filesystem for it is not installed (gcsfs): the restore says so
        return None
    try:
        if storage.kind(path) is not None:
            _read_manifest(storage, path)  # the restore's first read: no checkpoint is refused here
            return None
    except ForeignCheckpointError as err:
        if err.kind == "dcp":
            return None  # a torch.distributed.checkpoint directory: fit loads it as it is
        return f"trainer.resume: {_resume_not_one_checkpoint(err, resume)} {where}"
    except Exception:  # a store that cannot be asked now (credentials, network): the restore says why
        return None
    return (
        f"trainer.resume: no checkpoint at {redact_url(resume)}: nothing exists there."
        f"{_missing_hint(resume)} Give --trainer.resume auto to continue the newest checkpoint in "
        f"trainer.default_root_dir (a fresh start when it holds none), or the path of an existing "
        f"checkpoint (`distkit checkpoint list DIRECTORY` lists a directory's checkpoints). {where}"
    )


def _resume_not_one_checkpoint(err: ForeignCheckpointError, resume: str) -> str:
    """``err`` (trainer.resume names no distkit checkpoint) said with the command line's options: a
    run's checkpoint directory, or the run directory itself, is continued by ``--trainer.resume
    auto`` with that run's ``--trainer.default_root_dir``; one checkpoint is given by its path;
    another tool's checkpoint is converted by ``distkit checkpoint import`` first."""
    if err.kind in ("accelerate", "lightning"):
        return (
            f"{err.path} is not a distkit checkpoint: it looks like {err.layout}. Convert it once: "
            f"`distkit checkpoint import {err.path} DEST`, then give --trainer.resume DEST."
        )
    if err.kind != "manager" or err.suggested is None:
        return str(err)
    manager = posixpath.dirname(err.suggested)
    if manager.rstrip("/") != err.path.rstrip("/"):
        run: str | None = err.path  # the run directory was given: its checkpoints are inside
    elif posixpath.basename(manager.rstrip("/")) == "checkpoints":
        run = posixpath.dirname(manager.rstrip("/")) or "."
    else:
        run = None  # a CheckpointManager directory of the user's own
    continues = (
        f", or continue that run with --trainer.default_root_dir {run} --trainer.resume auto"
        if run is not None
        else ""
    )
    return (
        f"{redact_url(resume)} is not one checkpoint: it is {err.layout}. Give one of them, e.g. the "
        f"highest complete step's, --trainer.resume {err.suggested}{continues} (`distkit checkpoint "
        f"list {manager}` lists them)."
    )


def _add_factory(parser: ArgumentParser, factory: Callable[..., Any], key: str) -> None:
    """The typed arguments of a class or a function, under ``key``."""
    if inspect.isclass(factory):
        parser.add_class_arguments(factory, key, instantiate=False, fail_untyped=True)
    else:
        parser.add_function_arguments(factory, key, fail_untyped=True)


def _call(factory: Callable[..., Any], args: Any) -> Any:
    return factory(**_namespace_dict(args))


def _namespace_dict(args: Any) -> dict[str, Any]:
    """The top level of a jsonargparse Namespace as keyword arguments (nested values as they are)."""
    if args is None:
        return {}
    return dict(vars(args)) if not isinstance(args, Mapping) else dict(args)


def _instantiate(parser: ArgumentParser, config: Namespace) -> Namespace:
    """The config with class paths made into objects (optimizer and scheduler factories, callbacks)."""
    method = getattr(parser, "instantiate", None) or parser.instantiate_classes  # renamed in 4.49
    return method(config)  # type: ignore[no-any-return]


def _dump(parser: ArgumentParser, config: Namespace) -> str:
    """The configuration as YAML, ``null`` values included (``skip_none`` became ``skip_unset`` in
    jsonargparse 4.49)."""
    # jsonargparse's renaming decorator hides dump()'s return type: the annotation restores it.
    try:
        text: str = parser.dump(config, skip_unset=False)
    except TypeError:  # jsonargparse < 4.49
        text = parser.dump(config, skip_none=False)
    return text


def _resolve_class(spec: Any) -> type | None:
    path = spec.get("class_path") if isinstance(spec, Mapping) else getattr(spec, "class_path", None)
    if not isinstance(path, str) or "." not in path:
        return None
    module, _, name = path.rpartition(".")
    try:
        found = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None
    return found if inspect.isclass(found) else None


def _warn_carried_defaults(key: str, default: Any, parsed: Any) -> None:
    """Warn when the config changed ``key``'s class and an init arg kept the default class's
    default, which is not the new class's own (jsonargparse keeps the values both classes name:
    ``optimizer: {class_path: SGD}`` trains with AdamW's ``weight_decay=0.01``, SGD's being 0)."""
    old, new = _resolve_class(default), _resolve_class(parsed)
    if old is None or new is None or old is new:
        return
    given = getattr(parsed, "init_args", None)
    values = dict(vars(given)) if given is not None else {}
    try:
        old_params, new_params = inspect.signature(old).parameters, inspect.signature(new).parameters
    except (TypeError, ValueError):
        return
    carried = []
    for name, value in values.items():
        if name not in old_params or name not in new_params:
            continue
        old_default, new_default = old_params[name].default, new_params[name].default
        if new_default is inspect.Parameter.empty or old_default is inspect.Parameter.empty:
            continue
        with contextlib.suppress(Exception):
            if value == old_default and value != new_default:
                carried.append(f"{name}={value!r} ({new.__name__}'s default: {new_default!r})")
    if carried:
        warnings.warn(
            f"{key} is {new.__name__}, but {', '.join(carried)} kept {old.__name__}'s default value: "
            f"when a config changes the class, the init args both classes name keep their values. "
            f"Give them in the config ({key}.init_args) to choose; --print_config shows what runs.",
            stacklevel=4,
        )


def _class_spec(value: Any, what: str) -> dict[str, Any] | None:
    """A default optimizer or scheduler as jsonargparse's ``{"class_path", "init_args"}``."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        if "class_path" not in value:
            raise ValueError(f"{what} as a mapping needs a 'class_path' key, got {dict(value)!r}.")
        return dict(value)
    if isinstance(value, str):
        return {"class_path": value}
    init_args: dict[str, Any] = {}
    if isinstance(value, functools.partial):
        if value.args:
            raise ValueError(
                f"{what}: give functools.partial keyword arguments only (the first argument is "
                f"supplied by fit), got positional {value.args!r}."
            )
        init_args = dict(value.keywords)
        value = value.func
    if not inspect.isclass(value):
        raise TypeError(
            f"{what} must be a class, a functools.partial of a class, or a class-path mapping, got {value!r}."
        )
    spec: dict[str, Any] = {"class_path": _public_path(value)}
    if init_args:
        spec["init_args"] = init_args
    return spec


def _public_path(cls: type) -> str:
    """``torch.optim.AdamW`` rather than ``torch.optim.adamw.AdamW`` when the package exports it."""
    module = cls.__module__
    parent = module.rsplit(".", 1)[0] if "." in module else module
    with contextlib.suppress(ImportError):
        if getattr(importlib.import_module(parent), cls.__qualname__, None) is cls:
            return f"{parent}.{cls.__qualname__}"
    return f"{module}.{cls.__qualname__}"


def _split_data(data: Any) -> tuple[Any, Any]:
    """``(train, val)`` from what the data factory gave."""
    if callable(getattr(data, "train_dataset", None)):
        val = data.val_dataset() if callable(getattr(data, "val_dataset", None)) else None
        return data.train_dataset(), val
    if isinstance(data, tuple):
        if len(data) == 2:
            return data[0], data[1]
        if len(data) == 1:
            return data[0], None
        raise ValueError(
            f"data returned a tuple of {len(data)} items; return (train, val), (train,) or an object "
            f"with train_dataset() and val_dataset()."
        )
    return data, None


def _given_options(argv: list[str]) -> Scrubber:
    """What hides the credentials given in ``argv`` and its ``--config`` files: URLs' user parts and
    query values, and the values of options with credential names (``--data.api_token``)."""
    import yaml

    given: dict[str, Any] = {}
    for index, argument in enumerate(argv):
        if not argument.startswith("--"):
            continue
        name, equals, value = argument[2:].partition("=")
        if not equals and index + 1 < len(argv):
            value = argv[index + 1]
        given[name.rpartition(".")[2]] = value
    files = []
    for path in _config_errors.config_files(argv):
        with (
            contextlib.suppress(OSError, UnicodeDecodeError, yaml.YAMLError),
            open(path, encoding="utf-8") as handle,
        ):
            files.append(yaml.safe_load(handle))
    return Scrubber([given, *files])


def _allowed_callables(entries: Iterable[Callable[..., Any] | str]) -> tuple[Any, ...]:
    """The functions (or classes) a config may name beyond the declared bases' subclasses."""
    if isinstance(entries, (str, bytes)) or callable(entries):
        raise TypeError(
            f"allow_callables must be a list of functions or import paths, got {entries!r}; "
            f"write allow_callables=[{entries!r}]."
        )
    allowed = []
    for entry in entries:
        if isinstance(entry, str):
            target = _config_errors.resolve(entry, ())
            if target is None:
                raise ValueError(
                    f"allow_callables: cannot import {entry!r}; give the function itself or its full "
                    f"import path, e.g. 'mypackage.optim.make_optimizer'."
                )
            entry = target
        if not callable(entry):
            raise TypeError(f"allow_callables takes functions, classes or import paths, got {entry!r}.")
        allowed.append(entry)
    return tuple(allowed)


def _launch_env() -> tuple[int, int]:
    """(rank, world size) from the launcher's variables; (0, 1) when they cannot be read."""
    try:
        env = runtime.get_env()
    except ValueError:
        return 0, 1
    return env.rank, env.world_size


# ------------------------------------------------------------------------------------------------
# Errors: the key, the value given and what was expected
