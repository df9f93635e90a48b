"""The hang doctor: where every rank is, asked through the job's store, and one report when stuck.

Private; the user-facing switches are ``distkit.init(hang_timeout_s=...)``,
``Trainer(hang_timeout_s=...)`` and ``DISTKIT_HANG_TIMEOUT_S``; ``docs/debugging.md`` explains the
design and its limits. Per rank, one :class:`Doctor` (made by ``distkit.init`` in a job of several
processes) owns:

- a **responder** thread, always on: it blocks on its own key of the store (``hang/wake/<rank>``, on
  a connection of its own, so it costs nothing while idle) and answers each request with where the
  watched thread (the one that called ``init``, or the one running ``Trainer.fit``) is;
- a **watchdog** thread, only when a hang timeout is set: a few times per timeout it reads the
  watched thread's stack (``sys._current_frames``: a thread blocked in a collective has released the
  GIL) and how many collectives this rank has issued; when the thread has sat in the same wait, with
  no collective issued, for longer than the timeout, it starts a **roll call**;
- the **roll call**: one rank wins ``add("hang/report")``, asks every rank where it is, waits a
  bounded time for the answers (a rank that does not answer is named, dead or silent), prints one
  report to stderr, writes it to a file in the run directory, and every rank exits with
  :data:`HANG_EXIT_CODE`;
- the **slow-collective check** of distkit's own collectives: when one of them is still pending
  after :data:`FIRST_CHECK_S`, one waiting rank asks where the others are. A rank that computes is
  late; a rank that waits in another collective, or has ended, can never arrive: then the ranks that
  arrived raise :class:`~distkit.CollectiveMismatchError` (or, with the watchdog on, the roll call
  reports it), instead of waiting for the process group's timeout.

Nothing here ever uses a collective: only the store, so a stuck collective cannot stop it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import socket
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from types import TracebackType
from typing import Any, NoReturn

import torch.distributed as dist

from distkit._doctor import report as _hang_report, where as _hang_where
from distkit._doctor.where import BUSY, WAIT
from distkit._utils import daemon
from distkit._utils.secrets import redact_text
from distkit.errors import CollectiveMismatchError, DistkitError, MainProcessError

__all__ = ["HANG_EXIT_CODE", "PEER_FAILED_EXIT_CODE"]

#: Exit code of every rank after a hang report: ``timeout(1)``'s code for "timed out".
HANG_EXIT_CODE = 124
#: Exit code of a rank that only waited for another rank which failed (raised, or died): the
#: failing rank exits with its own code, first, so that launchers name it as the root cause.
PEER_FAILED_EXIT_CODE = 125
ENV_TIMEOUT = "DISTKIT_HANG_TIMEOUT_S"
ENV_RUN_DIR = "DISTKIT_RUN_DIR"
# "auto" (the Trainer's default): never below five minutes, else ten times the slowest step seen
# so far. A wait that long is no imbalance between healthy ranks: their steps take the same time.
AUTO_FLOOR_S = 300.0
AUTO_MULTIPLE = 10.0
# The shortest watchdog timeout accepted: below it, an ordinary wait (a rank a moment late, a
# distkit collective before its first check) would end a healthy job.
MIN_TIMEOUT_S = 1.0
# A distkit collective still pending after this long asks where the others are. Healthy ones take
# about a millisecond here (FACTS.md); a rank one second late costs one query of the store.
FIRST_CHECK_S = 1.0
# A rank seen in another collective is seen there once more, this much later, before the verdict:
# a rank that was passing through (between two operations) is not blamed.
_CONFIRM_S = 0.5
# Later checks of the same pending collective back off to this.
_MAX_CHECK_S = 30.0
# Ranks that arrived, other than the one that checks, look for its verdict this often.
_VERDICT_POLL_S = 1.0
# How long a query waits for live ranks' answers. A responder answers within milliseconds unless
# the rank holds the GIL in C code (then it is named as silent).
_QUERY_ANSWER_S = 3.0
# How long a rank asked where it is waits for its own failure's record to be written (a source
# parse, tens of milliseconds on a busy machine), well within the asker's _QUERY_ANSWER_S.
_RECORDING_WAIT_S = 1.0
_ROLL_CALL_ANSWER_S = 5.0
# How long a rank waits for the reporting rank's report before it exits on its own.
_FOLLOW_S = 60.0
# How long the reporter waits for the other ranks to exit before it exits itself (so that a
# launcher which kills the survivors of a failed rank sees every rank end alike).
_EXITS_S = 3.0
# How long the reporter waits for a rank that raised to end its process before the waiting ranks
# exit: launchers (torchrun, mp.spawn, Trainer's self-launch) name the first process to end as the
# root cause. A rank that raised ends within a second here; more is a rank stuck in its clean-up.
_CAUSE_EXIT_S = 5.0
# How long a rank that raised and hosts the store waits for another rank to start the report: the
# others' collectives fail within about 0.3 s of its groups closing (FACTS.md).
_LINGER_START_S = 3.0
# A watchdog that woke this much later than asked was suspended with its process (SLURM suspends a
# job with SIGSTOP): the time it was stopped is not time spent waiting.
_GAP_S = 5.0
_THREAD_STOP_S = 2.0
_FOREVER = timedelta(days=3650)

# Errors of a collective whose peer is gone, or whose timeout passed (gloo's and NCCL's words).
_TRANSPORT_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Timed out waiting",
    "Socket Timeout",
    "NCCL communicator was aborted",
    "Watchdog caught collective operation timeout",
)
_OFF_WORDS = frozenset({"", "0", "off", "none", "false", "no"})


# -- settings -------------------------------------------------------------------------------------


class _Unset:
    pass


_UNSET = _Unset()


def _from_environment() -> float | str | _Unset | None:
    raw = os.environ.get(ENV_TIMEOUT)
    if raw is None:
        return _UNSET
    text = raw.strip().lower()
    if text in _OFF_WORDS:
        return None
    if text == "auto":
        return "auto"
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise ValueError(
            f"{ENV_TIMEOUT}={raw!r} is not a number of seconds: set it to a number > 0 (e.g. 60), to "
            f"'auto', or to 0 or 'off' to turn the hang doctor off."
        )
    return check_timeout(value, name=ENV_TIMEOUT)


def check_timeout(value: object, *, name: str = "hang_timeout_s") -> float | str | None:
    """``value`` as the doctor uses it: seconds, ``"auto"``, or ``None`` (off; also for 0)."""
    if value is None:
        return None
    if isinstance(value, str):
        if value == "auto":
            return "auto"
        raise ValueError(f"{name} must be a number of seconds, 'auto' or None, got {value!r}.")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, 'auto' or None, got {type(value).__name__}.")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number of seconds >= 0 (0 turns it off), got {value}.")
    if 0 < value < MIN_TIMEOUT_S:
        raise ValueError(
            f"{name} must be at least {MIN_TIMEOUT_S:g} s (or 0 to turn the watchdog off), got {value}: "
            f"a healthy collective can wait that long for a rank that is a moment late, and every rank "
            f"would be ended for it. Use a few seconds for tests, minutes for training."
        )
    return float(value) or None


def timeout_for_init(value: object) -> float | str | None:
    """``init(hang_timeout_s=...)``: ``None`` leaves it to ``DISTKIT_HANG_TIMEOUT_S`` (off when unset)."""
    if value is None:
        env = _from_environment()
        return None if isinstance(env, _Unset) else env
    return check_timeout(value)


def timeout_for_trainer(value: object) -> float | str | None:
    """``Trainer(hang_timeout_s=...)``: ``"auto"`` is ``DISTKIT_HANG_TIMEOUT_S`` when set, else auto."""
    if value == "auto":
        env = _from_environment()
        return "auto" if isinstance(env, _Unset) else env
    return check_timeout(value)


def is_transport_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective failing because a peer is gone (or a collective timed out)."""
    if not isinstance(exc, RuntimeError) or isinstance(exc, DistkitError):
        return False
    text = str(exc)
    return any(marker in text for marker in _TRANSPORT_MARKERS)


