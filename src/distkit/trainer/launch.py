"""Start local DDP processes for ``python train.py`` through torch's own elastic launcher.

When ``fit`` runs outside any launcher and the plan wants N processes, it sends itself, the model
and the data to N workers started by :func:`torch.distributed.launcher.api.elastic_launch` (the
machinery behind ``torchrun --standalone``): a c10d rendezvous on 127.0.0.1 with a free port,
workers started with ``spawn``; when a worker raises, the first failing rank's own exception is
raised in the launching process, with the worker's traceback as a note. Inside each worker ``fit``
finds torchrun's variables and joins the job.

A worker must start ``fit`` where a torchrun rank of the same script would: a ``spawn``\\ ed process
has fresh random generators, distkit's default loader seed and torch's default settings, while each
torchrun rank ran the script up to ``fit`` and so has what it seeded, drew and set. The workers get
the launching process's seeding (:func:`distkit.seeding._capture_process_seeding`) and the few torch
settings a script commonly changes (default dtype, float32 matmul precision).
"""

from __future__ import annotations

import ast
import contextlib
import io
import logging
import multiprocessing
import os
import pickle
import signal
import sys
import tempfile
import threading
import traceback
import types
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from distkit._utils.fs import atomic_open
from distkit.errors import DistkitError
from distkit.seeding import (
    _capture_process_seeding,
    _restore_process_seeding,
    capture_rng_state,
    restore_rng_state,
)
from distkit.trainer import strategies
from distkit.trainer._loop import setup as _setup
from distkit.trainer._loop.preemption import _Preempted
from distkit.trainer._loop.state import _CallbackStates
from distkit.trainer._run import Options, Outcome, checkpoint_callback
from distkit.trainer.strategies import LOCAL_RUN_PREFIX
from distkit.trainer.strategies._base import _tree_to_cpu
from distkit.trainer.strategies._fsdp import full_state

if TYPE_CHECKING:
    from torch import nn


__all__: list[str] = []

# How long the workers may take to meet at the rendezvous. Local workers start within seconds;
# a minute covers a loaded machine importing torch N times at once.
_RENDEZVOUS_TIMEOUT_S = 60

_GUARD_FIX = (
    "fit() starts its processes with 'spawn', and every one of them imports the script again "
    "(as '__mp_main__'), so training code at the top level of the script runs again in each of "
    "them. Put it under a guard:\n\n"
    '    if __name__ == "__main__":\n'
    "        main()\n\n"
    "or start the script with `torchrun --nproc_per_node=N`, which needs none."
)


def check_main_guard(nprocs: int) -> None:
    """Refuse to start workers when ``fit`` is reached from the main script's unguarded top level.

    Local. ``spawn`` re-runs the main script in every worker: without ``if __name__ ==
    "__main__":`` each worker would reach ``fit`` again while importing it and fail in
    multiprocessing's bootstrapping check (hundreds of lines of tracebacks from every worker). The
    check reads the script's syntax tree: the line of the script's top level being run must lie
    inside an ``if`` that tests ``__name__`` against ``"__main__"``. It is skipped where ``spawn``
    does not re-run anything (interactive sessions, ``python -c``, standard input, a package's
    ``__main__.py``) or the source cannot be read.

    Raises:
        DistkitError: The guard is missing; the message shows the fix.
    """
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        # A spawned process importing the main script: its parent had no guard either (this is
        # multiprocessing's own test for it), and the parent-side check below was skipped.
        raise DistkitError(f"fit() was reached while a worker process imported the main script. {_GUARD_FIX}")
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    spec_name = getattr(getattr(main, "__spec__", None), "name", None) or ""
    if main is None or not path or spec_name == "__main__" or spec_name.endswith(".__main__"):
        return
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None and not (frame.f_code.co_name == "<module>" and frame.f_globals is vars(main)):
        frame = frame.f_back
    if frame is None:
        return
    try:
        with open(frame.f_code.co_filename, encoding="utf-8") as handle:
            tree = ast.parse(handle.read())
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return
    line = frame.f_lineno
    # Lenient, so that no guarded script is refused: any `if` (or conditional expression) that
    # looks at __name__ and "__main__", at any depth, guards the lines it spans.
    for node in ast.walk(tree):
        if not isinstance(node, (ast.If, ast.IfExp)):
            continue
        if node.lineno <= line <= (node.end_lineno or 0) and _tests_main(node.test):
            return
    raise DistkitError(
        f"{os.path.basename(frame.f_code.co_filename)}, line {line}: fit() with {nprocs} processes was "
        f'called from the top level of the script without an `if __name__ == "__main__":` guard. '
        f"{_GUARD_FIX}"
    )


