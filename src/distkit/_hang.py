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
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from types import TracebackType
from typing import Any, NoReturn

import torch.distributed as dist

from distkit import _hang_report, _hang_where
from distkit._hang_where import BUSY, WAIT
from distkit.errors import CollectiveMismatchError, DistkitError

__all__ = ["HANG_EXIT_CODE"]

#: Exit code of every rank after a hang report: ``timeout(1)``'s code for "timed out".
HANG_EXIT_CODE = 124
ENV_TIMEOUT = "DISTKIT_HANG_TIMEOUT_S"
ENV_RUN_DIR = "DISTKIT_RUN_DIR"
# "auto" (the Trainer's default): never below five minutes, else ten times the slowest step seen
# so far. A wait that long is no imbalance between healthy ranks: their steps take the same time.
AUTO_FLOOR_S = 300.0
AUTO_MULTIPLE = 10.0
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
_ROLL_CALL_ANSWER_S = 5.0
# How long a rank waits for the reporting rank's report before it exits on its own.
_FOLLOW_S = 60.0
# How long the reporter waits for the other ranks to exit before it exits itself (so that a
# launcher which kills the survivors of a failed rank sees every rank end alike).
_EXITS_S = 3.0
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
    return value or None


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


def _exit() -> NoReturn:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            if stream is not None:
                stream.flush()
    os._exit(HANG_EXIT_CODE)


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
        # What this rank answers while its watched thread unwinds a failure (set before a roll call).
        self._local_answer: dict[str, Any] | None = None
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
        self.store.set(_key("proc", self.rank), json.dumps({"host": self.host, "pid": self.pid}))
        try:
            self._responder_store = self.store.clone()
        except (AttributeError, RuntimeError, NotImplementedError):
            return  # a store without a second connection: distkit's waits stay plain waits
        self._first_ask = int(self.store.add(_key("asks"), 0)) + 1
        self._responder = threading.Thread(target=self._respond, name="distkit-hang-responder", daemon=True)
        self._responder.start()
        self.available = True

    def stop(self) -> None:
        """Leave: say so in the store (a barrier then names this rank at once), stop the threads."""
        if self._stopping:
            return
        self._apply(None, None, None, self.watched)
        self._stopping = True
        with contextlib.suppress(Exception):
            self.store.set(_key("left", self.rank), json.dumps({"time": time.time()}))
        if self._responder is not None:
            with contextlib.suppress(Exception):
                self.store.set(_key("wake", self.rank), "stop")
            self._responder.join(_THREAD_STOP_S)

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
                self._watch_stop = threading.Event()
                self._watchdog = threading.Thread(
                    target=self._watch, args=(self._watch_stop,), name="distkit-hang-watchdog", daemon=True
                )
                self._watchdog.start()
                if sys.excepthook is not self._hook:
                    self._previous_hook, sys.excepthook = sys.excepthook, self._hook
            elif sys.excepthook is self._hook:
                sys.excepthook = self._previous_hook or sys.__excepthook__

    def _side_store(self) -> Any:
        """A connection for the background threads' short operations (made once)."""
        with self._side_lock:
            if self._side is None:
                self._side = self.store.clone()
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
                if all(self.absent(store, rank)["kind"] in ("gone", "left") for rank in pending):
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
                    answer = self._local_answer or self.where()
                    store.set(_key("answer", number, self.rank), json.dumps(answer))
                    store.add(_key("answered", number), 1)
                except Exception:
                    continue
                if request.get("kind") == "hang":
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
            answers = self.ask(store, "hang", wait_s=_ROLL_CALL_ANSWER_S)
            answered = len(answers)
            answers[self.rank] = local
            for rank in range(self.world_size):
                if rank not in answers:
                    answers[rank] = self.absent(store, rank)
            names = {name for answer in answers.values() for name in (answer.get("seqs") or {})}
            labels = {
                name: _hang_where.group_label(name, helper_group=self.helper_group_name) for name in names
            }
            hints = [hint] if (hint := _flight_recorder_hint()) else []
            text, details = _hang_report.build(header, answers, group_labels=labels, hints=hints)
            directory = self.run_dir or os.environ.get(ENV_RUN_DIR) or os.getcwd()
            path, error = _hang_report.write(directory, text + "\n" + details)
            where = (
                f"every rank's stack is in {path}"
                if path
                else f"the report file failed in {directory}: {error}"
            )
            _print(f"{text}\n  ({where}; every rank exits with code {HANG_EXIT_CODE})")
            store.set(_key("done"), json.dumps({"path": path, "from": self.rank}))
        except Exception as err:
            place = _hang_report.location_text(local)
            _print(
                f"{self.label} distkit: the job is stuck, and the hang doctor's roll call failed "
                f"({_first_line(err)}). This rank {_hang_report.doing_text(local)}"
                f"{' at ' + place if place else ''}. Exiting with code {HANG_EXIT_CODE}."
            )
            _exit()
        with contextlib.suppress(Exception):
            # Wait (briefly) for the others to exit first, so that a launcher that kills the rest of
            # a job when one process ends sees every rank end with the same code; then release the
            # rank that hosts the store, which waits for this.
            end = time.monotonic() + _EXITS_S
            while time.monotonic() < end and int(store.add(_key("exited"), 0)) < answered:
                time.sleep(0.05)
            store.set(_key("bye"), "1")
            time.sleep(0.2)  # the others said so just before their own os._exit
        _exit()

    def _follow(self, store: Any, reporter: int | None, *, claimed: bool = False) -> NoReturn:
        """Wait for the reporting rank's report (bounded), say where it is, and exit."""
        if not claimed:
            self._end_here()
        try:
            store.wait([_key("done")], timedelta(seconds=_FOLLOW_S))
            done = json.loads(store.get(_key("done")))
            path = f"; also in {done['path']}" if done.get("path") else ""
            _print(
                f"{self.label} distkit: rank {done.get('from')} printed where every rank is (the hang "
                f"doctor's report{path}). Exiting with code {HANG_EXIT_CODE}."
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
        _exit()

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

    def _watch(self, stop: threading.Event) -> None:
        try:
            side = self._side_store()
        except Exception:
            return  # no second connection to the store: nobody could be asked
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

    def _excepthook(
        self, exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None
    ) -> None:
        if self._ending:
            self._end_here()  # the other ranks' exits broke this thread's collective: stay quiet
        local = self._failure_answer(exc, None) if threading.get_ident() == self.watched else None
        previous = self._previous_hook or sys.__excepthook__
        previous(exc_type, exc, tb)  # the traceback first, as Python prints it
        if local is not None:
            self.on_failure(exc, local=local)

    def _failure_answer(self, exc: BaseException, frames: _hang_where.Frames | None) -> dict[str, Any] | None:
        """This rank's answer after ``exc``, or ``None`` when the doctor leaves ``exc`` alone.

        Set as what the responder answers from now on: the watched thread is about to leave the
        place where the collective failed (to print a traceback), and a roll call may come first.
        """
        if self.timeout is None or not self.available or not is_transport_failure(exc):
            return None
        if frames is None:
            frames = _hang_where.traceback_frames(exc.__traceback__)
        local = self.where(frames, kind="failed", note=_first_line(exc))
        self._local_answer = local
        return local

    def on_failure(
        self,
        exc: BaseException,
        *,
        frames: _hang_where.Frames | None = None,
        local: dict[str, Any] | None = None,
    ) -> None:
        """A collective raised. With the watchdog on, and the error saying a peer is gone or a
        collective timed out, report where every rank is and exit; else return.

        ``frames`` is where it happened (default: the exception's traceback, complete when it
        reached the top of the thread).
        """
        if self._ending:
            self._end_here()  # the other ranks' exits broke this thread's collective: stay quiet
        if local is None:
            local = self._failure_answer(exc, frames)
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
                if answer["kind"] in ("gone", "left"):
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
            if arrived(answer) or behind(answer) or answer.get("kind") == BUSY:
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
        if self.timeout is not None and self.available:
            header = (
                f"distkit: {op} waits for {_hang_report.ranks_text(ranks)}, which can never arrive "
                f"(seen after {waited_s:.1f} s). Where each rank is:"
            )
            self.roll_call(self._side_store(), header=header, local=local)
        here = _hang_report.location_text(local)
        context = local.get("context") or ""
        move = f" (here: move it out of {context.split('in ', 1)[-1]})" if context.startswith("in `") else ""
        message = (
            f"{op}{' at ' + here if here else ''} waits for {_hang_report.ranks_text(ranks)}, which can "
            f"never arrive: {'; '.join(where)}. A collective must be called by every rank, in the same "
            f"order: call it on every rank{move}. See docs/debugging.md."
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
        helper = _hang_where.locate(frames).helper or what
        del frames
        return self.on_slow(
            self.store,
            key=f"c{seq}",
            what=helper,
            arrived=lambda a: a.get("helper") == helper and a.get("helper_seq") == seq,
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