# How long a second connection to the job's store may take. One to a live store opens within
# milliseconds; torch retries one to a store whose host has died for the store's whole timeout
# (ten minutes by default: measured, torch 2.13), which would hold init() or a failure's report.
_CLONE_S = 10.0
# How long past _CLONE_S the caller that can ask the store whether it still answers (over the
# connection it has) waits while it does. torch's client looks up the host name of its own
# socket's address as it connects (a reverse DNS query for [::ffff:127.0.0.1], which /etc/hosts
# does not answer), and a name server that drops the query holds it 5 s an attempt (glibc's
# default, twice): 3 % of the connections on one machine took 5.02 s, so two in a row ended a
# join past 10 s with "the store stopped answering" while it answered (2026-11-27).
_CLONE_LIVE_S = 60.0


def _clone(store: Any, answers: Callable[[], bool] | None = None) -> Any:
    """``store.clone()`` within ``_CLONE_S``, or while ``answers`` says the store answers, up to
    ``_CLONE_LIVE_S`` more (:func:`distkit._utils.daemon.clone`)."""
    return daemon.clone(store, _CLONE_S, answers, _CLONE_LIVE_S)


def _answers(store: Any, key: str) -> bool:
    """Whether ``store`` answers a question over its connection (one whose host died fails at once)."""
    try:
        store.check([key])
    except RuntimeError:  # torch's DistNetworkError (the connection closed), or a store's own error
        return False
    return True


def _waited(exc: BaseException) -> bool:
    """Whether ``exc`` only says that this rank waited for another: a collective that failed
    because a peer ended (or timed out), the job's store gone with the rank that hosted it,
    distkit's error explaining one of those, the main process's exception inside a section this
    rank waited on (:class:`MainProcessError`: the main process raised it first), or an error
    distkit marked with the rank it waited for (``waited_for``: a main process that died inside
    its section)."""
    if isinstance(exc, MainProcessError) or getattr(exc, "waited_for", None) is not None:
        return True
    cause = exc.__cause__ if isinstance(exc, DistkitError) else exc
    return cause is not None and (is_transport_failure(cause) or isinstance(cause, dist.DistNetworkError))


def _where_to_move(local: Mapping[str, Any], missing: Mapping[int, Mapping[str, Any]]) -> str:
    """The hint of a mismatch verdict: the `if` to move the collective out of. This rank's own
    `if`, unless only a missing rank's `if` tests the rank (this rank waits in a branch every rank
    takes, e.g. `if step % 2 == 1:`, while the other called a collective under
    `if is_main_process():`)."""
    context = local.get("context") or ""
    if context.startswith("in `") and _hang_where.RANK_TEST.search(context):
        return f" (here: move it out of {context.split('in ', 1)[-1]})"
    for rank in sorted(missing):
        answer = missing[rank]
        theirs = answer.get("context") or ""
        if theirs.startswith("in `") and _hang_where.RANK_TEST.search(theirs):
            call = f"{answer.get('op') or 'collective'} at {answer.get('file')}:{answer.get('line')}"
            return f" (rank {rank}'s {call} is {theirs}: move it out of that `if`)"
    return f" (here: move it out of {context.split('in ', 1)[-1]})" if context.startswith("in `") else ""


def _other_src(rank: int, local: Mapping[str, Any], missing: Mapping[int, Mapping[str, Any]]) -> str | None:
    """Why the ranks can never meet when each waits in the same ``broadcast_object`` or
    ``scatter_object``, some with another ``src`` (every rank that names itself sends and none
    receives), or ``None`` when that is not the case. A rank may have got past the first of the
    call's two collectives (it received from its src): it waits in the same call all the same."""
    helper = local.get("helper")
    if local.get("helper_src") is None or not missing:
        return None
    if any(answer.get("helper") != helper or answer.get("helper_src") is None for answer in missing.values()):
        return None
    srcs = {rank: local["helper_src"], **{r: answer["helper_src"] for r, answer in missing.items()}}
    if len(set(srcs.values())) == 1:
        return None
    passed = ", ".join(f"rank {r} src={srcs[r]}" for r in sorted(srcs))
    return (
        f"{helper} needs the same src on every rank, but they differ: {passed}. Decide the sending "
        f"rank once (a constant, such as src=0) and pass it on every rank."
    )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    line = text[0] if text else ""
    if line.startswith("[") and "] " in line:  # gloo prefixes its source file: "[.../pair.cc:537] Read error"
        line = line.split("] ", 1)[1]
    line = line.split(" This is typically caused", 1)[0]  # gloo's advice, the same every time
    if len(line) > 100:
        line = line[:97] + "..."
    return f"{type(exc).__name__}: {line}" if line else type(exc).__name__


def current_frames() -> _hang_where.Frames:
    """The calling thread's frames, innermost first."""
    return _hang_where.thread_frames(threading.get_ident())


def _flight_recorder_hint() -> str | None:
    """Where torch's Flight Recorder puts its NCCL dumps, when a NCCL job has it on."""
    size = os.environ.get("TORCH_FR_BUFFER_SIZE") or os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE") or ""
    try:
        nccl = "nccl" in str(dist.get_backend()).lower()
    except Exception:  # no default group any more
        nccl = False
    if not nccl or size.strip() in ("", "0"):
        return None
    prefix = (
        os.environ.get("TORCH_FR_DUMP_TEMP_FILE")
        or os.environ.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
        or "/tmp/nccl_trace_rank_"
    )
    return (
        f"torch's Flight Recorder is on ({size.strip()} entries): with TORCH_NCCL_DUMP_ON_TIMEOUT=1, NCCL "
        f"writes each rank's last collectives to {prefix}<rank> when its own watchdog times out; "
        f"`torchfrtrace <their directory>` names the collective the ranks disagree on."
    )