def _tests_main(test: ast.expr) -> bool:
    """Whether a test compares ``__name__`` with ``"__main__"`` somewhere (``==``, ``!=``, ``and``...)."""
    for node in ast.walk(test):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(isinstance(side, ast.Name) and side.id == "__name__" for side in sides) and any(
                isinstance(side, ast.Constant) and side.value == "__main__" for side in sides
            ):
                return True
    return False


def serialize(what: str, payload: tuple[Any, ...]) -> bytes:
    """Pickle what the workers need, with an error that says which object cannot travel.

    Plain pickle copies tensors into the bytes. Handing tensors to ``multiprocessing`` directly
    would move them to shared memory, and every worker would then train the same parameters.
    """
    buffer = io.BytesIO()
    pickler = _MainNamesPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL)
    try:
        pickler.dump(payload)
    except (pickle.PicklingError, TypeError, AttributeError) as err:
        raise DistkitError(
            f"fit() starts its own processes and sends them {what}, but something in it cannot be "
            f"pickled: {err}. Define models, datasets, loss and metric functions at module level (no "
            f"lambdas, no local classes), pass an optimizer factory instead of an object holding "
            f"unpicklable state, or start the script under `torchrun --nproc_per_node=N`, which needs "
            f"no pickling."
        ) from err
    guarded = _defined_under_guard(pickler.main_names)
    if guarded:
        names = ", ".join(guarded)
        raise DistkitError(
            f"fit() starts its own processes and sends them {what}, which refer to {names} of the "
            f"script; but {names} {'is' if len(guarded) == 1 else 'are'} defined under its `if "
            f'__name__ == "__main__":` block, which the processes do not run (they import the '
            f"script as '__mp_main__'), so they could not find {'it' if len(guarded) == 1 else 'them'}. "
            f"Define {names} at the module level, above the guard, or start the script under "
            f"`torchrun --nproc_per_node=N`."
        )
    return buffer.getvalue()


