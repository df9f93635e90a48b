"""Where the Trainer writes metrics: a CSV file by default; TensorBoard, MLflow and Weights & Biases
as extras.

The Trainer calls loggers on the main process only, with values already reduced across ranks, so a
logger never communicates and never sees a rank's partial view.

What every built-in logger writes or sends goes through distkit's redaction first
(:mod:`distkit._utils.secrets`: a URL's user part and query values, values under credential names), and
the files it writes in a run directory have the checkpoints' mode, owner only (``FILE_MODE``;
the folders it makes for a tracker's own files, ``DIR_MODE``); ``docs/trainer.md``, "Loggers".
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from distkit import runtime
from distkit._utils.fs import atomic_open
from distkit._utils.secrets import redact_data, redact_text
from distkit.checkpoint._commit import DEFAULT_FILE_MODE
from distkit.checkpoint._lock import _LocalWriterLock
from distkit.errors import DistkitError

__all__ = ["CSVLogger", "Logger", "TensorBoardLogger"]

_log = runtime.get_logger("distkit.trainer", main_process_only=True)

#: Permission bits of the files the loggers write in a run directory: the checkpoints' (0o600,
#: the owner only), so that one rule covers what distkit writes there. A config or a metric file
#: is no credential once redacted, but it is the run's, as its checkpoints are: sharing it is a
#: decision (chmod, or a copy), not the umask's default.
FILE_MODE = DEFAULT_FILE_MODE
#: Permission bits of the folders a logger makes for a tracker's own files (``tensorboard/``,
#: ``mlruns/``, ``wandb/``), which the tracker writes with the umask: owner only, as the
#: checkpoints' folders, so those files are the owner's too.
DIR_MODE = 0o700


def make_private_dir(path: Path) -> None:
    """Create ``path`` (and its parents) if missing, the folder itself with :data:`DIR_MODE`;
    an existing folder keeps its mode. Local."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.mkdir(mode=DIR_MODE, exist_ok=True)


def plain_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """``params`` as JSON data (other objects as their text), redacted
    (:func:`distkit._utils.secrets.redact_data`): what a logger may write or send. Local."""
    return redact_data(json.loads(json.dumps(dict(params), default=str)))  # type: ignore[no-any-return]