def _key(*parts: object) -> str:
    return "hang/" + "/".join(str(part) for part in parts)


def _print(text: str) -> None:
    with contextlib.suppress(Exception):
        sys.stderr.write(text.rstrip("\n") + "\n")
        sys.stderr.flush()


def _exit(code: int = HANG_EXIT_CODE) -> NoReturn:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            if stream is not None:
                stream.flush()
    os._exit(code)


def exception_note(exc: BaseException) -> str:
    """``ValueError: bad batch 7`` (the first line of the message, at most 200 characters)."""
    lines = str(exc).strip().splitlines()
    text = lines[0] if lines else ""
    if text.startswith("[rank ") and "] " in text:  # distkit's own errors name the rank: said already
        text = text.split("] ", 1)[1]
    text = redact_text(text)  # a URL's password or token in a library's error (MLflow's)
    if len(text) > 200:
        text = text[:197] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def write_elastic_error(message: str, callstack: str, timestamp: int) -> None:
    """Leave ``message`` in the error file of torch's elastic agent (torchrun, the Trainer's
    self-launch), when it gave this process one and nothing wrote it yet.

    The agent's report names as root cause the failure with the smallest timestamp, read from
    this file (else the time it noticed the exit): the rank that raised writes the time it raised,
    the ranks that only waited for it a later one. The format is torch's ``ErrorHandler``'s.
    """
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.exists(path):
        return
    # torchrun's summary shows py_callstack, else the message: an empty one would show nothing.
    extra = {"py_callstack": callstack} if callstack else {}
    data = {"message": {"message": message, "extraInfo": {**extra, "timestamp": str(timestamp)}}}
    with contextlib.suppress(OSError):
        temporary = f"{path}.{os.getpid()}.tmp"
        with open(temporary, "w", encoding="utf-8") as handle:
            json.dump(data, handle)
        os.replace(temporary, path)


def _process_state(pid: int) -> str | None:
    """How process ``pid`` of this host ended, or ``None`` while it runs (or is stopped)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return f"its process (pid {pid}) has exited"
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return f"its process (pid {pid}) has exited"
        except OSError:
            pass
        return None
    if fields and fields[0] in ("Z", "X"):
        # A zombie not yet reaped by its launcher: field 52 of stat is its wait status.
        try:
            status = int(fields[49])
        except (IndexError, ValueError):
            return f"its process (pid {pid}) has exited"
        if status & 0x7F:
            try:
                name = signal.Signals(status & 0x7F).name
            except ValueError:
                name = f"signal {status & 0x7F}"
            return f"its process (pid {pid}) was killed by {name}"
        return f"its process (pid {pid}) exited with code {(status >> 8) & 0xFF}"
    return None


@dataclass
class _SlowOp:
    """This rank's view of one distkit collective that is still pending."""

    checker: bool | None = None  # this rank asks the others (one rank per collective does)
    confirm: tuple[Any, ...] | None = None  # what the last query saw, to be seen again
    next_wait: float = FIRST_CHECK_S