class _MainNamesPickler(pickle.Pickler):
    """A pickler that notes the classes and functions of the main script it refers to by name."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.main_names: set[str] = set()

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, (type, types.FunctionType)) and getattr(obj, "__module__", None) == "__main__":
            self.main_names.add(obj.__qualname__.split(".", 1)[0])
        return NotImplemented


def _defined_under_guard(names: set[str]) -> list[str]:
    """Those of ``names`` that the main script binds only inside an ``if __name__ == "__main__":``
    block (so a worker importing it lacks them); none when its source cannot be read."""
    if not names:
        return []
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    try:
        with open(str(path), encoding="utf-8") as handle:
            tree = ast.parse(handle.read())
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return []
    outside: set[str] = set()
    inside: set[str] = set()
    for node in tree.body:
        guarded = isinstance(node, ast.If) and _tests_main(node.test)
        for child in ast.walk(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                (inside if guarded else outside).add(child.name)
            elif isinstance(child, ast.Name) and isinstance(child.ctx, ast.Store):
                (inside if guarded else outside).add(child.id)
    return sorted(name for name in names if name in inside and name not in outside)


def process_state() -> dict[str, Any]:
    """What a torchrun rank of this script would have at this point and a spawned worker lacks.

    Local: this process's seeding and torch settings, for :func:`_worker` to apply before ``fit``.
    """
    return {
        "seeding": _capture_process_seeding(),
        "default_dtype": torch.get_default_dtype(),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }


def _apply_process_state(state: dict[str, Any]) -> None:
    torch.set_default_dtype(state["default_dtype"])
    torch.set_float32_matmul_precision(state["float32_matmul_precision"])
    # Last: nothing may draw from the generators between this and fit().
    _restore_process_seeding(state["seeding"])


# The signals torch's elastic agent handles (TORCHELASTIC_SIGNALS_TO_HANDLE's default).
_AGENT_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT") if hasattr(signal, name)
)


def launch(nprocs: int, payload: bytes) -> dict[int, Any]:
    """Run :func:`_worker` on ``nprocs`` local processes; return each rank's return value.

    Local to this process (it becomes the launcher agent). When a worker raises, this raises the
    first failing rank's own exception (see :func:`_worker_error`); when one dies without raising
    (a signal, ``os._exit``), torch's ``ChildFailedError``.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nprocs,
        run_id=f"{LOCAL_RUN_PREFIX}{uuid.uuid4().hex[:12]}",
        # As `torchrun --standalone`: a c10d rendezvous whose store picks a free port, bound to the
        # loopback address so that nothing outside this machine can join.
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        rdzv_configs={"timeout": _RENDEZVOUS_TIMEOUT_S},
        local_addr="127.0.0.1",
        max_restarts=0,
        start_method="spawn",
    )
    with tempfile.TemporaryDirectory(prefix="distkit-fit-") as errors:
        # The agent logs every failing worker's traceback at ERROR level, then raises a
        # ChildFailedError holding it again: three copies of one error. A worker's exception is
        # raised here instead, once, with its traceback; torch's report stays for deaths that
        # leave no exception behind.
        agent_log = logging.getLogger("torch.distributed.elastic")
        level = agent_log.level
        agent_log.setLevel(logging.CRITICAL)
        # The agent installs handlers that raise SignalException for SIGTERM, SIGINT, SIGHUP and
        # SIGQUIT and never puts the previous ones back: Ctrl-C in a notebook after fit() would
        # raise it in whatever runs next. They are put back here.
        handlers = {signum: signal.getsignal(signum) for signum in _AGENT_SIGNALS}
        try:
            results: dict[int, Any] = elastic_launch(config, _worker)(payload, errors)
            return results
        except ChildFailedError as failure:
            raise _worker_error(failure, errors, nprocs) from None
        finally:
            agent_log.setLevel(level)
            if threading.current_thread() is threading.main_thread():
                for signum, handler in handlers.items():
                    if handler is not None:  # None: set outside Python, cannot be put back
                        signal.signal(signum, handler)


