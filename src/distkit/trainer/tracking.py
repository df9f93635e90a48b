"""Loggers for experiment trackers: MLflow and Weights & Biases, local and offline by default.

Each logs the run's configuration, the metrics by step and the last checkpoint, from the main
process only, and continues the same run after a resume with every step logged once, also after the
process was killed (``docs/trainer.md``, "Loggers"): a step counts as logged for a tracker only once
the tracker holds it durably. MLflow writes synchronously, so a step is logged when ``log_batch``
returns; wandb's service buffers its file, so the wandb logger keeps a journal of its steps and, on
resume, logs again those of them that the killed attempt's files do not hold. What is written or
sent goes through distkit's redaction (:mod:`distkit._utils.secrets`). The trackers are optional extras
(``distkit[mlflow]``, ``distkit[wandb]``), imported when a logger is made, so ``import distkit``
stays light.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import struct
import sys
import time
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Literal, TypeVar

from distkit import runtime
from distkit._utils.fs import atomic_open
from distkit._utils.secrets import Scrubber, redact_argv, redact_data, redact_text, redact_url
from distkit.checkpoint._lock import _LocalWriterLock
from distkit.trainer.loggers import (
    FILE_MODE,
    Logger,
    _claim,
    _failing,
    make_private_dir,
    metric_names,
    plain_params,
)

__all__ = ["MLflowLogger", "WandbLogger"]

_log = runtime.get_logger("distkit.trainer", main_process_only=True)
T = TypeVar("T")


class MLflowLogger(Logger):
    """Parameters, metrics and the last checkpoint in an MLflow run; needs ``distkit[mlflow]``.

    Local (main process only). By default the run lives in a local file store,
    ``<default_root_dir>/mlruns``: it needs no server, no network and nothing beyond
    ``mlflow-skinny``. MLflow 3 refuses that store unless ``MLFLOW_ALLOW_FILE_STORE=true``; this
    logger opts in for its own client only, so set that variable to read the store in another
    process (``mlflow ui --backend-store-uri ...``, ``mlflow.search_runs``). Any other tracking
    URI works too: ``sqlite:///runs/mlflow.db`` (needs ``sqlalchemy`` and ``alembic``, which full
    ``mlflow`` brings) or a tracking server's ``http(s)://`` address. When this logger is the first
    to import mlflow, MLflow's usage telemetry is off for the process.

    The parameters are what the Trainer gives :meth:`Logger.log_hyperparams`, nested keys joined by
    dots (``model.hidden``), values as text. Metrics are logged with the optimizer step as their
    ``step``. At the end of a successful ``fit`` the last checkpoint's path is set as the tags
    ``distkit.checkpoint`` and ``distkit.checkpoint_step``. The run ends ``FINISHED``, or ``FAILED``
    when ``fit`` raised.

    A resumed ``fit`` continues the same run: its id is kept in ``mlflow_run.json`` beside the
    store. MLflow's stores write synchronously, so a step is in the run once ``log_batch`` returns,
    and a killed process loses none that it logged. A metric is logged once per step: not again at
    a step it already has in the run (the steps after the checkpoint that an interrupted attempt
    logged; with exact resume their values are the same), nor twice in one attempt (``epoch`` at a
    step that ends an epoch). A parameter keeps its first value (MLflow's parameters cannot change;
    a changed one is warned about). A fresh ``fit`` starts a new run.

    Args:
        experiment_name: The experiment, created when it does not exist.
        tracking_uri: Where runs are stored; ``None`` means ``file:<save_dir>/mlruns``.
        run_name: The run's name (MLflow makes one up when ``None``).
        tags: Tags set on a new run.
        save_dir: Directory of ``mlflow_run.json`` and the default store; ``None`` means the
            Trainer's ``default_root_dir``.

    Attributes:
        run_id: The MLflow run's id, once ``fit`` has started (on the main process).

    Raises:
        ImportError: mlflow is not installed.

    Example:
        >>> import distkit
        >>> from distkit.trainer import CSVLogger, MLflowLogger
        >>> logger = MLflowLogger("digits", run_name="mlp-lr1e-3")  # doctest: +SKIP
        >>> trainer = distkit.Trainer(logger=[CSVLogger(), logger], resume="auto")  # doctest: +SKIP
    """

    _STATE_FILE = "mlflow_run.json"

    def __init__(
        self,
        experiment_name: str = "distkit",
        *,
        tracking_uri: str | None = None,
        run_name: str | None = None,
        tags: Mapping[str, str] | None = None,
        save_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        # Checked here, on every rank alike, not in setup() on the main process only.
        _require("mlflow", "MLflowLogger", "mlflow")
        if not experiment_name:
            raise ValueError("experiment_name must be a non-empty string, e.g. 'distkit'.")
        self.experiment_name = experiment_name
        self.tracking_uri = tracking_uri
        self.run_name = run_name
        self.tags = dict(tags or {})
        self.save_dir = None if save_dir is None else Path(save_dir)
        self.run_id: str | None = None
        self._client: Any = None
        self._lock: _LocalWriterLock | None = None
        self._logged_through: dict[str, int] = {}  # metric -> last step the run holds
        self._params: dict[str, str] = {}

    # Every call that reaches the tracking server goes through a Scrubber of its URI and of the
    # credentials MLflow reads from the environment: MLflow's own errors (a refused connection)
    # quote the whole URI, password and token included, into tracebacks, logs and hang reports.
    _ENV_SECRETS = ("MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_CLIENT_CERT_PATH")

    def _scrubbed(self, fn: Callable[..., T], *args: Any) -> T:
        uri = self.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or ""
        secrets = {name: os.environ[name] for name in self._ENV_SECRETS if os.environ.get(name)}
        return Scrubber(secrets, *([uri] if uri else [])).call(fn, *args)

    def setup(self, save_dir: Path, resume_step: int | None) -> None:
        self._scrubbed(self._setup, save_dir, resume_step)

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        self._scrubbed(self._log_hyperparams, params)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self._scrubbed(self._log_metrics, metrics, step)

    def log_checkpoint(self, path: str, step: int) -> None:
        self._scrubbed(self._log_checkpoint, path, step)

    def finalize(self) -> None:
        try:
            self._scrubbed(self._finalize)
        finally:
            if self._lock is not None:
                self._lock.release()
                self._lock = None

    def _setup(self, save_dir: Path, resume_step: int | None) -> None:
        directory = self.save_dir or save_dir
        directory.mkdir(parents=True, exist_ok=True)
        # One run at a time names its run in mlflow_run.json: a second would take the first's
        # place there, and a resume would continue the wrong run.
        self._lock = _claim(directory / self._STATE_FILE)
        if self.tracking_uri is None:
            make_private_dir(directory / "mlruns")  # the store's files are the owner's, as the checkpoints
        uri = self.tracking_uri or (directory.resolve() / "mlruns").as_uri()
        self._client = _mlflow_client(uri)
        self._logged_through, self._params = {}, {}
        state_path = directory / self._STATE_FILE
        run = self._previous_run(state_path, uri) if resume_step is not None else None
        if run is None:
            experiment = self._client.get_experiment_by_name(self.experiment_name)
            experiment_id = (
                experiment.experiment_id
                if experiment is not None
                else self._client.create_experiment(self.experiment_name)
            )
            run = self._client.create_run(
                experiment_id,
                run_name=None if self.run_name is None else redact_text(self.run_name),
                tags=redact_data(self.tags),
            )
        else:
            self._client.update_run(run.info.run_id, status="RUNNING")
            self._params = dict(run.data.params)
            for key in run.data.metrics:
                history = self._client.get_metric_history(run.info.run_id, key)
                self._logged_through[key] = max((m.step for m in history), default=-1)
        self.run_id = run.info.run_id
        # The URI as distkit shows it: a tracking server's credentials stay out of the file.
        _write_json(state_path, {"tracking_uri": redact_url(uri), "run_id": self.run_id})

    def _previous_run(self, state_path: Path, uri: str) -> Any:
        state = _read_json(state_path) or {}
        if state.get("tracking_uri") != redact_url(uri) or not isinstance(state.get("run_id"), str):
            _log.warning(
                "MLflowLogger: resuming, but %s names no run in %s; starting a new MLflow run",
                state_path,
                redact_url(uri),
            )
            return None
        try:
            return self._client.get_run(state["run_id"])
        except Exception as err:  # MlflowException: the run was deleted, or the store moved
            _log.warning(
                "MLflowLogger: run %s not found (%s); starting a new MLflow run",
                state["run_id"],
                redact_text(str(err)),
            )
            return None

    def _log_hyperparams(self, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        new: list[Any] = []
        changed: list[str] = []
        for key, value in _flatten(plain_params(params)).items():
            text = _as_text(value)[:MAX_PARAM_VAL_LENGTH]
            if key not in self._params:
                new.append(Param(key, text))
                self._params[key] = text
            elif self._params[key] != text:
                changed.append(f"{key}: {self._params[key]!r} -> {text!r}")
        for start in range(0, len(new), MAX_PARAMS_TAGS_PER_BATCH):
            self._client.log_batch(self.run_id, params=new[start : start + MAX_PARAMS_TAGS_PER_BATCH])
        if changed:
            _log.warning(
                "MLflowLogger: MLflow parameters cannot change, so run %s keeps its first values of: %s",
                self.run_id,
                "; ".join(changed),
            )

    def _log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric
        from mlflow.utils.validation import MAX_METRICS_PER_BATCH

        now_ms = int(time.time() * 1000)
        # Once per (metric, step): MLflow keeps every value logged at a step, so neither a step the
        # run already holds (a resumed attempt) nor a second call at this step (an epoch's end
        # logs `epoch` again) may log it twice.
        batch = [
            Metric(key, float(value), now_ms, step)
            for key, value in metric_names(metrics).items()
            if step > self._logged_through.get(key, -1)
        ]
        for start in range(0, len(batch), MAX_METRICS_PER_BATCH):
            self._client.log_batch(self.run_id, metrics=batch[start : start + MAX_METRICS_PER_BATCH])
        # log_batch returned: the store holds these (file store and server write synchronously).
        self._logged_through.update({metric.key: step for metric in batch})

    def _log_checkpoint(self, path: str, step: int) -> None:
        self._client.set_tag(self.run_id, "distkit.checkpoint", redact_url(path))
        self._client.set_tag(self.run_id, "distkit.checkpoint_step", str(step))

    def _finalize(self) -> None:
        if self._client is None or self.run_id is None:
            return
        failing = _failing()
        try:
            self._client.set_terminated(self.run_id, status="FAILED" if failing else "FINISHED")
        except Exception as err:
            if not failing:
                raise
            # fit's own error is the one to see; this one is only told.
            _log.warning("MLflowLogger: could not end run %s: %s", self.run_id, err)
        finally:
            self._client = None

    def __getstate__(self) -> dict[str, Any]:
        # A client belongs to one process: the processes fit() starts get the settings only.
        return {**self.__dict__, "_client": None, "_lock": None}


class WandbLogger(Logger):
    """Parameters, metrics and the last checkpoint in a Weights & Biases run; needs ``distkit[wandb]``.

    Local (main process only). Offline by default: the run is written under
    ``<save_dir>/wandb/offline-run-<time>-<id>/`` and nothing leaves the machine (no login, no
    upload; wandb's error reporting is off for the service this logger starts) until you run
    ``wandb sync <that directory>``. Pass ``mode="online"`` to stream to the server instead.

    The run's config is what the Trainer gives :meth:`Logger.log_hyperparams` (nested as given).
    Metrics are logged with the optimizer step as wandb's ``step``. At the end of a successful
    ``fit`` the last checkpoint's path is in the run summary as ``checkpoint`` and
    ``checkpoint_step``. The run ends with exit code 0, or 1 when ``fit`` raised; wandb's
    background service is then stopped, unless another wandb run of this process is still open.
    The command line wandb records with the run (``sys.argv``) has its credentials redacted, as the
    config, the summary, the name and the tags.

    A resumed ``fit`` continues the same run id (``resume="allow"``; offline, each attempt is a
    new ``offline-run-*`` directory of that id, which ``wandb sync`` uploads to that run oldest
    first), with every step once across the attempts, also after a SIGKILL. wandb's service
    buffers its ``.wandb`` file (a killed process loses what the buffer held: every step of a
    short attempt), so a step counts as logged only once an attempt's file holds it. Until then it
    is in ``wandb_steps.jsonl``, a journal written before each ``run.log``; a resumed ``fit``
    reads the earlier attempts' files, logs again from the journal the steps up to the checkpoint
    that none of them holds, and then logs only steps after the last one they hold. Online, the
    server's last step (``run.starting_step``) takes the files' place. The id is kept in
    ``wandb_run.json``. A fresh ``fit`` starts a new run.

    Args:
        project: The wandb project.
        name: The run's display name (wandb makes one up when ``None``).
        entity: The wandb user or team (online mode).
        tags: Tags of the run.
        mode: ``"offline"`` or ``"online"``.
        save_dir: Directory of ``wandb_run.json``, ``wandb_steps.jsonl`` and of wandb's ``wandb/``
            folder; ``None`` means the Trainer's ``default_root_dir``.
        init_kwargs: More keyword arguments for ``wandb.init`` (``group``, ``notes``,
            ``settings``...).

    Attributes:
        run: The ``wandb`` run while ``fit`` runs (on the main process), else ``None``.

    Raises:
        ImportError: wandb is not installed.

    Example:
        >>> import distkit
        >>> from distkit.trainer import WandbLogger
        >>> logger = WandbLogger("digits", name="mlp-lr1e-3")  # doctest: +SKIP
        >>> trainer = distkit.Trainer(logger=logger, resume="auto")  # doctest: +SKIP
    """

    _STATE_FILE = "wandb_run.json"
    _JOURNAL_FILE = "wandb_steps.jsonl"
    # init_kwargs that are records of the run (sent as they are), not settings of the client.
    _RECORDED_KWARGS = ("notes", "group", "job_type", "config")

    def __init__(
        self,
        project: str = "distkit",
        *,
        name: str | None = None,
        entity: str | None = None,
        tags: Sequence[str] | None = None,
        mode: str = "offline",
        save_dir: str | os.PathLike[str] | None = None,
        init_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        _require("wandb", "WandbLogger", "wandb")
        if mode not in ("offline", "online"):
            raise ValueError(f"mode must be 'offline' or 'online', got {mode!r}.")
        reserved = {"id", "resume", "dir", "mode", "project", "reinit"} & set(init_kwargs or {})
        if reserved:
            raise ValueError(
                f"init_kwargs must not set {sorted(reserved)}: the logger sets them (pass project= "
                f"and mode= to the logger, and save_dir= for dir)."
            )
        self.project = project
        self.name = name
        self.entity = entity
        self.tags = list(tags or [])
        # Checked above; spelled out as the Literal that wandb.init() is annotated to take.
        self.mode: Literal["offline", "online"] = "online" if mode == "online" else "offline"
        self.save_dir = None if save_dir is None else Path(save_dir)
        self.init_kwargs = dict(init_kwargs or {})
        self.run: Any = None
        self._state_path: Path | None = None
        self._journal_path: Path | None = None
        self._lock: _LocalWriterLock | None = None
        self._journal: IO[str] | None = None
        # The last step the run's earlier attempts hold: the resumed attempt logs only after it.
        self._last_held = -1

    def setup(self, save_dir: Path, resume_step: int | None) -> None:
        import wandb

        directory = self.save_dir or save_dir
        directory.mkdir(parents=True, exist_ok=True)
        # One run at a time keeps wandb_run.json and the journal (which a fresh run empties).
        self._lock = _claim(directory / self._STATE_FILE)
        make_private_dir(directory / "wandb")  # wandb's files are the owner's, as the checkpoints
        self._state_path = directory / self._STATE_FILE
        self._journal_path = directory / self._JOURNAL_FILE
        previous = _read_json(self._state_path) if resume_step is not None else None
        if previous is not None and not (
            previous.get("project") == self.project and isinstance(previous.get("run_id"), str)
        ):
            previous = None
        if resume_step is not None and previous is None:
            _log.warning(
                "WandbLogger: resuming, but %s names no run of project %r; starting a new wandb run",
                self._state_path,
                self.project,
            )
        last_held = -1
        pending: list[tuple[int, dict[str, float]]] = []
        if previous is not None and resume_step is not None:
            last_held = _wandb_last_held_step(directory / "wandb", previous["run_id"])
            # Steps after the checkpoint are logged again by the resumed training itself.
            pending = [(step, row) for step, row in _read_journal(self._journal_path) if step <= resume_step]
        kwargs = {
            key: redact_data(value) if key in self._RECORDED_KWARGS else value
            for key, value in self.init_kwargs.items()
        }
        # wandb reads WANDB_ERROR_REPORTING when it starts its service: offline means nothing
        # leaves the machine, a crash report included.
        quiet = _env(WANDB_ERROR_REPORTING="false") if self.mode == "offline" else contextlib.nullcontext()
        with quiet, _redacted_argv():
            self.run = wandb.init(
                project=self.project,
                name=None if self.name is None else redact_text(self.name),
                entity=self.entity,
                tags=[redact_text(tag) for tag in self.tags] or None,
                id=previous["run_id"] if previous else None,
                resume="allow" if previous else None,
                dir=str(directory),
                mode=self.mode,
                # Beside any run the user has open, which a default init would finish.
                reinit="create_new",
                **kwargs,
            )
        if self.mode == "online" and previous is not None:
            # The server holds what it received; wandb drops a step below its next one.
            last_held = int(getattr(self.run, "starting_step", 0) or 0) - 1
        self._last_held = last_held
        # What the earlier attempts hold leaves the journal; the rest is logged again, in order.
        pending = [(step, row) for step, row in pending if step > self._last_held]
        _write_journal(self._journal_path, pending)
        self._journal = _open_journal(self._journal_path)
        for step, row in pending:
            self.run.log(row, step=step)
        if pending:
            _log.info(
                "WandbLogger: logged again steps %d-%d of run %s, which the killed attempt's files "
                "did not hold (from %s)",
                pending[0][0],
                pending[-1][0],
                self.run.id,
                self._journal_path.name,
            )
        _write_json(self._state_path, {"project": self.project, "run_id": self.run.id})

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        # A resumed run may get other values (another world size): the latest ones win.
        self.run.config.update(plain_params(params), allow_val_change=True)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        if step <= self._last_held:
            return  # an earlier attempt's file holds it
        fresh = {key: float(value) for key, value in metric_names(metrics).items()}
        if not fresh:
            return
        # The journal first: if the process dies before wandb's service has written this step,
        # the resumed fit finds it there.
        assert self._journal is not None, "setup() runs first"
        self._journal.write(json.dumps({"step": step, "metrics": fresh}) + "\n")
        self._journal.flush()  # in the kernel's hands: a killed process cannot lose it
        self.run.log(fresh, step=step)

    def log_checkpoint(self, path: str, step: int) -> None:
        self.run.summary["checkpoint"] = redact_url(path)
        self.run.summary["checkpoint_step"] = step

    def finalize(self) -> None:
        try:
            self._finish()
        finally:
            if self._lock is not None:
                self._lock.release()
                self._lock = None

    def _finish(self) -> None:
        if self.run is None:
            return
        run, self.run = self.run, None
        failing = _failing()
        finished = False
        try:
            run.finish(exit_code=1 if failing else 0)
            finished = True
            _stop_wandb_service()
        except Exception as err:
            if not failing:
                raise
            _log.warning("WandbLogger: could not finish run %s: %s", run.id, redact_text(str(err)))
        finally:
            if self._journal is not None:
                self._journal.close()
                self._journal = None
            if finished and self._journal_path is not None:
                # finish() returned: the attempt's file holds every step, the journal none it lacks.
                _write_journal(self._journal_path, [])

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "run": None, "_journal": None, "_lock": None}


def _require(module: str, who: str, extra: str) -> None:
    """Fail early when ``module`` cannot be imported, without importing it (it is slow)."""
    try:
        found = importlib.util.find_spec(module) is not None
    except ValueError:  # sys.modules[module] is None: Python's marker for "import fails"
        found = False
    if not found:
        raise ImportError(
            f"{who} needs the {module} package, which is not installed: pip install 'distkit[{extra}]'."
        )


@contextlib.contextmanager
def _env(**values: str) -> Iterator[None]:
    """Set environment variables the user has not set, for the block only."""
    added = {name: value for name, value in values.items() if name not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


def _mlflow_client(uri: str) -> Any:
    if "mlflow" not in sys.modules:
        # MLflow 3 decides at import whether to send usage telemetry (to its servers, for every
        # run and log_batch); imported here first, it does not. A program that imported mlflow
        # itself keeps its own choice (MLFLOW_DISABLE_TELEMETRY, DO_NOT_TRACK).
        with _env(MLFLOW_DISABLE_TELEMETRY="true"):
            import mlflow  # noqa: F401
    from mlflow.tracking import MlflowClient

    # MLflow 3 refuses its file store (in "maintenance mode") unless MLFLOW_ALLOW_FILE_STORE is
    # set; it reads the variable when it builds the store, which it then caches per URI. Without
    # sqlalchemy (mlflow-skinny) the file store is the only local one.
    local = uri.startswith("file:") or "://" not in uri
    with _env(MLFLOW_ALLOW_FILE_STORE="true") if local else contextlib.nullcontext():
        return MlflowClient(tracking_uri=uri)


def _stop_wandb_service() -> None:
    """Stop wandb's service process (``wandb-core``) unless another run of this process uses it."""
    import wandb

    try:
        from wandb.sdk import wandb_setup

        active = wandb_setup.singleton().most_recent_active_run  # a property in wandb 0.31
        others = (active() if callable(active) else active) is not None
    except (ImportError, AttributeError):  # another wandb version: its global run is what we see
        others = wandb.run is not None
    if others:
        return
    try:
        wandb.teardown()
    except SystemExit as err:  # teardown exits when the service reports a failure
        _log.warning("WandbLogger: wandb's service ended with code %s", err.code)


def _flatten(params: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in params.items():
        if isinstance(value, Mapping) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _as_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, default=str)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        with open(path) as handle:
            return dict(json.load(handle))
    except (OSError, ValueError):
        return None


def _write_json(path: Path, state: Mapping[str, Any]) -> None:
    with atomic_open(path, mode=FILE_MODE) as handle:
        handle.write(json.dumps(dict(state), indent=2, sort_keys=True).encode())


@contextlib.contextmanager
def _redacted_argv() -> Iterator[None]:
    """``sys.argv`` with its credentials redacted for the block: wandb records the command line
    when the run starts (the ``environment`` record of the ``.wandb`` file, ``wandb-metadata.json``
    online), and offers no setting to give it another."""
    original = list(sys.argv)
    sys.argv[1:] = redact_argv(original[1:])
    try:
        yield
    finally:
        sys.argv[:] = original


# -- the wandb journal: the steps logged, until an attempt's .wandb file holds them -----------------


def _read_journal(path: Path) -> list[tuple[int, dict[str, float]]]:
    """The journal's ``(step, metrics)`` lines, in order; a torn last line (the process was killed
    while writing it) is left out."""
    entries: list[tuple[int, dict[str, float]]] = []
    try:
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                try:
                    entry = json.loads(line)
                    row = {str(name): float(value) for name, value in entry["metrics"].items()}
                    entries.append((int(entry["step"]), row))
                except (ValueError, KeyError, TypeError, AttributeError):
                    continue
    except FileNotFoundError:
        pass
    return entries


def _write_journal(path: Path, entries: Sequence[tuple[int, Mapping[str, float]]]) -> None:
    text = "".join(json.dumps({"step": step, "metrics": dict(row)}) + "\n" for step, row in entries)
    with atomic_open(path, mode=FILE_MODE) as handle:
        handle.write(text.encode())


def _open_journal(path: Path) -> IO[str]:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), FILE_MODE)
    return os.fdopen(fd, "a", encoding="utf-8")