class _SlowWatch:
    """Runs checks for a wait that blocks its thread in C (the barrier's store wait).

    One thread per process, made on first use: the waiting thread arms it before it blocks and
    disarms it after, at the cost of two notifications.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._token: object | None = None
        self._job: Callable[[], float | None] | None = None
        self._thread = threading.Thread(target=self._run, name="distkit-hang-slow-wait", daemon=True)
        self._thread.start()

    def arm(self, job: Callable[[], float | None]) -> object:
        token = object()
        with self._cond:
            self._token, self._job = token, job
            self._cond.notify()
        return token

    def disarm(self, token: object) -> None:
        with self._cond:
            if self._token is token:
                self._token, self._job = None, None
                self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._token is None:
                    self._cond.wait()
                token, job = self._token, self._job
            delay: float | None = FIRST_CHECK_S
            while delay is not None:
                with self._cond:
                    end = time.monotonic() + delay
                    while self._token is token and (left := end - time.monotonic()) > 0:
                        self._cond.wait(left)
                    if self._token is not token:
                        break
                assert job is not None
                try:
                    delay = job()
                except Exception:  # a check must never break the wait it watches
                    delay = _MAX_CHECK_S
            with self._cond:
                while self._token is token:
                    self._cond.wait()


class Doctor:
    """One rank's hang doctor (see the module docs). Made by ``distkit.init``; one per process."""

    def __init__(
        self,
        *,
        store: Any,
        rank: int,
        world_size: int,
        counters: Mapping[str, int],
        helper_group: Any,
        helper_group_name: str | None,
        hosts_store: bool = False,
    ) -> None:
        # Who this is, and the store it talks through (distkit's prefixed view of the job's store).
        self.store = store
        self.rank, self.world_size = rank, world_size
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.label = f"[rank {rank}/{world_size}]"
        # What the answers report beside the stack: distkit's store-collective counters, and the
        # group distkit's collectives run on (its sequence number tells who arrived).
        self.counters = counters
        self.helper_group = helper_group
        self.helper_group_name = helper_group_name
        # Whether this process hosts the store (rank 0 without a launcher's agent): when the job
        # ends after a report, it exits last, so that the others' last words still reach the store.
        self.hosts_store = hosts_store
        # The policy: watchdog timeout (None: off; seconds; "auto"), where the report goes, the
        # thread watched, and the Trainer in charge (its global_step), set by configure().
        self.timeout: float | str | None = None
        self.run_dir: str | None = None
        self.watched: int | None = threading.get_ident()
        self._trainer: weakref.ref[Any] | None = None
        # What distkit's own processes run (a bench worker's configuration), for their reports.
        self.workload: str | None = None
        # What this rank answers while its watched thread unwinds a failure (set before a roll call).
        self._local_answer: dict[str, Any] | None = None
        # This rank's own exception, once it is ending with one (see record_failure), and whether
        # this rank is writing down where its failure is (_writing_down).
        self._raised: dict[str, Any] | None = None
        self._recording = False
        self._recorded = threading.Event()
        # Threads and their connections.
        self.available = False
        self._responder: threading.Thread | None = None
        self._responder_store: Any = None
        self._first_ask = 1
        self._side: Any = None
        self._side_lock = threading.Lock()
        self._watchdog: threading.Thread | None = None
        self._watch_stop = threading.Event()
        self._slow_watch: _SlowWatch | None = None
        self._stopping = False
        # Set by the first thread of this rank that ends it (reporting, or following a report);
        # another thread that gets there (the watched thread, whose collective breaks as the other
        # ranks exit) then waits quietly for the process to end.
        self._ending = False
        self._lock = threading.Lock()
        self._slow: dict[str, _SlowOp] = {}
        self._ddp_seen = False
        # One bound method, so that `sys.excepthook is self._hook` can tell whether ours is installed.
        self._hook = self._excepthook
        self._previous_hook: Any = None

    # -- life cycle -------------------------------------------------------------------------------

    def start(self) -> None:
        """Register this process and start the responder. Local (a few store operations)."""
        mine = _key("proc", self.rank)
        self.store.set(mine, json.dumps({"host": self.host, "pid": self.pid}))
        try:
            # No other thread uses this connection yet: it may ask whether the store still answers.
            self._responder_store = _clone(self.store, lambda: _answers(self.store, mine))
        except (AttributeError, RuntimeError, NotImplementedError):
            return  # a store without a second connection: distkit's waits stay plain waits
        except TimeoutError as err:
            raise DistkitError(
                f"{self.label} the job's key-value store stopped answering while this rank joined "
                f"({err}): the process that hosts it (rank 0, or the launcher) most likely ended. "
                f"Look for its error above."
            ) from err
        self._first_ask = int(self.store.add(_key("asks"), 0)) + 1
        self._responder = threading.Thread(target=self._respond, name="distkit-hang-responder", daemon=True)
        self._responder.start()
        self.available = True
        # An uncaught exception ends the job alike with or without the watchdog: the rank that
        # raised says so first (record_failure), the ranks whose collective then fails report it.
        if sys.excepthook is not self._hook:
            self._previous_hook, sys.excepthook = sys.excepthook, self._hook

    def stop(self) -> None:
        """Leave: say so in the store (a barrier then names this rank at once), stop the threads."""
        if self._stopping:
            return
        # Called from shutdown(), also in a `finally:` while an exception ends the script: that is
        # how this rank ends, not "left". (An uncaught one reached the excepthook already.)
        exc = sys.exc_info()[1]
        if exc is not None:
            self.record_failure(exc)
        self._apply(None, None, None, self.watched)
        if sys.excepthook is self._hook:
            sys.excepthook = self._previous_hook or sys.__excepthook__
        self._stopping = True
        with contextlib.suppress(Exception):
            self.store.set(_key("left", self.rank), json.dumps({"time": time.time()}))
        if self._responder is not None:
            with contextlib.suppress(Exception):
                self.store.set(_key("wake", self.rank), "stop")
            self._responder.join(_THREAD_STOP_S)

    def linger(self) -> None:
        """At the exit of a rank that raised and hosts the job's store: report, then end the others.

        The other ranks' collectives fail only when this process has ended (closing its groups
        does not break them: measured on torch 2.13), and then the store they would ask through
        is gone with it. So this rank, which knows it is the cause, asks where the others are,
        prints the report and ends them (they exit with :data:`PEER_FAILED_EXIT_CODE`, after this
        process), before it exits with its own code.
        """
        if not (self.hosts_store and self._raised is not None and self.world_size > 1):
            return
        with contextlib.suppress(Exception):
            store = self._side_store()
            if int(store.add(_key("report"), 1)) != 1:
                # Another rank reports: stay until it is done, since it talks through this store.
                store.wait([_key("bye")], timedelta(seconds=_FOLLOW_S))
                return
            answered, _, _, _ = self._report(store, "", self._raised)
            self._release(store, answered)

    def configure(
        self,
        timeout: float | str | None,
        *,
        run_dir: str | os.PathLike[str] | None = None,
        trainer: Any = None,
        watched: int | None = None,
    ) -> Callable[[], None]:
        """Set the watchdog's timeout, the report's directory, the Trainer and the watched thread.

        Returns a function that puts back the previous settings (the Trainer's ``fit`` uses it).
        """
        previous = (self.timeout, self.run_dir, self._trainer, self.watched)
        self._apply(
            timeout,
            None if run_dir is None else os.fspath(run_dir),
            None if trainer is None else weakref.ref(trainer),
            self.watched if watched is None else watched,
        )
        return lambda: self._apply(*previous)

    def _apply(
        self,
        timeout: float | str | None,
        run_dir: str | None,
        trainer: weakref.ref[Any] | None,
        watched: int | None,
    ) -> None:
        with self._lock:
            self.run_dir, self._trainer, self.watched = run_dir, trainer, watched
            if timeout == self.timeout and (self._watchdog is not None) == (timeout is not None):
                return
            self.timeout = timeout
            if self._watchdog is not None:
                self._watch_stop.set()
                self._watchdog.join(_THREAD_STOP_S)
                self._watchdog = None
            if timeout is not None and self.available and not self._stopping:
                # The watchdog's connection to the store, made here and not on its thread, so that
                # a rank ending early does not exit while the watchdog is still connecting
                # (distkit._utils.daemon). The thread that configures waits in no store operation,
                # so it may ask over the rank's own connection whether the store still answers
                # while a slow connection opens (start).
                mine = _key("proc", self.rank)
                try:
                    side = self._side_store(lambda: _answers(self.store, mine))
                except Exception as err:
                    _print(
                        f"{self.label} distkit: the hang doctor could not open its connection to the "
                        f"job's store ({_first_line(err)}), so this rank runs without hang detection "
                        f"(hang_timeout_s={timeout!r}). A store that stopped answering usually means "
                        f"that the process hosting it (rank 0, or the launcher) ended: look for its "
                        f"error."
                    )
                    return
                self._watch_stop = threading.Event()
                self._watchdog = threading.Thread(
                    target=self._watch,
                    args=(self._watch_stop, side),
                    name="distkit-hang-watchdog",
                    daemon=True,
                )
                self._watchdog.start()

    def _side_store(self, answers: Callable[[], bool] | None = None) -> Any:
        """A connection for the background threads' short operations (made once). ``answers``: see
        :func:`_clone`; only a thread that waits in no operation on ``self.store`` may ask it."""
        with self._side_lock:
            if self._side is None:
                self._side = _clone(self.store, answers)
            return self._side

    # -- where this rank is -----------------------------------------------------------------------

    def _has_ddp(self, frames: _hang_where.Frames) -> bool:
        if not self._ddp_seen:
            self._ddp_seen = _hang_where.ddp_in_frames(frames) or _hang_where.ddp_anywhere()
        return self._ddp_seen

    def _helper_seq(self) -> int | None:
        try:
            return int(self.helper_group._get_sequence_number_for_group())
        except Exception:
            return None

    def where(
        self, frames: _hang_where.Frames | None = None, *, kind: str | None = None, note: str | None = None
    ) -> dict[str, Any]:
        """This rank's answer: where ``frames`` (default: the watched thread's) are, and its counts."""
        if frames is None:
            frames = _hang_where.thread_frames(self.watched)
        answer = _hang_where.locate(frames, has_ddp=lambda: self._has_ddp(frames)).to_dict()
        trainer = self._trainer() if self._trainer is not None else None
        step = f"global_step {trainer.global_step}" if trainer is not None else _hang_where.step_of(frames)
        answer.update(
            rank=self.rank,
            host=self.host,
            pid=self.pid,
            step=step,
            seqs=_hang_where.group_seqs(),
            helper_seq=self._helper_seq(),
            barrier=int(self.counters.get("barrier", 0)),
        )
        if kind is not None:
            answer["kind"] = kind
        if note is not None:
            answer["note"] = note
        return answer

    def absent(self, store: Any, rank: int) -> dict[str, Any]:
        """What can be said about a rank that did not answer: left, gone (with how), or silent."""
        answer: dict[str, Any] = {"rank": rank, "op": "", "note": ""}
        proc: dict[str, Any] = {}
        try:
            if store.check([_key("raised", rank)]):
                return json.loads(store.get(_key("raised", rank)))  # type: ignore[no-any-return]
            if store.check([_key("left", rank)]):
                return {**answer, "kind": "left"}
            if store.check([_key("proc", rank)]):
                proc = json.loads(store.get(_key("proc", rank)))
        except Exception:
            pass
        host, pid = proc.get("host"), proc.get("pid")
        answer.update(host=host, pid=pid)
        if host == self.host and isinstance(pid, int):
            ended = _process_state(pid)
            if ended is not None:
                return {**answer, "kind": "gone", "note": ended}
            return {
                **answer,
                "kind": "silent",
                "note": f"alive (pid {pid}) but not answering: in C code that holds the GIL, or stopped",
            }
        who = f"pid {pid} on {host}" if pid is not None else "it never registered with the store"
        return {**answer, "kind": "silent", "note": f"{who}: dead, or in C code that holds the GIL"}

    # -- asking the others ------------------------------------------------------------------------

    def ask(self, store: Any, kind: str, *, wait_s: float) -> dict[int, dict[str, Any]]:
        """Ask every other rank where it is; their answers, waited for at most ``wait_s``.

        Stops early once every rank that has not answered is known to have ended.
        """
        number = int(store.add(_key("asks"), 1))
        store.set(_key("ask", number), json.dumps({"kind": kind, "from": self.rank}))
        others = [rank for rank in range(self.world_size) if rank != self.rank]
        if not others:
            return {}
        store.multi_set([_key("wake", rank) for rank in others], ["1"] * len(others))
        keys = {rank: _key("answer", number, rank) for rank in others}
        answers: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + wait_s
        pause, next_scan = 0.002, time.monotonic() + 0.5
        while True:
            everyone = int(store.add(_key("answered", number), 0)) >= len(others)
            now = time.monotonic()
            if everyone or now >= deadline or now >= next_scan:
                pending = [rank for rank in others if rank not in answers]
                if everyone:
                    values = store.multi_get([keys[rank] for rank in pending])
                    answers.update(
                        {rank: json.loads(value) for rank, value in zip(pending, values, strict=True)}
                    )
                else:
                    for rank in pending:
                        if store.check([keys[rank]]):
                            answers[rank] = json.loads(store.get(keys[rank]))
                pending = [rank for rank in others if rank not in answers]
                if not pending or now >= deadline:
                    return answers
                if all(self.absent(store, rank)["kind"] in ("raised", "gone", "left") for rank in pending):
                    return answers
                next_scan = now + 0.5
            time.sleep(pause)
            pause = min(pause * 2, 0.1)

    def _respond(self) -> None:
        store = self._responder_store
        wake = _key("wake", self.rank)
        next_ask = self._first_ask
        while True:
            try:
                store.wait([wake], _FOREVER)
                if self._stopping:
                    return
                store.delete_key(wake)
                last = int(store.add(_key("asks"), 0))
            except Exception:
                return  # the store is gone: the job is ending, nobody can ask any more
            while next_ask <= last:
                number, next_ask = next_ask, next_ask + 1
                try:
                    request = json.loads(store.get(_key("ask", number)))
                    if request.get("from") == self.rank:
                        continue
                    if self._local_answer is None and self._recording:
                        # This rank is writing down its own failure: answer with it, not with where
                        # its main thread is meanwhile (busy in distkit's own code, as if stuck).
                        self._recorded.wait(_RECORDING_WAIT_S)
                    answer = self._local_answer or self.where()
                    store.set(_key("answer", number, self.rank), json.dumps(answer))
                    store.add(_key("answered", number), 1)
                except Exception:
                    continue
                if request.get("kind") == "hang" and self._raised is None:
                    # A rank that raised ends with its own exception and exit code, not the report's.
                    self._follow(store, request.get("from"))

    # -- one report, then every rank exits --------------------------------------------------------

    def _end_here(self) -> None:
        """Let one thread of this rank end it; any other waits here until that one has."""
        with self._lock:
            first, self._ending = not self._ending, True
        if not first:
            time.sleep(_FOLLOW_S + _ROLL_CALL_ANSWER_S + _EXITS_S)
            _exit()

    def roll_call(self, store: Any, *, header: str, local: dict[str, Any]) -> NoReturn:
        """Report where every rank is (once per job: the first rank to get here) and exit."""
        self._local_answer = local
        self._end_here()
        try:
            if int(store.add(_key("report"), 1)) != 1:
                self._follow(store, None, claimed=True)  # another rank reports
            answered, code, cause, raised = self._report(store, header, local)
        except Exception as err:
            # A collective that failed because a peer ended, and no store to ask through: what
            # hosted it (rank 0, or under torchrun the agent of a node) has ended, so it failed first.
            code = PEER_FAILED_EXIT_CODE if local.get("kind") == "failed" else HANG_EXIT_CODE
            place = _hang_report.location_text(local)
            host = (
                "the torchrun agent that hosted the job's store has ended (a worker on its node failed "
                "or was killed first: that node's output says why)"
                if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
                else "the rank that hosted the job's store, rank 0, has ended: it failed first, and its "
                "own output says why"
            )
            gone = f" ({host})" if code == PEER_FAILED_EXIT_CODE else ""
            _print(
                f"{self.label} distkit: the hang doctor could not ask the other ranks where they are "
                f"({_first_line(err)}){gone}. This rank {_hang_report.doing_text(local)}"
                f"{' at ' + place if place else ''}. Exiting with code {code}."
            )
            self._exit_after(code, None, [])
        self._release(store, answered)
        self._exit_after(code, cause, raised)

    def _report(
        self, store: Any, header: str, local: dict[str, Any]
    ) -> tuple[int, int, str | None, list[list[Any]]]:
        """Ask every rank where it is, print the report, write it to a file, and tell the others.

        Returns how many ranks will follow it, the exit code of the ranks that waited, the cause
        (a rank that raised or died) and the ``[host, pid]`` of the ranks that raised.
        """
        answers = self.ask(store, "hang", wait_s=_ROLL_CALL_ANSWER_S)
        # The ranks that will follow the report (a rank that raised ends on its own).
        answered = sum(1 for answer in answers.values() if answer.get("kind") != "raised")
        answers[self.rank] = local
        for rank in range(self.world_size):
            if rank not in answers:
                answers[rank] = self.absent(store, rank)
        names = {name for answer in answers.values() for name in (answer.get("seqs") or {})}
        labels = {name: _hang_where.group_label(name, helper_group=self.helper_group_name) for name in names}
        hints = [hint] if (hint := _flight_recorder_hint()) else []
        cause = _hang_report.cause(answers)
        code = HANG_EXIT_CODE
        if cause is not None:
            # A rank raised or died: that is the news, whatever this rank was waiting for.
            header, code = cause, PEER_FAILED_EXIT_CODE
        text, details = _hang_report.build(header, answers, group_labels=labels, hints=hints)
        directory = self.run_dir or os.environ.get(ENV_RUN_DIR) or os.getcwd()
        path, error = _hang_report.write(directory, text + "\n" + details)
        where = (
            f"every rank's stack is in {path}" if path else f"the report file failed in {directory}: {error}"
        )
        ends = (
            f"the ranks that waited exit with code {code}"
            if code == PEER_FAILED_EXIT_CODE
            else f"every rank exits with code {code}"
        )
        _print(f"{text}\n  ({where}; {ends})")
        raised = [[a.get("host"), a.get("pid")] for a in answers.values() if a.get("kind") == "raised"]
        done = {"path": path, "from": self.rank, "code": code, "cause": cause, "raised": raised}
        store.set(_key("done"), json.dumps(done))
        return answered, code, cause, raised

    def _release(self, store: Any, answered: int) -> None:
        """Wait (briefly) for the ``answered`` ranks that follow the report to say they exit, so that
        a launcher which kills the rest of a job when one process ends sees every rank end with
        its own code; then release the rank that hosts the store, which waits for this."""
        with contextlib.suppress(Exception):
            end = time.monotonic() + _EXITS_S
            while time.monotonic() < end and int(store.add(_key("exited"), 0)) < answered:
                time.sleep(0.05)
            store.set(_key("bye"), "1")
            time.sleep(0.2)  # the others said so just before their own os._exit

    def _exit_after(self, code: int, cause: str | None, raised: list[list[Any]]) -> NoReturn:
        """Exit with ``code`` once the ranks that raised (``[host, pid]`` pairs) have ended.

        Launchers name the first process to end as the root cause (mp.spawn, and torchrun when no
        error file says otherwise): the rank that raised ends first, within a bounded wait. A rank
        that only waited also leaves that in torchelastic's error file.
        """
        pids = [pid for host, pid in raised if host == self.host and isinstance(pid, int)]
        end = time.monotonic() + _CAUSE_EXIT_S
        while pids and time.monotonic() < end:
            pids = [pid for pid in pids if _process_state(pid) is None]
            time.sleep(0.02)
        if code == PEER_FAILED_EXIT_CODE:
            # One second later than now: the rank that raised wrote the time it raised (or the
            # agent takes the time it saw a dead rank end), so the agent names that one first.
            write_elastic_error(
                f"{self.label} only waited for the rank that failed. {cause or ''}".strip(),
                "",
                int(time.time()) + 1,
            )
        _exit(code)

    def _follow(self, store: Any, reporter: int | None, *, claimed: bool = False) -> NoReturn:
        """Wait for the reporting rank's report (bounded), say where it is, and exit."""
        if not claimed:
            self._end_here()
        code, cause, raised = HANG_EXIT_CODE, None, []
        try:
            store.wait([_key("done")], timedelta(seconds=_FOLLOW_S))
            done = json.loads(store.get(_key("done")))
            code, cause, raised = (
                int(done.get("code", HANG_EXIT_CODE)),
                done.get("cause"),
                done.get("raised", []),
            )
            path = f"; also in {done['path']}" if done.get("path") else ""
            _print(
                f"{self.label} distkit: rank {done.get('from')} printed where every rank is (the hang "
                f"doctor's report{path}). Exiting with code {code}."
            )
        except Exception:
            who = f"rank {reporter}" if reporter is not None else "the reporting rank"
            _print(
                f"{self.label} distkit: {who} did not finish the hang doctor's report within "
                f"{_FOLLOW_S:g} s. Exiting with code {HANG_EXIT_CODE}."
            )
        with contextlib.suppress(Exception):
            store.add(_key("exited"), 1)
            if self.hosts_store:
                # The last to go: the reporter still talks to the store this process hosts.
                store.wait([_key("bye")], timedelta(seconds=_EXITS_S + 2))
        self._exit_after(code, cause, raised)

    # -- the watchdog -----------------------------------------------------------------------------

    def _limit(self, slowest_step_s: float) -> tuple[float, str]:
        if self.timeout == "auto":
            limit = max(AUTO_FLOOR_S, AUTO_MULTIPLE * slowest_step_s)
            return limit, f"auto: {limit:.0f} s"
        assert isinstance(self.timeout, float)
        return self.timeout, f"{self.timeout:g}"

    def sample(self) -> tuple[str, tuple[Any, ...] | None]:
        """One look at the watched thread: what it does, and a fingerprint of where it is and of
        the collectives this rank issued (the same fingerprint twice: no progress in between).

        The watchdog's whole cost per wake-up (``benchmarks/bench_hang_doctor.py`` times it).
        """
        frames = _hang_where.thread_frames(self.watched)
        kind = _hang_where.quick_kind(frames)
        if kind not in (WAIT, "backward"):
            return kind, None
        state = (
            tuple((id(code), line) for code, line, _ in frames),
            tuple(sorted(_hang_where.group_seqs().items())),
            tuple(sorted(self.counters.items())),
        )
        return kind, state  # the frames are dropped: nothing keeps the thread's locals alive

    def _watch(self, stop: threading.Event, side: Any) -> None:
        fixed = self.timeout if isinstance(self.timeout, float) else None
        # A few samples per timeout, at most one every 2 s: the watchdog's whole cost is reading
        # one stack and a few counters that often.
        period = min(2.0, max(0.1, fixed / 10)) if fixed is not None else 2.0
        last: tuple[Any, ...] | None = None
        since = last_wake = time.monotonic()
        step_seen: int | None = None
        step_since, slowest = since, 0.0
        while not stop.wait(period):
            now = time.monotonic()
            if now - last_wake > period + _GAP_S:
                since, step_since, last = now, now, None  # this process was suspended
            last_wake = now
            trainer = self._trainer() if self._trainer is not None else None
            if trainer is not None:
                step = trainer.global_step
                if step != step_seen:
                    if step_seen is not None:
                        slowest = max(slowest, now - step_since)
                    step_seen, step_since = step, now
            kind, state = self.sample()
            if kind not in (WAIT, "backward"):
                last, since = None, now
                continue
            if state != last:
                last, since = state, now
                continue
            limit, shown = self._limit(slowest)
            if now - since < limit:
                continue
            frames = _hang_where.thread_frames(self.watched)
            if kind == "backward" and not self._has_ddp(frames):
                since = now  # a long backward pass without DDP computes, it does not wait
                continue
            local = self.where(frames)
            del frames
            header = (
                f"distkit: job stuck for {now - since:.0f} s (hang_timeout_s={shown}). Where each rank is:"
            )
            self.roll_call(side, header=header, local=local)

    # -- failures ---------------------------------------------------------------------------------

    def record_failure(self, exc: BaseException) -> None:
        """This rank is ending with ``exc``: say so where the other ranks look, before anything else.

        Local (one store write). The other ranks' collectives fail as this process ends; their
        reports then name this rank and ``exc`` as the cause (not "left the job"), and they exit
        with :data:`PEER_FAILED_EXIT_CODE` after this process has ended. Under torch's elastic
        agent (torchrun, the Trainer's self-launch) the traceback also goes to the agent's error
        file, so that its report's root cause is this rank. A collective that failed because
        another rank ended is not a cause (this rank only waited), nor is ``sys.exit``.
        """
        if self._raised is not None or isinstance(exc, SystemExit) or _waited(exc):
            return
        with self._writing_down():
            frames = _hang_where.traceback_frames(exc.__traceback__)
            answer = self.where(frames, kind="raised", note=exception_note(exc))
            del frames
            answer["time"] = time.time()
            self._raised = self._local_answer = answer
        with contextlib.suppress(Exception):
            # The connection in hand (this thread's): a new one to a store whose host has died
            # would retry for the store's whole timeout.
            self.store.set(_key("raised", self.rank), json.dumps(answer))
        callstack = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        write_elastic_error(f"{self.label} {exception_note(exc)}", callstack, int(answer["time"]))

    @contextlib.contextmanager
    def _writing_down(self) -> Iterator[None]:
        """While this rank works out where its own failure is (the location takes a source parse,
        tens of ms on a busy machine), a rank asking where it is gets that answer, once set as
        ``_local_answer``, not the main thread's frames meanwhile (busy in distkit's own code)."""
        self._recorded.clear()
        self._recording = True
        try:
            yield
        finally:
            self._recording = False
            self._recorded.set()

    def carry_on(self) -> None:
        """This rank goes on after an exception it recorded as ending it (the caller caught what
        ``fit`` raised): take the record back, so that the other ranks wait for this rank again
        instead of naming it the cause of their failure. Local (one store delete, only then).

        Called where a rank shows it went on: a distkit collective or barrier, the next ``fit``,
        the next task of a ``distkit.testing`` rank.
        """
        if self._raised is None or self._ending:
            return
        self._raised = None
        self._local_answer = None
        with contextlib.suppress(Exception):
            self.store.delete_key(_key("raised", self.rank))

    def _excepthook(
        self, exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None
    ) -> None:
        if self._ending:
            self._end_here()  # the other ranks' exits broke this thread's collective: stay quiet
        watched = threading.get_ident() == self.watched
        local = None
        if watched:
            with self._writing_down():
                local = self._failure_answer(exc, None)
                if local is not None:
                    self._local_answer = local
        if watched and local is None:
            self.record_failure(exc)
        previous = self._previous_hook or sys.__excepthook__
        previous(exc_type, exc, tb)  # the traceback first, as Python prints it
        if local is not None:
            self.on_failure(exc, local=local, always=True)

    def _failure_answer(self, exc: BaseException, frames: _hang_where.Frames | None) -> dict[str, Any] | None:
        """This rank's answer after ``exc``, or ``None`` when ``exc`` is not a collective that
        failed because another rank ended (or timed out).

        Set as what the responder answers from now on: the watched thread is about to leave the
        place where the collective failed (to print a traceback), and a roll call may come first.
        """
        if not self.available or not _waited(exc):
            return None
        if frames is None:
            frames = _hang_where.traceback_frames(exc.__traceback__)
        failure = exc.__cause__ if isinstance(exc, DistkitError) and exc.__cause__ is not None else exc
        local = self.where(frames, kind="failed", note=_first_line(failure))
        self._local_answer = local
        return local

    def on_failure(
        self,
        exc: BaseException,
        *,
        frames: _hang_where.Frames | None = None,
        local: dict[str, Any] | None = None,
        always: bool = False,
    ) -> None:
        """A collective raised. When the error says a peer is gone (or a collective timed out), and
        the watchdog is on or ``always`` (the error ends the job: it reached the top of the thread,
        or ends ``Trainer.fit``), report where every rank is, naming the rank that failed first,
        and exit; else return (the caller raises, naming the ranks that ended).

        ``frames`` is where it happened (default: the exception's traceback, complete when it
        reached the top of the thread).
        """
        if self._ending:
            self._end_here()  # the other ranks' exits broke this thread's collective: stay quiet
        if self.timeout is None and not always:
            return
        if local is None:
            with self._writing_down():
                local = self._failure_answer(exc, frames)
                if local is not None:
                    self._local_answer = local
        if local is None:
            return
        header = f"distkit: a collective failed on rank {self.rank}. Where each rank is:"
        try:
            store = self._side_store()
        except Exception:
            store = self.store
        self.roll_call(store, header=header, local=local)

    def explain_failure(self, exc: BaseException, what: str) -> DistkitError | None:
        """A distkit collective failed: an error naming the ranks that ended, if any did."""
        if not self.available or not is_transport_failure(exc):
            return None
        ended = {}
        for rank in range(self.world_size):
            if rank != self.rank:
                answer = self.absent(self.store, rank)
                if answer["kind"] in ("raised", "gone", "left"):
                    ended[rank] = answer
        if not ended:
            return None
        parts = [f"rank {rank} {_hang_report.doing_text(a)}" for rank, a in sorted(ended.items())]
        return DistkitError(
            f"{self.label} {what} failed because {_hang_report.ranks_text(sorted(ended))} ended while "
            f"this rank waited: {'; '.join(parts)} ({_first_line(exc)}). Every rank must take part in "
            f"every collective: look at that rank's last output."
        )

    # -- distkit's collectives, when one is slow --------------------------------------------------

    def on_slow(
        self,
        store: Any,
        *,
        key: str,
        what: str,
        arrived: Callable[[Mapping[str, Any]], bool],
        behind: Callable[[Mapping[str, Any]], bool],
        local: Callable[[], dict[str, Any]],
        waited_s: float,
    ) -> float:
        """One check of a distkit collective that is still pending after ``waited_s``.

        Returns how long to wait before the next check. Raises :class:`CollectiveMismatchError`
        when a rank that did not arrive never will (with the watchdog on, reports and exits).
        ``key`` names the collective the same way on every rank; ``arrived(answer)`` tells whether a
        rank is in it; ``behind(answer)`` whether it is still finishing an earlier one (late).
        """
        state = self._slow.setdefault(key, _SlowOp())
        if state.checker is None:
            # One rank per collective asks; the others wait for its verdict.
            state.checker = int(store.add(_key("slow", key), 1)) == 1
        if not state.checker:
            verdict_key = _key("verdict", key)
            if store.check([verdict_key]):
                verdict = json.loads(store.get(verdict_key))
                raise CollectiveMismatchError(
                    f"{self.label} {verdict['message']}",
                    missing_ranks=verdict["missing"],
                    where=verdict["where"],
                )
            return _VERDICT_POLL_S
        answers = self.ask(store, "where", wait_s=_QUERY_ANSWER_S)
        elsewhere: dict[int, dict[str, Any]] = {}
        ended: dict[int, dict[str, Any]] = {}
        for rank in range(self.world_size):
            if rank == self.rank:
                continue
            answer = answers.get(rank)
            if answer is None:
                answer = self.absent(store, rank)
                if answer["kind"] in ("gone", "left"):
                    ended[rank] = answer
                continue  # silent: maybe late, maybe dead on another host; the watchdog decides
            if arrived(answer) or behind(answer) or answer.get("kind") == BUSY or self._finishing(answer):
                continue
            elsewhere[rank] = answer
        if not elsewhere and not ended:
            state.confirm = None
            state.next_wait = min(state.next_wait * 2, _MAX_CHECK_S)
            return state.next_wait
        seen = tuple(
            sorted(
                (
                    rank,
                    a.get("op"),
                    a.get("file"),
                    a.get("line"),
                    a.get("seqs", {}).get(self.helper_group_name),
                )
                for rank, a in elsewhere.items()
            )
        )
        if elsewhere and state.confirm != seen:
            state.confirm = seen
            return _CONFIRM_S
        self._mismatch(store, key, what, local(), {**elsewhere, **ended}, waited_s)

    def _finishing(self, answer: Mapping[str, Any]) -> bool:
        """Whether a rank waiting in a collective of torch's (or DDP's all-reduce) is only finishing
        one that this rank has issued too: on no group that both are in has it issued more.

        Collectives are matched by their count on a group, and this rank has gone past that one,
        so it will complete: the rank is late (a slow rank at the end of a DDP step on a busy
        machine), not somewhere this rank can never meet it. A rank that has issued more on some
        group waits there for this rank, which is not coming. distkit's own collectives are
        decided by ``arrived``/``behind``.
        """
        theirs = answer.get("seqs") or {}
        if answer.get("kind") != WAIT or answer.get("helper") is not None or not theirs:
            return False
        mine = _hang_where.group_seqs()
        return all(
            count <= mine[name]
            for name, count in theirs.items()
            if name in mine and name != self.helper_group_name
        )

    def _mismatch(
        self,
        store: Any,
        key: str,
        what: str,
        local: dict[str, Any],
        missing: dict[int, dict[str, Any]],
        waited_s: float,
    ) -> NoReturn:
        ranks = sorted(missing)
        where = []
        for rank in ranks:
            answer = missing[rank]
            place = _hang_report.location_text(answer)
            where.append(f"rank {rank} {_hang_report.doing_text(answer)}{' at ' + place if place else ''}")
        op = local.get("op") or f"distkit.{what}"
        other_src = _other_src(self.rank, local, missing)
        if self.timeout is not None and self.available:
            header = (
                f"distkit: {op} waits for {_hang_report.ranks_text(ranks)}, which can never arrive "
                f"(seen after {waited_s:.1f} s). Where each rank is:"
            )
            if other_src is not None:
                header = f"distkit: {other_src} Where each rank is:"
            try:
                side = self._side_store()
            except Exception:  # no second connection (the store's host ended): the one in hand
                side = store
            self.roll_call(side, header=header, local=local)
        here = _hang_report.location_text(local)
        advice = (
            f"A collective must be called by every rank, in the same order: call it on every "
            f"rank{_where_to_move(local, missing)}."
        )
        if other_src is not None:
            advice = other_src
        elif local.get("internal"):
            # Nothing of the user's is on this rank's stack: blaming the user would mislead.
            work = f" ({self.workload})" if self.workload else ""
            advice = (
                f"This is distkit's own code{work}, not yours: its ranks went different ways, a bug "
                f"in distkit. Please report it with this message."
            )
        message = (
            f"{op}{' at ' + here if here else ''} waits for {_hang_report.ranks_text(ranks)}, which can "
            f"never arrive: {'; '.join(where)}. {advice} See docs/debugging.md."
        )
        with contextlib.suppress(Exception):
            store.set(
                _key("verdict", key), json.dumps({"message": message, "missing": ranks, "where": where})
            )
        raise CollectiveMismatchError(f"{self.label} {message}", missing_ranks=ranks, where=where)

    def check_collective(self, what: str, waited_s: float) -> float:
        """:meth:`on_slow` for a distkit collective on the helper group, from the waiting thread.

        A rank arrived when it waits in the same distkit collective (as its stack names it) with as
        many operations issued on the helper group: collectives are matched by that count.
        """
        seq = self._helper_seq()
        frames = _hang_where.thread_frames(threading.get_ident())
        here = _hang_where.locate(frames)
        helper, src = here.helper or what, here.helper_src
        del frames
        return self.on_slow(
            self.store,
            key=f"c{seq}",
            what=helper,
            # A rank in the same collective with another src has not arrived: it never will.
            arrived=lambda a: (
                a.get("helper") == helper and a.get("helper_seq") == seq and a.get("helper_src") == src
            ),
            behind=lambda a: a.get("helper") is not None and (a.get("helper_seq") or 0) < (seq or 0),
            local=lambda: self.where(_hang_where.thread_frames(threading.get_ident())),
            waited_s=waited_s,
        )

    def finish_collective(self) -> None:
        """Forget the slow collective of the helper group that just completed or failed."""
        self.finish_slow(f"c{self._helper_seq()}")

    def watch_barrier(self, generation: int, release_key: str) -> tuple[object, list[Any]]:
        """Check a barrier from the slow-wait thread while the calling thread blocks in the store.

        On a verdict the error goes into the returned list, and writing ``release_key`` (which only
        the last rank to arrive and this check write) unblocks the caller.
        """
        if self._slow_watch is None:
            self._slow_watch = _SlowWatch()
        thread = threading.get_ident()
        errors: list[Any] = []
        start = time.monotonic()

        def job() -> float | None:
            try:
                store = self._side_store()
                return self.on_slow(
                    store,
                    key=f"b{generation}",
                    what="barrier",
                    # A rank counts itself into barrier g when it enters it.
                    arrived=lambda a: int(a.get("barrier") or 0) >= generation,
                    behind=lambda a: a.get("helper") == "barrier" and (a.get("barrier") or 0) < generation,
                    local=lambda: self.where(_hang_where.thread_frames(thread)),
                    waited_s=time.monotonic() - start,
                )
            except CollectiveMismatchError as err:
                errors.append(err)
                with contextlib.suppress(Exception):
                    self._side_store().set(release_key, "abort")
                return None

        return self._slow_watch.arm(job), errors

    def unwatch_barrier(self, token: object) -> None:
        if self._slow_watch is not None:
            self._slow_watch.disarm(token)

    def finish_slow(self, key: str) -> None:
        """Forget a slow collective that completed after all."""
        self._slow.pop(key, None)