def _worker_error(failure: Any, errors: str, nprocs: int) -> BaseException:
    """The exception to raise for a failed launch: the first failing rank's own, when it left one.

    Its type and message are the worker's (a ``CheckpointConflictError`` stays one), with a note
    holding the worker's traceback and one line per other failing rank, as ``ChildFailedError``
    orders them; an exception that cannot be rebuilt here becomes a :class:`DistkitError` with its
    text. ``failure`` itself when the first failing rank left no report.
    """
    first, _ = failure.get_first_failure()
    reports: dict[int, tuple[BaseException | None, str, str]] = {}
    unreadable = (OSError, EOFError, pickle.UnpicklingError, AttributeError, ImportError)
    # Every rank's report, also of a rank the agent stopped before it noticed its exit (it stops the
    # others at the first exit it sees, and lists only the ranks that had ended).
    for rank in range(nprocs):
        with contextlib.suppress(*unreadable), open(os.path.join(errors, f"rank{rank}.pkl"), "rb") as report:
            reports[rank] = pickle.load(report)
    if first not in reports and reports:
        # A rank that raised left a report; a rank that only waited for it did not (it exits with
        # PEER_FAILED_EXIT_CODE, or the hang code), even when it ended first.
        ended = [rank for rank in reports if rank in failure.failures]
        first = min(ended, key=lambda rank: failure.failures[rank].timestamp) if ended else min(reports)
    if first not in reports:
        return failure  # type: ignore[no-any-return]
    error, summary, trace = reports[first]
    if error is None:
        error = DistkitError(summary)
    others = [
        f"  rank {rank}/{nprocs}: "
        + (reports[rank][1] if rank in reports else f"exit code {failure.failures[rank].exitcode}")
        for rank in sorted(failure.failures)
        if rank != first
    ]
    process = f"pid {failure.failures[first].pid}" if first in failure.failures else "stopped by the launcher"
    note = f"raised in fit()'s worker process rank {first}/{nprocs} ({process}):\n{trace}"
    if others:
        note += "other failing ranks:\n" + "\n".join(others)
    if hasattr(error, "add_note"):  # Python >= 3.11
        error.add_note(note.rstrip("\n"))
        return error
    return DistkitError(f"{summary}\n{note.rstrip()}")  # Python 3.10


def _report_failure(errors: str, err: BaseException) -> None:
    """Leave ``err`` where the launching process finds it (a pickle of it, its summary, its traceback)."""
    summary = f"{type(err).__name__}: {err}"
    trace = "".join(traceback.format_exception(type(err), err, err.__traceback__))
    try:
        data = pickle.dumps((err, summary, trace), protocol=pickle.HIGHEST_PROTOCOL)
        pickle.loads(data)  # must rebuild in the launching process too (no local classes, no locks)
    except Exception:
        data = pickle.dumps((None, summary, trace), protocol=pickle.HIGHEST_PROTOCOL)
    with atomic_open(os.path.join(errors, f"rank{os.environ.get('RANK', '0')}.pkl")) as out:
        out.write(data)


def _worker(payload: bytes, errors: str) -> bytes:
    # Each worker is a fresh interpreter. As torchrun does for several processes per node: one
    # thread each unless the user chose a number. The thread count changes how floating-point sums
    # are split, so any other default would make `python train.py` train another job than
    # `torchrun train.py` (issue 11); OMP_NUM_THREADS=k gives k threads under both.
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = "1"  # for the processes this worker starts, as torchrun's
        torch.set_num_threads(1)
    trainer, method, model, args, kwargs, state = pickle.loads(payload)
    _apply_process_state(state)
    preempted = False
    try:
        result = getattr(trainer, method)(model, *args, **kwargs)
        if method != "fit":  # validate, test, predict: rank 0's answer is the job's
            return pickle.dumps(result if trainer.is_main_process else None, protocol=pickle.HIGHEST_PROTOCOL)
    except _Preempted:
        preempted = True
    except BaseException as err:
        _report_failure(errors, err)
        raise
    # On every rank: a sharded model is gathered from all of them (None on the other ranks).
    outcome = worker_outcome(trainer, preempted)
    return pickle.dumps(outcome, protocol=pickle.HIGHEST_PROTOCOL)


def run_workers(
    trainer: Options, plan: strategies._Plan, model: nn.Module, data: tuple[Any, Any], kwargs: dict[str, Any]
) -> dict[str, Any]:
    """Train on ``plan.local_processes`` new processes; rank 0's final state (:func:`worker_outcome`)."""
    check_main_guard(plan.local_processes)
    payload = serialize(
        "the trainer, model, data, optimizer and functions",
        (trainer, "fit", model, data, kwargs, process_state()),
    )
    results = launch(plan.local_processes, payload)
    final: dict[str, Any] = pickle.loads(results[0])
    return final