# wandb's .wandb file: LevelDB's log format, after a 7-byte header (":W&B", a 2-byte magic number,
# a version byte). 32 KiB blocks of chunks, each with a 7-byte header: CRC-32 of the type byte and
# the data (zlib's), the data's length, and its type (FULL, FIRST, MIDDLE, LAST; 0 pads a block).
_WANDB_HEADER = b":W&B"
_FILE_HEADER_SIZE = 7
_BLOCK = 32 * 1024
_CHUNK_HEADER = struct.Struct("<IHB")


def _wandb_last_held_step(wandb_dir: Path, run_id: str) -> int:
    """The last history step that the ``.wandb`` files of ``run_id``'s attempts hold, or -1.

    Each attempt's file holds a prefix of what that attempt logged (wandb's service writes in
    order, and a killed one leaves a torn or missing tail), so the last step is all a resume needs.
    """
    return max(
        (_last_history_step(path) for path in wandb_dir.glob(f"*-{run_id}/run-{run_id}.wandb")), default=-1
    )


def _last_history_step(path: Path) -> int:
    """The step of the last whole history record of a ``.wandb`` file (-1 if none), read from the
    end: chunks start on block boundaries, so a window of the last blocks is parsed, and widened
    until it holds a history record."""
    try:
        data = path.read_bytes()
    except OSError as err:
        _log.warning("WandbLogger: cannot read %s (%s); counting none of its steps as logged", path, err)
        return -1
    if not data.startswith(_WANDB_HEADER):
        return -1
    window = 2 * _BLOCK
    while True:
        start = max(0, (len(data) - window) // _BLOCK * _BLOCK)
        steps = _history_steps(data, start)
        if steps or start == 0:
            return steps[-1] if steps else -1
        window *= 4


def _history_steps(data: bytes, start: int) -> list[int]:
    """The history steps of the records that begin at or after ``start`` (a block boundary), up to
    the first torn or damaged chunk (where a killed service stopped writing)."""
    from wandb.proto import wandb_internal_pb2

    steps: list[int] = []
    position = max(start, _FILE_HEADER_SIZE)  # block 0 begins with the file header
    pending: bytes | None = None
    while position + _CHUNK_HEADER.size <= len(data):
        left = _BLOCK - position % _BLOCK
        if left < _CHUNK_HEADER.size:  # too little room for a header: the block's trailer
            position += left
            continue
        crc, length, kind = _CHUNK_HEADER.unpack_from(data, position)
        if kind == 0 and crc == 0 and length == 0:  # zero padding up to the block's end
            position += left
            continue
        chunk = data[position + _CHUNK_HEADER.size : position + _CHUNK_HEADER.size + length]
        if len(chunk) < length or zlib.crc32(chunk, zlib.crc32(bytes([kind]))) != crc:
            break  # torn or damaged: nothing after it was written whole
        position += _CHUNK_HEADER.size + length
        if kind in (1, 2):  # FULL, FIRST
            pending = chunk
        elif pending is None:  # MIDDLE or LAST of a record that began before the window
            continue
        else:
            pending += chunk
        if kind in (1, 4):  # FULL, LAST: a whole record
            # protobuf's generated module makes its classes at import time: invisible to mypy.
            record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]
            try:
                record.ParseFromString(pending)
            except Exception:  # protobuf's DecodeError
                break
            pending = None
            if record.WhichOneof("record_type") == "history":
                steps.append(record.history.step.num)
    return steps