def metric_names(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """``metrics`` with each name through :func:`distkit._utils.secrets.redact_text` (a name is text a
    user's code chose, and could hold a URL). Local."""
    return {redact_text(str(name)): value for name, value in metrics.items()}


class Logger:
    """Base class of the Trainer's loggers: override what you need.

    Local: the Trainer calls every method on the main process only, with metrics already reduced
    across ranks; nothing here communicates.

    Example:
        >>> class PrintLogger(Logger):
        ...     def log_metrics(self, metrics, step):
        ...         print(step, dict(metrics))
        >>> PrintLogger().log_metrics({"loss": 0.5}, step=10)
        10 {'loss': 0.5}
    """

    def setup(self, save_dir: Path, resume_step: int | None) -> None:
        """Called once at the start of ``fit``.

        Args:
            save_dir: The Trainer's ``default_root_dir``, for loggers given no directory.
            resume_step: The step training resumes from, or ``None`` for a fresh run: records
                after it belong to the interrupted attempt and should be dropped.
        """

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        """Record the run's configuration (the Trainer's settings), once per ``fit``."""

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Record metrics reduced across ranks, at optimizer step ``step``."""

    def log_checkpoint(self, path: str, step: int) -> None:
        """Record the run's last checkpoint, once ``fit`` has finished and its saves are committed.

        Args:
            path: The checkpoint directory (an fsspec URL has its credentials redacted).
            step: Its optimizer step.
        """

    def finalize(self) -> None:
        """Flush and close; called at the end of ``fit``, also when it fails."""


def _failing() -> bool:
    """Whether ``fit`` is failing: the Trainer finalizes its loggers in a ``finally`` clause, where
    the exception on its way up is visible. A clean ``SystemExit`` (preemption) is no failure."""
    error = sys.exc_info()[1]
    return error is not None and not (isinstance(error, SystemExit) and error.code in (0, None))


def _first_free(named: Callable[[int], Path]) -> int:
    """The first number from 1 whose ``named(number)`` does not exist: where an earlier run's file
    is kept."""
    number = 1
    while named(number).exists():
        number += 1
    return number


def _claim(path: Path) -> _LocalWriterLock:
    """Hold ``path`` (a metrics file, an events folder) for this run until ``finalize``. A second
    run writing there at the same time (the same ``default_root_dir``) would mix its rows into this
    one's, or rename this one's file away, and no checkpoint directory's lock refuses it when
    checkpoints are off or kept elsewhere. The kernel lock beside it, ``<path>.distkit-lock``, is
    released when its holder exits or dies, however it dies."""

    def refuse(holder: str, lock: str) -> DistkitError:
        return DistkitError(
            f"another run writes {path}: {holder} (lock {lock}). Two runs logging to one "
            f"directory mix their metrics. Give this run a default_root_dir of its own (or the logger "
            f"a save_dir of its own), or wait for that run to end; the lock is released when its "
            f"holder exits or dies, even when killed."
        )

    lock = _LocalWriterLock(str(path), FILE_MODE, what="the log", conflict=refuse)
    lock.acquire()
    return lock


def _keep_earlier_run(path: Path, hparams: Path) -> None:
    """A fresh run writing where an earlier one left its rows (a reused ``default_root_dir``
    without checkpoints, whose reuse is refused): the earlier file and its ``hparams`` file are
    kept under the first free suffix (``metrics.1.csv``, ``hparams.1.json``), not overwritten."""
    if not path.exists():
        return
    with open(path, newline="") as handle:
        handle.readline()  # the header
        if not handle.readline():  # no rows to keep
            return
    number = _first_free(lambda n: path.with_suffix(f".{n}{path.suffix}"))
    kept = path.with_suffix(f".{number}{path.suffix}")
    os.replace(path, kept)
    if hparams.exists():
        os.replace(hparams, hparams.with_suffix(f".{number}.json"))
    _log.warning(
        "%s held the metrics of an earlier run in this directory: kept as %s (and its %s beside "
        "it); this run writes a new %s. Give each run its own default_root_dir to keep them apart.",
        path,
        kept.name,
        hparams.name,
        path.name,
    )


def _keep_earlier_events(directory: Path) -> None:
    """A fresh run where an earlier one left TensorBoard events: they move into the first free
    ``<directory>/earlier.<n>/`` (TensorBoard shows it as a run of its own), not mixed into this
    run's curves, which would restart at step 1 on the same plot. Only the event files move: the
    directory may be the run's own (``TensorBoardLogger(save_dir=default_root_dir)``), holding this
    run's other files and locks."""
    events = sorted(directory.glob("events.out.tfevents.*")) if directory.is_dir() else []
    if not events:
        return
    number = _first_free(lambda n: directory / f"earlier.{n}")
    kept = directory / f"earlier.{number}"
    make_private_dir(kept)
    for path in events:
        os.replace(path, kept / path.name)
    _log.warning(
        "%s held the TensorBoard events of an earlier run: moved into %s; this run writes new ones "
        "beside it. Give each run its own default_root_dir to keep them apart.",
        directory,
        kept,
    )


class CSVLogger(Logger):
    """Metrics as rows of a CSV file: one row per logging step or epoch end, one column per name.

    Local (main process only). The file is rewritten atomically whenever a new metric name adds a
    column, so a reader never sees a half-written header; ``hparams.json`` beside it holds the run's
    configuration (``<name>.hparams.json`` for a ``filename`` other than ``metrics.csv``, so that
    loggers of other files in one directory keep theirs). A fresh ``fit`` starts a new file (an
    earlier run's is kept as ``metrics.1.csv``, with a warning); a resumed one keeps the rows up to
    the resumed step and drops the rest (they belong to the interrupted attempt).

    Args:
        save_dir: Directory of the files; ``None`` means the Trainer's ``default_root_dir``.
        filename: Name of the CSV file.

    Attributes:
        path: The CSV file, once ``fit`` has started.
        hparams_path: The run's configuration beside it (JSON), once ``fit`` has started.

    Example:
        >>> import distkit
        >>> from distkit.trainer import CSVLogger
        >>> trainer = distkit.Trainer(logger=CSVLogger("runs/mlp"), max_epochs=1)
    """

    def __init__(
        self, save_dir: str | os.PathLike[str] | None = None, *, filename: str = "metrics.csv"
    ) -> None:
        if not filename or os.sep in filename:
            raise ValueError(f"filename must be a plain file name, got {filename!r}.")
        self.save_dir = None if save_dir is None else Path(save_dir)
        self.filename = filename
        self.path: Path | None = None
        self.hparams_path: Path | None = None
        self._columns: list[str] = []
        self._rows: list[dict[str, Any]] = []
        # The resumed step and its kept rows by their names: a row the resumed run logs again there
        # (an epoch's end after a checkpoint at the epoch's last step) replaces the kept one.
        self._resumed: tuple[int, dict[frozenset[str], dict[str, Any]]] | None = None
        self._lock: _LocalWriterLock | None = None

    def setup(self, save_dir: Path, resume_step: int | None) -> None:
        directory = self.save_dir or save_dir
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / self.filename
        stem = "hparams" if self.filename == "metrics.csv" else f"{Path(self.filename).stem}.hparams"
        self.hparams_path = directory / f"{stem}.json"
        self._lock = _claim(self.path)
        self._rows = []
        self._columns = ["step"]
        self._resumed = None
        if resume_step is not None and self.path.exists():
            with open(self.path, newline="") as handle:
                reader = csv.DictReader(handle)
                self._columns = list(reader.fieldnames or ["step"])
                self._rows = [row for row in reader if int(row["step"]) <= resume_step]
            at_step = {_names(row): row for row in self._rows if int(row["step"]) == resume_step}
            self._resumed = (resume_step, at_step)
        elif resume_step is None:
            _keep_earlier_run(self.path, self.hparams_path)
        self._rewrite()

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        assert self.path is not None, "setup() runs first"  # the Trainer's call order
        text = json.dumps(plain_params(params), indent=2, sort_keys=True)
        assert self.hparams_path is not None
        with atomic_open(self.hparams_path, mode=FILE_MODE) as handle:
            handle.write(text.encode())

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        assert self.path is not None, "setup() runs first"
        row: dict[str, Any] = {"step": step}
        row.update({name: _format(value) for name, value in metric_names(metrics).items()})
        self._rows.append(row)
        new = [name for name in row if name not in self._columns]
        again = None
        if self._resumed is not None and self._resumed[0] == step:
            again = self._resumed[1].pop(_names(row), None)
        if again is not None:  # the interrupted attempt's row, logged after its checkpoint
            self._rows.remove(again)
            new = new or [""]  # rewrite the file whole, without it
        if new:
            self._columns.extend(name for name in new if name)
            self._rewrite()
            return
        with open(self.path, "a", newline="") as handle:
            csv.DictWriter(handle, fieldnames=self._columns).writerow(row)

    def finalize(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def __getstate__(self) -> dict[str, Any]:
        # A lock is the process's that took it: a copy sent to the processes fit() starts has none.
        return {**self.__dict__, "_lock": None}

    def _rewrite(self) -> None:
        assert self.path is not None
        with atomic_open(self.path, mode=FILE_MODE) as raw:
            text = io.StringIO()
            writer = csv.DictWriter(text, fieldnames=self._columns)
            writer.writeheader()
            writer.writerows(self._rows)
            raw.write(text.getvalue().encode())


def _names(row: Mapping[str, Any]) -> frozenset[str]:
    """The metrics a row holds (a row read back has every column, empty where it had none)."""
    return frozenset(name for name, value in row.items() if name != "step" and value not in ("", None))


def _format(value: float) -> Any:
    # Integral values (epoch, counts) read back as ints; repr() keeps every float digit.
    if isinstance(value, float) and math.isfinite(value) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    return value


class TensorBoardLogger(Logger):
    """Metrics as TensorBoard scalars; needs ``tensorboard`` (``pip install 'distkit[tensorboard]'``).

    Local (main process only). A resumed ``fit`` purges the events after the resumed step (those
    at that step stay, as they were written before its checkpoint). Each logging step is flushed to
    the event file before ``log_metrics`` returns, so a killed process loses none of the steps up to
    its last checkpoint.

    Args:
        save_dir: Directory of the event files; ``None`` means ``<default_root_dir>/tensorboard``.

    Example:
        >>> import distkit
        >>> from distkit.trainer import CSVLogger, TensorBoardLogger
        >>> trainer = distkit.Trainer(logger=[CSVLogger(), TensorBoardLogger()], max_epochs=1)
    """

    def __init__(self, save_dir: str | os.PathLike[str] | None = None) -> None:
        self.save_dir = None if save_dir is None else Path(save_dir)
        self._writer: Any = None
        self._lock: _LocalWriterLock | None = None

    def setup(self, save_dir: Path, resume_step: int | None) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise ImportError(
                "TensorBoardLogger needs the tensorboard package: pip install 'distkit[tensorboard]'."
            ) from err
        directory = self.save_dir or save_dir / "tensorboard"
        make_private_dir(directory)
        # Inside the folder, which is the logger's (a save_dir of "." has no "beside" of its own).
        self._lock = _claim(directory / "events")
        if resume_step is None:
            _keep_earlier_events(directory)
        # SummaryWriter purges the events at steps >= purge_step; those at the resumed step itself
        # were written before its checkpoint and are kept, as CSVLogger keeps its rows.
        purge_step = None if resume_step is None else resume_step + 1
        self._writer = SummaryWriter(log_dir=str(directory), purge_step=purge_step)

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        self._writer.add_text("hparams", json.dumps(plain_params(params), indent=2, sort_keys=True))

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        for name, value in metric_names(metrics).items():
            self._writer.add_scalar(name, value, global_step=step)
        # SummaryWriter queues events for up to 2 minutes; a step counts as logged once it is in
        # the file (a SIGKILL loses the queue, and a resume starts after the checkpoint's step).
        self._writer.flush()

    def finalize(self) -> None:
        try:
            if self._writer is not None:
                writer, self._writer = self._writer, None
                writer.close()
        finally:
            if self._lock is not None:
                self._lock.release()
                self._lock = None