def run_method(
    trainer: Options,
    plan: strategies._Plan,
    method: str,
    model: nn.Module,
    data: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """Run ``trainer.<method>`` (validate, test or predict) on ``plan.local_processes`` new
    processes and return rank 0's result."""
    check_main_guard(plan.local_processes)
    payload = serialize(
        f"the trainer, model and data of {method}()", (trainer, method, model, data, kwargs, process_state())
    )
    results = launch(plan.local_processes, payload)
    return pickle.loads(results[0])


def worker_outcome(trainer: Options, preempted: bool) -> dict[str, Any] | None:
    """What rank 0 of launched workers sends back to the process that started them (``None`` on
    the other ranks), read from the Trainer's public properties after ``fit``. Collective: a
    sharded model is gathered from every rank."""
    model, optimizer = trainer.model, trainer.optimizer
    if model is None or optimizer is None:  # fit() returned without setting up (it cannot)
        raise DistkitError("fit() ended in a started process without a model or optimizer to send back.")
    full = full_state(model, optimizer)
    if full is None:
        return None
    scheduler = trainer.lr_scheduler
    return {
        "model": full[0],
        "optimizer": full[1],
        "lr_scheduler": None if scheduler is None else _tree_to_cpu(scheduler.state_dict()),
        "callbacks": _tree_to_cpu(_CallbackStates(trainer.callbacks).state_dict()),
        "global_step": trainer.global_step,
        # What a scheduler factory reads (steps_per_epoch, total_steps, effective_batch_size).
        "num_batches": trainer.num_training_batches,
        "effective_batch_size": trainer.effective_batch_size,
        "current_epoch": trainer.current_epoch,
        "skipped_steps": trainer.skipped_steps,
        "should_stop": trainer.should_stop,
        "callback_metrics": dict(trainer.callback_metrics),
        "rng": capture_rng_state(),
        "preempted": preempted,
    }


def outcome_of(final: Mapping[str, Any], model: nn.Module, world_size: int) -> Outcome:
    """What the Trainer shows after rank 0 of its workers sent ``final``: ``model`` holding rank 0's
    final weights, the counters, metrics and sizes (the optimizer and scheduler come after, from
    :func:`take_objects`, as a scheduler factory reads the sizes). Local."""
    model.load_state_dict(final["model"])
    return Outcome(
        model=model,
        world_size=world_size,
        global_step=final["global_step"],
        current_epoch=final["current_epoch"],
        skipped_steps=final["skipped_steps"],
        should_stop=final["should_stop"],
        callback_metrics=final["callback_metrics"],
        num_batches=final["num_batches"],
        effective_batch_size=final["effective_batch_size"],
    )


def take_objects(
    trainer: Options, outcome: Outcome, model: nn.Module, kwargs: Mapping[str, Any], final: Mapping[str, Any]
) -> None:
    """Make this (launching) process's objects what rank 0's were at the end of ``fit``.

    The optimizer (the object passed, or one the factory makes here over the model's parameters),
    the scheduler likewise, the callbacks' ``state_dict()``, and the random generators: code after
    ``fit`` sees what rank 0 of a torchrun job would. ``trainer`` already shows ``outcome``. Local.
    """
    outcome.optimizer = optimizer = _setup.make_optimizer(model, kwargs["optimizer"])
    # Made before the optimizer's state is loaded: a new scheduler sets the learning rates.
    outcome.lr_scheduler = scheduler = _setup.make_scheduler(trainer, optimizer, kwargs["lr_scheduler"])
    optimizer.load_state_dict(final["optimizer"])
    if scheduler is not None and final["lr_scheduler"] is not None:
        scheduler.load_state_dict(final["lr_scheduler"])
    _CallbackStates(trainer.callbacks).load_state_dict(final["callbacks"])
    checkpoint = checkpoint_callback(trainer.callbacks)
    if checkpoint is not None:
        checkpoint.setup(trainer)  # its manager reads the workers' checkpoints (latest(), best())
    restore_rng_state(final["rng"])
