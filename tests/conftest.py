"""Fixtures of the whole test suite (distkit's own ``ranks`` fixture comes from its pytest plugin)."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest

import distkit
from _launch import is_launcher_var

# The signals torch.distributed.elastic takes over in a process that launches workers: its
# PContext.start() installs, from the main thread, a handler that raises SignalException for each
# (TORCHELASTIC_SIGNALS_TO_HANDLE's default) and never puts the previous one back. A fit that
# starts its own processes inside the pytest process (devices=2 outside a launcher) leaves them
# installed, and a SIGTERM or Ctrl-C sent to pytest later surfaces as SignalException inside an
# unrelated test instead of stopping the session.
_ELASTIC_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT") if hasattr(signal, name)
)


@pytest.fixture(autouse=True)
def _restore_signal_handlers() -> Iterator[None]:
    """Put back, after each test, the handlers of the signals a launch in this process replaces."""
    before = {signum: signal.getsignal(signum) for signum in _ELASTIC_SIGNALS}
    yield
    for signum, handler in before.items():
        # None: a handler not installed from Python, which cannot be reinstalled from here.
        if handler is not None and signal.getsignal(signum) is not handler:
            signal.signal(signum, handler)


@pytest.fixture
def world_of_one(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """This test process as a world of one: no launcher variables, no process group, before and
    after the test. Yields the monkeypatch, for a test that sets launcher variables of its own."""
    for name in [name for name in os.environ if is_launcher_var(name)]:
        monkeypatch.delenv(name)
    distkit.shutdown()
    yield monkeypatch
    distkit.shutdown()
