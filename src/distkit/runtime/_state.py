"""The process-wide state distkit keeps beside torch's process group: one :class:`_Runtime`
(or ``None``), the exit codes and the default timeout. A leaf of the package."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from distkit._doctor import doctor as _hang
from distkit.env import LaunchEnv

__all__: list[str] = []


# NCCL's own default in torch (10 minutes). gloo's is 30 minutes, which is how long a job hangs
# today when one rank stops arriving; a shorter default surfaces such bugs sooner. Long rank-0-only
# work (downloads) belongs in main_process_first(), which has its own, longer deadline.
DEFAULT_TIMEOUT_S = 600.0

#: Exit code of every rank after the hang doctor's report: ``timeout(1)``'s code for "timed out".
HANG_EXIT_CODE = _hang.HANG_EXIT_CODE
#: Exit code of a rank that only waited for another rank that failed (raised, or died).
PEER_FAILED_EXIT_CODE = _hang.PEER_FAILED_EXIT_CODE


@dataclass
class _Runtime:
    # What the launcher said and what init() chose.
    env: LaunchEnv
    backend: str | None
    device: torch.device
    timeout_s: float
    # Communication handles: the key-value store (prefixed for distkit's own keys) and a gloo group
    # for CPU-side work (objects, flags) even when the default group is NCCL.
    store: dist.Store | None = None
    cpu_group: Any = None
    # Whether distkit created the process group (and so may destroy it).
    owns_group: bool = False
    # Per-process counters; every rank calls the same sequence of collectives, so they agree.
    counters: dict[str, int] = field(default_factory=dict)
    # Barriers of groups the caller made, per group name: only their members count them, so they
    # are kept apart from the counters every rank shares.
    group_barriers: dict[str, int] = field(default_factory=dict)
    # The hang doctor (docs/debugging.md): its watchdog timeout as init() resolved it (None: off;
    # seconds; "auto"), and the doctor itself in a job of several processes with a store.
    hang_timeout_s: float | str | None = None
    doctor: _hang.Doctor | None = None

    def next_id(self, kind: str) -> int:
        self.counters[kind] = self.counters.get(kind, 0) + 1
        return self.counters[kind]


# The process group is process-wide state in torch itself; this mirrors it and holds nothing else.
_runtime: _Runtime | None = None
_atexit_registered = False


def _abandon(group: Any) -> None:
    """Let this process exit although ``group`` has a collective that will never complete.

    Called when an error ends distkit's wait for one of its own collectives while the collective
    is still pending (a :class:`~distkit.CollectiveMismatchError`, a timeout, a signal). Freeing a
    gloo group joins its threads, and the one inside that collective waits for the group's whole
    timeout (ten minutes by default) for peers that will never come: the process could not exit,
    so its launcher never ended the job (measured on torch 2.13; the group's ``abort()`` and
    ``shutdown()`` return at once but do not release that thread). So such a group is never
    freed: one reference to it is leaked on purpose (``destroy_process_group`` still unregisters
    it, so a later :func:`init` starts afresh). The process then exits at once with its own exit
    code (a traceback's 1, or what the script passed to ``sys.exit``), and the peers'
    collectives fail within a second ("Connection closed by peer"), which ends them too. Ending
    the process from an ``atexit`` hook with ``os._exit`` would also work, but it loses the exit
    code that the script chose, and runs before other ``atexit`` hooks (an async checkpoint's).
    """
    import ctypes  # here: rarely needed, and `import distkit` stays light

    ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))


def _doctor(runtime: _Runtime | None = None) -> _hang.Doctor | None:
    """This process's hang doctor, when it can ask the other ranks (a job of several processes)."""
    runtime = runtime if runtime is not None else _runtime
    if runtime is None or runtime.doctor is None or not runtime.doctor.available:
        return None
    return runtime.doctor


def _current() -> _Runtime | None:
    """This process's runtime: ``None`` before :func:`~distkit.init` and after :func:`~distkit.shutdown`."""
    return _runtime
