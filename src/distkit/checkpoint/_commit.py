"""How the ranks of a job agree on a checkpoint save (private): rank 0 commits, the others wait.

Rank 0 publishes the outcome of a save or a claim (committed, or its exception) under a key of the
job's key-value store; the other ranks wait on that key with their own deadline, so a failure on
rank 0 raises on every rank instead of hanging them. Also the checks of the options every save
shares (the file mode, the timeout, the metrics recorded in the manifest). The save in flight of an
asynchronous manager is :mod:`distkit.checkpoint._async`'s concern.
"""

from __future__ import annotations

import contextlib
import json
import numbers
import time
import traceback
from collections.abc import Iterator, Mapping
from datetime import timedelta
from typing import Any

import torch

from distkit import runtime
from distkit.checkpoint._errors import CheckpointConflictError
from distkit.collectives import broadcast_object
from distkit.errors import CollectiveTimeoutError, DistkitError, MainProcessError
from distkit.runtime import _rank_label

#: Permission bits of checkpoint files: readable and writable by the owner only, because a
#: checkpoint can hold data and weights that are not meant for other users of a shared machine.
#: Directories get the matching execute bits (0o700 for 0o600).
DEFAULT_FILE_MODE = 0o600
#: How long the other ranks wait for rank 0 to commit a checkpoint. Writing is bounded by storage
#: bandwidth, not by the peers: 30 minutes covers about 1 TB at 600 MB/s.
DEFAULT_SAVE_TIMEOUT_S = 1800.0


# --------------------------------------------------------------------------------------------------
# Rank 0 writes; the other ranks learn the outcome through the job's key-value store.


class _Handshake:
    """How rank 0 tells the other ranks that a checkpoint was committed, or why not.

    Every rank creates one per save, in the same order, so they agree on the key. Through the store,
    the waiting ranks have their own deadline and rank 0 never waits for them; without a store
    (a process group adopted from elsewhere) the outcome is broadcast instead.
    """

    def __init__(self, what: str, timeout_s: float, *, action: str = "saving", verb: str = "commit") -> None:
        self.store = runtime._store()
        current = runtime._current()
        assert current is not None  # _store() ensured it
        self.key = f"checkpoint/{current.next_id('checkpoint')}"
        self.what = what
        self.timeout_s = timeout_s
        self.action = action  # "saving" checkpoint X failed on the main process
        self.verb = verb  # waited for rank 0 to "commit" checkpoint X
        self._outcome: dict[str, Any] | None = None

    def publish(self, error: BaseException | None) -> None:
        """Rank 0, as soon as the outcome is known (possibly on the writer thread)."""
        self._outcome = (
            {}
            if error is None
            else {
                "type": type(error).__qualname__,
                "message": str(error),
                "traceback": "".join(traceback.format_exception(type(error), error, error.__traceback__)),
            }
        )
        if isinstance(error, CheckpointConflictError):
            # The other ranks raise the same error (not MainProcessError): a refusal, not a crash.
            self._outcome["conflict"] = {
                "reason": error.reason,
                "directory": error.directory,
                "holder": error.holder,
                "steps": error.steps,
            }
        if self.store is not None:
            self.store.set(self.key, json.dumps(self._outcome))

    def settle_main(self) -> None:
        """Rank 0, on the training thread, after :meth:`publish`."""
        if self.store is None:
            broadcast_object(self._outcome)

    def settle_other(self) -> None:
        """The other ranks: wait for rank 0's outcome and raise its failure here too."""
        if self.store is None:
            outcome = broadcast_object(None)
        else:
            start = time.monotonic()
            try:
                self.store.wait([self.key], timedelta(seconds=self.timeout_s))
            except RuntimeError as err:
                waited = time.monotonic() - start
                if waited < self.timeout_s * 0.99:
                    raise DistkitError(
                        f"{_rank_label()} lost contact with the job's store while waiting for rank 0 to "
                        f"{self.verb} {self.what}: {err}. Rank 0 has probably died; see its log."
                    ) from err
                raise CollectiveTimeoutError(
                    f"{_rank_label()} waited {self.timeout_s:g} s for rank 0 to {self.verb} {self.what}; it "
                    f"did not report. Rank 0 is stuck or its storage is very slow; raise timeout_s if "
                    f"saves legitimately take this long.",
                    missing_ranks=[0],
                    timeout_s=self.timeout_s,
                ) from err
            outcome = json.loads(self.store.get(self.key))
            self._cleanup()
        if outcome and "conflict" in outcome:
            conflict = outcome["conflict"]
            raise CheckpointConflictError(
                conflict["reason"],
                directory=conflict["directory"],
                holder=conflict["holder"],
                steps=conflict["steps"],
                label=_rank_label(),
            )
        if outcome:
            raise MainProcessError(
                f"{_rank_label()} {self.action} {self.what} failed on the main process (rank 0): "
                f"{outcome['type']}: {outcome['message']}",
                exc_type=outcome["type"],
                exc_message=outcome["message"],
                remote_traceback=outcome["traceback"],
            )

    def _cleanup(self) -> None:
        # The last rank to read the outcome deletes it, so keys do not pile up over a long run.
        assert self.store is not None
        readers = self.store.add(f"{self.key}/read", 1)
        if readers == runtime.get_world_size() - 1:
            self.store.delete_key(self.key)
            self.store.delete_key(f"{self.key}/read")


@contextlib.contextmanager
def _reported_to_the_others(handshake: _Handshake | None) -> Iterator[None]:
    """Rank 0: run the block, then publish and settle its outcome (nothing without a handshake)."""
    error: BaseException | None = None
    try:
        yield
    except BaseException as err:
        error = err
        raise
    finally:
        if handshake is not None:
            handshake.publish(error)
            handshake.settle_main()


def _resolve_timeout(timeout_s: float | None) -> float:
    if timeout_s is None:
        return DEFAULT_SAVE_TIMEOUT_S
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}.")
    return float(timeout_s)


def _check_file_mode(file_mode: int) -> None:
    if not isinstance(file_mode, int) or not 0 <= file_mode <= 0o777 or not file_mode & 0o600 == 0o600:
        raise ValueError(
            f"file_mode must be permission bits that let the owner read and write, e.g. 0o600 or "
            f"0o640, got {file_mode!r}."
        )


def _step_for_manifest(step: Any) -> int | None:
    """``step`` as the manifest records it; refused before anything is written when a load would
    later refuse the checkpoint for it (a string, a float, a negative number)."""
    if step is None:
        return None
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
        hint = "; pass int(step)" if isinstance(step, (torch.Tensor, str, float)) else ""
        raise ValueError(f"step must be an integer >= 0 or None, got {step!r} ({type(step).__name__}){hint}.")
    return int(step)


def _metrics_for_manifest(metrics: Mapping[str, Any] | None) -> dict[str, float] | None:
    if metrics is None:
        return None
    if not isinstance(metrics, Mapping):
        raise TypeError(
            f"metrics must map names to numbers (e.g. {{'val_loss': 0.31}}), got {type(metrics).__name__}."
        )
    out = {}
    for key, value in metrics.items():
        try:
            out[str(key)] = float(value.item() if isinstance(value, torch.Tensor) else value)
        except (TypeError, ValueError, RuntimeError) as err:
            raise TypeError(
                f"metrics[{key!r}] must be a number or a one-element tensor, got {value!r}."
            ) from err
    return out
