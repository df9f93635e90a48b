"""CheckpointManager: a directory of step checkpoints with retention, latest, best and async saves
(private; public as :class:`distkit.CheckpointManager`).

The manager owns the policy: who writes (one run, one writer per directory: :meth:`claim`), when
(synchronously, or on a writer thread with ``async_save=True``), in which format (full, or sharded
through DCP when the state holds sharded modules), and which checkpoint a resume picks. Finding,
verifying and deleting step checkpoints is :mod:`distkit.checkpoint._retention`'s concern, and the
save in flight of an async manager (its writer threads) :mod:`distkit.checkpoint._async`'s.
"""

from __future__ import annotations

import os
import warnings
import weakref
from collections.abc import Mapping
from typing import Any, Literal

from distkit import runtime
from distkit._utils.secrets import redact_url
from distkit.checkpoint._async import (
    _async_group,
    _full_writer,
    _Pending,
    _settle,
    _snapshot_on_main,
    _start_sharded_writer,
    _track,
    _watch_at_exit,
)
from distkit.checkpoint._commit import (
    DEFAULT_FILE_MODE,
    _check_file_mode,
    _Handshake,
    _metrics_for_manifest,
    _reported_to_the_others,
    _resolve_timeout,
    _step_for_manifest,
)
from distkit.checkpoint._errors import CheckpointConflictError, CheckpointCorruptError
from distkit.checkpoint._files import _join, _storage_for
from distkit.checkpoint._format import _MANIFEST_FILE
from distkit.checkpoint._io import _load_verified, _restore_into, _save_checkpoint
from distkit.checkpoint._lock import _LocalWriterLock, _writer_lock_for
from distkit.checkpoint._retention import _mislabeled, _shown_steps, _skipping_mislabeled, _StepDirectory
from distkit.checkpoint._sharded import _check_sharded_option, _use_sharded
from distkit.checkpoint._state import _check_state, _collect
from distkit.collectives import _outcomes
from distkit.errors import CollectiveTimeoutError, DistkitError
from distkit.runtime import _rank_label


class CheckpointManager:
    """A directory of step checkpoints: atomic saves, retention, ``latest()``, ``best()``, resume.

    Each save is a checkpoint directory ``step_<9 digits>`` inside ``directory`` (local or fsspec
    URL), written with :func:`save_checkpoint`'s protocol. Retention runs on rank 0 only after the new
    checkpoint is committed, so the last good one is never lost: it keeps the ``keep_last`` newest
    checkpoints that verify, the ``keep_best`` best by ``monitor``, and the one just saved; it
    removes the others and the leftovers of saves that were killed, and it never deletes what it
    cannot read (a malformed or newer manifest, a damaged file: kept, with one warning).

    **One run, one writer per directory.** The first ``save()`` or ``restore()`` *claims* the
    directory (:meth:`claim`): rank 0 takes its writer lock (a kernel lock beside a local directory,
    released when the holder exits or dies; a lease inside an object-store directory), so a second
    writer is refused with :class:`CheckpointConflictError` naming the first. A fresh run is refused
    the same way when the directory already holds committed checkpoints of another run: resume it
    (``restore()``), write elsewhere, or pass ``overwrite=True`` to delete them. :meth:`close` (or
    leaving a ``with`` block, garbage collection, interpreter exit) releases the lock.

    With ``async_save=True`` the state is copied to CPU memory (the only stall the training loop
    pays) and written by a background thread; one save is in flight at a time (the next ``save()``
    waits for it), ``wait()`` and interpreter exit wait for it, and a background failure is raised at
    the next ``save()`` or ``wait()`` on every rank. One that nothing waited for (the script ended
    first) is printed at exit, and the process exits with status 1.

    **Sharded states** (modules with DTensor parameters, as FSDP2's ``fully_shard`` makes them) are
    saved as sharded checkpoints by default: every rank writes its own shards through
    ``torch.distributed.checkpoint`` (with ``dcp.async_save`` in async mode), under the same commit
    protocol, retention and ``latest()``; ``restore()`` reshards them to this job's world size and
    wrapping (FSDP, DDP or a plain module). See ``docs/checkpoints.md``.

    Args:
        directory: Where the step checkpoints live.
        keep_last: How many of the newest checkpoints to keep (``None``: all).
        keep_best: How many of the best checkpoints by ``monitor`` to keep as well.
        monitor: Metric name (from ``save(..., metrics=...)``) that ranks checkpoints for ``best()``.
        mode: ``"min"`` or ``"max"``: whether a lower or higher ``monitor`` is better.
        async_save: Write in a background thread (see above).
        file_mode: Permission bits of local files (default 0o600: the owner only).
        timeout_s: How long ranks other than 0 wait for rank 0 to commit a save or decide a claim
            (default :data:`DEFAULT_SAVE_TIMEOUT_S`).
        overwrite: **Destructive.** When this manager claims the directory for a fresh run (it did not
            resume), delete the checkpoints already there instead of refusing. A manager that resumes
            (``restore()``, ``claim(resuming=True)``, a ``latest()`` that found one) deletes nothing.
        sharded: ``"auto"`` (default): a sharded checkpoint when a module or optimizer of the state
            has DTensor parameters, else a full one; ``True``: always sharded (local directories
            only); ``False``: always full (a state with DTensor parameters is refused).

    Example:
        >>> import torch
        >>> from distkit import CheckpointManager
        >>> model = torch.nn.Linear(2, 2)
        >>> with CheckpointManager("/tmp/ckpts_example", keep_last=2) as manager:
        ...     step = manager.restore({"model": model})  # None on a fresh start
        ...     _ = manager.save(100 if step is None else step + 100, {"model": model})
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        keep_last: int | None = 3,
        keep_best: int | None = None,
        monitor: str | None = None,
        mode: Literal["min", "max"] = "min",
        async_save: bool = False,
        file_mode: int = DEFAULT_FILE_MODE,
        timeout_s: float | None = None,
        overwrite: bool = False,
        sharded: bool | Literal["auto"] = "auto",
    ) -> None:
        for name, value in (("keep_last", keep_last), ("keep_best", keep_best)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1 or None, got {value!r}.")
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', got {mode!r}.")
        if keep_best is not None and monitor is None:
            raise ValueError(
                f"keep_best={keep_best} needs monitor=<metric name> to know which checkpoints are best."
            )
        if not isinstance(overwrite, bool):
            raise TypeError(f"overwrite must be True or False, got {overwrite!r}.")
        _check_file_mode(file_mode)
        _check_sharded_option(sharded)
        # Configuration.
        self._storage, self.directory = _storage_for(directory)
        _check_manager_directory(self._storage, self.directory)
        self._dir = _StepDirectory(self._storage, self.directory)
        self.keep_last = keep_last
        self.keep_best = keep_best
        self.monitor = monitor
        self.mode = mode
        self.async_save = async_save
        self.file_mode = file_mode
        self.timeout_s = _resolve_timeout(timeout_s)
        self.overwrite = overwrite
        self.sharded = sharded
        # Ownership of the directory: the writer lock (taken on rank 0 only), whether this manager
        # has claimed the directory, and whether it resumes what is there (restore(), latest()).
        self._lock = _writer_lock_for(self._storage, self.directory, file_mode)
        self._claimed = False
        self._resuming = False
        # The finalizer holds the lock, not the manager: garbage collection and interpreter exit
        # release it.
        self._release_lock = weakref.finalize(self, self._lock.release)
        # The save in flight (async mode), until every rank has settled it.
        self._pending: _Pending | None = None
        # The gloo group of the threads that finish async sharded saves (their collectives must not
        # interleave with the training thread's): made by the first such save, on every rank.
        self._async_group: Any = None
        _watch_at_exit(self)

    def path_for(self, step: int) -> str:
        """The checkpoint directory of ``step`` (whether or not it exists). Local.

        Example:
            >>> CheckpointManager("/tmp/ckpts_example").path_for(7)
            '/tmp/ckpts_example/step_000000007'
        """
        return _join(self.directory, f"step_{step:09d}")

    # ---- owning the directory

    def claim(self, *, resuming: bool = False) -> None:
        """Start writing into the directory: take its writer lock, and refuse to mix two runs.

        Collective: call on every rank; rank 0 decides and the others learn the outcome from it (they
        wait at most ``timeout_s``), so every rank returns or every rank raises the same error.
        Without a process group the one process claims. Idempotent: a claimed manager returns at
        once. ``save()`` claims implicitly on its first call and ``restore()`` claims as resuming, so
        calling this is only needed to fail early (before training starts) or to declare a resume
        done by hand.

        Rank 0 takes the directory's writer lock, then refuses when the directory holds committed
        checkpoints and this manager neither resumes (``resuming=True``, an earlier ``restore()``, or
        an earlier ``latest()`` that returned a checkpoint) nor has ``overwrite=True``. With
        ``overwrite=True`` and no resume, the checkpoints there are deleted (with a warning listing
        them).

        Args:
            resuming: This run continues from a checkpoint of this directory (for example one you
                loaded with :func:`load_checkpoint`), so the checkpoints there are its own.

        Raises:
            CheckpointConflictError: Another writer holds the directory (names its host, pid, start
                time and job id), or the directory holds another run's checkpoints (names the steps
                and the three ways out).

        Example:
            >>> manager = CheckpointManager("/tmp/ckpts_claim_example", overwrite=True)
            >>> manager.claim()  # fails here, before training, rather than at the first save
            >>> manager.close()
        """
        if self._claimed:
            return
        resuming = resuming or self._resuming
        multi = runtime.get_world_size() > 1
        handshake = (
            _Handshake(
                f"checkpoint directory {redact_url(self.directory)}",
                self.timeout_s,
                action="claiming",
                verb="claim",
            )
            if multi
            else None
        )
        if handshake is not None and runtime.get_rank() != 0:
            handshake.settle_other()
            self._claimed = True
            return
        with _reported_to_the_others(handshake):
            self._claim_here(resuming)
        self._claimed = True

    def _claim_here(self, resuming: bool) -> None:
        # A local lock excludes other writers, so it is taken before the directory is looked at.
        # An object-store lease is taken over, not waited for: only once the claim is accepted, so
        # that a refused newcomer never stops the live writer it would have displaced.
        lock_first = isinstance(self._lock, _LocalWriterLock)
        if lock_first:
            self._lock.acquire()
        try:
            entries = [] if resuming else self._dir.entries()
            committed = sorted({entry.step for entry in entries if entry.committed})
            if committed and not self.overwrite:
                raise CheckpointConflictError(
                    f"the checkpoint directory {redact_url(self.directory)} already holds committed "
                    f"checkpoints (steps {_shown_steps(committed)}) that this run did not resume from. A "
                    f"new run writing there would inherit or destroy them (retention deletes by step, and "
                    f"a later resume would continue the old run). Either resume that run "
                    f"(manager.restore(state), Trainer(resume='auto'), or "
                    f"manager.claim(resuming=True) after loading one yourself), write to another "
                    f"directory, or start over with CheckpointManager(..., overwrite=True), which "
                    f"deletes them.",
                    directory=self.directory,
                    steps=committed,
                    label=_rank_label(),
                )
            if not lock_first:
                self._lock.acquire()
            if self.overwrite and not resuming:
                self._dir.delete_for_overwrite(entries)
        except BaseException:
            self._lock.release()
            raise

    def close(self) -> None:
        """Wait for the save in flight, then release the directory's writer lock.

        Collective: call on every rank (it waits like :meth:`wait`). Also done when a ``with`` block
        ends, when the manager is garbage collected and at interpreter exit. The manager stays usable:
        a later ``save()`` claims the directory again, as a resume of its own run.

        Raises:
            DistkitError: The save in flight failed (as for :meth:`wait`); the lock is released anyway.

        Example:
            >>> manager = CheckpointManager("/tmp/ckpts_example")
            >>> manager.close()
        """
        try:
            self.wait()
        finally:
            self._release()

    def _release(self) -> None:
        if self._claimed:
            self._resuming = True  # the checkpoints there are this manager's own from now on
        self._claimed = False
        self._lock.release()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if exc_type is None:
            self.close()
            return
        # Already failing: let the writer thread finish (the lock must outlive it) without raising
        # over the error in flight and without waiting on the other ranks, which may be gone. A
        # background failure is still reported at interpreter exit.
        pending = self._pending
        try:
            if pending is not None and pending.thread is not None:
                pending.thread.join(self.timeout_s)
        finally:
            self._release()

    # ---- saving

    def save(self, step: int, state: Mapping[str, Any], metrics: Mapping[str, float] | None = None) -> str:
        """Save ``state`` as the checkpoint of ``step``, then apply retention.

        Collective: call on every rank. Without a process group the one process saves. A save of a
        step that already exists replaces it. The first save claims the directory (:meth:`claim`).
        Once the checkpoint is committed, nothing raises any more: a retention failure is a warning.

        Args:
            step: Training step (integer >= 0); it names the checkpoint and orders ``latest()``.
            state: Names to objects, as for :func:`save_checkpoint`.
            metrics: Numbers for the manifest and for ``best()`` (already reduced across ranks).
                When given with a ``monitor``, they must contain it.

        Returns:
            The checkpoint's path (in async mode: where it will be committed).

        Raises:
            CheckpointConflictError: The claim was refused (see :meth:`claim`), or, on an object
                store, another writer has taken the directory over.
            DistkitError: The previous background save failed (async mode).
            OSError: Writing failed; the message names the errno, the path and a fix.
            ValueError: ``step`` is not an integer >= 0, or ``metrics`` lacks ``monitor``.

        Example:
            >>> manager.save(200, {"model": model}, metrics={"val_loss": 0.5})  # doctest: +SKIP
        """
        self.wait()
        checked = _step_for_manifest(step)
        if checked is None:
            raise ValueError("step must be an integer >= 0, got None.")
        step = checked
        metrics_json = _metrics_for_manifest(metrics)
        if self.monitor is not None and metrics_json is not None and self.monitor not in metrics_json:
            raise ValueError(
                f"metrics has no {self.monitor!r} (the monitor of this CheckpointManager); it has "
                f"{sorted(metrics_json)}. Pass it, or save without metrics to skip ranking this step."
            )
        self.claim()
        path = self.path_for(step)
        if not self.async_save:
            _save_checkpoint(
                path,
                state,
                step=step,
                metrics=metrics_json,
                collective=True,
                file_mode=self.file_mode,
                timeout_s=self.timeout_s,
                guard=self._lock.check,
                storage=self._storage,
                sharded=self.sharded,
            )
            if runtime.get_rank() == 0:
                self._retain(step)
            return path
        _check_state(state)
        multi = runtime.get_world_size() > 1
        handshake = _Handshake(f"checkpoint {redact_url(path)}", self.timeout_s) if multi else None
        pending = _Pending(step, path, handshake, main=runtime.get_rank() == 0)
        if _use_sharded(state, self.sharded):
            if multi and self._async_group is None:
                self._async_group = _async_group(self.timeout_s)
            pending.thread = _start_sharded_writer(
                self._storage,
                pending,
                state,
                metrics_json,
                file_mode=self.file_mode,
                guard=self._lock.check,
                group=self._async_group,
                on_committed=self._retain,
            )
            self._in_flight_now(pending)
            return path
        if not pending.main:
            _collect(state)  # state_dict() may be collective (ResumeState gathers RNG states)
            self._in_flight_now(pending)
            return path
        try:
            snapshot = _snapshot_on_main(pending, state)
        except BaseException:
            self._in_flight_now(pending)
            raise
        pending.thread = _full_writer(
            self._storage,
            pending,
            snapshot,
            metrics_json,
            file_mode=self.file_mode,
            guard=self._lock.check,
            on_committed=self._retain,
        )
        self._in_flight_now(pending)
        pending.thread.start()
        return path

    def _in_flight_now(self, pending: _Pending) -> None:
        # Until wait() settles it; interpreter exit reports it if it fails unseen (even once this
        # manager is garbage).
        self._pending = pending
        _track(pending, directory=self.directory, timeout_s=self.timeout_s)

    def wait(self) -> None:
        """Block until the save in flight (async mode) is committed; raise if it failed.

        Collective: call on every rank (each learns the outcome; rank 0 waits for its writer). Returns
        at once when nothing is in flight.

        Raises:
            DistkitError: On rank 0, the background save failed (chained to the original error).
            MainProcessError: On the other ranks, the background save failed on rank 0.
            CollectiveTimeoutError: Rank 0 did not report within ``timeout_s``.

        Example:
            >>> import torch
            >>> manager = CheckpointManager("/tmp/ckpts_example", async_save=True, overwrite=True)
            >>> _ = manager.save(1, {"w": torch.ones(1)})
            >>> manager.wait()  # step 1 is committed now
        """
        pending = self._pending
        if pending is None:
            return
        if pending.thread is not None:  # rank 0's writer, or any rank's in a sharded save
            pending.thread.join(self.timeout_s)
            if pending.thread.is_alive():
                raise CollectiveTimeoutError(
                    f"{_rank_label()} the background save of step {pending.step} to "
                    f"{redact_url(pending.path)} "
                    f"is still running after {self.timeout_s:g} s; raise timeout_s if saves legitimately "
                    f"take this long.",
                    missing_ranks=None,
                    timeout_s=self.timeout_s,
                )
        self._pending = None
        _settle(pending)
        if not pending.main:
            if pending.handshake is not None:
                pending.handshake.settle_other()  # rank 0 names this rank if its shards failed
            return
        if pending.handshake is not None:
            pending.handshake.settle_main()
        if isinstance(pending.error, CheckpointConflictError) and not pending.raised:
            raise pending.error  # the same refusal as on the other ranks, not a crash to wrap
        if pending.error is not None and not pending.raised:
            raise DistkitError(
                f"{_rank_label()} the background save of step {pending.step} to {redact_url(pending.path)} "
                f"failed: {type(pending.error).__name__}: {pending.error}"
            ) from pending.error

    # ---- finding checkpoints

    def _in_flight(self) -> int | None:
        return self._pending.step if self._pending is not None else None

    def latest(self) -> str | None:
        """The newest committed checkpoint that verifies, or ``None``.

        Local: no communication; every rank reads the directory. Checks sizes and checksums (which
        reads the files), newest step first; partial and corrupt checkpoints, and step directories
        whose manifest names another step (copied or renamed by hand), are skipped with a warning
        naming them. Does not wait for a save in flight. A checkpoint with a newer
        ``format_version`` than this distkit reads raises instead of being skipped (upgrade distkit).

        A ``latest()`` that returns a checkpoint counts as resuming (see :meth:`claim`): the pattern
        ``path = manager.latest(); load_checkpoint(path, state)`` followed by ``save()`` continues
        that run, and a requeued job written that way keeps working.

        Raises:
            ForeignCheckpointError: The directory holds no distkit checkpoint but other tools' ones
                (torchtitan's ``step-N`` directories, Accelerate's ``checkpoint_N``, Lightning's
                ``*.ckpt``): the message names them and how to load or convert the newest. An empty or
                missing directory returns ``None``.
            DistkitError: The newest checkpoint has a newer ``format_version`` (upgrade distkit).

        Example:
            >>> manager.latest()  # doctest: +SKIP
            '/tmp/ckpts_example/step_000000100'
        """
        entries = self._dir.entries()
        if not entries and (foreign := self._dir.foreign_only()) is not None:
            raise foreign
        found = self._dir.first_that_verifies([e for e in entries if e.committed], entries, self._in_flight())
        if found is None:
            return None
        self._resuming = True
        return found.path

    def best(self) -> str | None:
        """The committed checkpoint with the best ``monitor`` value that verifies, or ``None``.

        Local: no communication. Ties go to the later step; checkpoints saved without the metric
        (or whose manifest cannot be read) do not compete. Corrupt ones are skipped with a warning.
        Unlike ``latest()``, it does not count as resuming.

        Raises:
            ValueError: The manager has no ``monitor``.

        Example:
            >>> manager.best()  # doctest: +SKIP
        """
        if self.monitor is None:
            raise ValueError(
                "best() needs a monitor: create the CheckpointManager with monitor=<metric name>."
            )
        entries = self._dir.entries()
        ranked = self._dir.ranked_by_metric([e for e in entries if e.committed], self.monitor, self.mode)
        found = self._dir.first_that_verifies(ranked, [], self._in_flight())
        return None if found is None else found.path

    # ---- resuming

    def restore(self, state: Mapping[str, Any], *, strict: bool = True) -> int | None:
        """Load the newest checkpoint that verifies into ``state``; return its step, or ``None``.

        Collective: call on every rank; they load the same step (checked) onto their own devices.
        Without a process group the one process loads. Corrupt and partial checkpoints, and step
        directories whose manifest names another step, are skipped with a warning, falling back to
        the next older one. Waits for a save in flight first, and
        claims the directory as resuming (:meth:`claim`), so a requeued job restores and saves on.

        Args:
            state: Names to objects, as for :func:`load_checkpoint`.
            strict: As for :func:`load_checkpoint`.

        Returns:
            The restored step, or ``None`` when there is no usable checkpoint (a fresh start).

        Raises:
            CheckpointConflictError: Another writer holds the directory.
            ForeignCheckpointError: The directory holds no distkit checkpoint but other tools' ones
                (as for :meth:`latest`), on every rank.
            DistkitError: Restoring failed on another rank (this rank re-raises its own error),
                ranks restored different steps (the directory changed while they read it), or the
                newest checkpoint has a newer ``format_version`` (upgrade distkit).

        Example:
            >>> step = manager.restore({"model": model})  # doctest: +SKIP
            >>> start = 0 if step is None else step + 1  # doctest: +SKIP
        """
        _check_state(state)  # restore(model): said before anything is read or claimed
        self.wait()
        self.claim(resuming=True)
        restored: int | None = None
        failure: Exception | None = None
        try:
            restored = self._restore_newest(state, strict)
        except Exception as err:
            failure = err
        chosen, failed = _outcomes(failure, restored)
        if failed:
            raise DistkitError(
                f"{_rank_label()} restoring from {redact_url(self.directory)} failed on rank(s) "
                f"{sorted(failed)}: " + "; ".join(f"rank {rank}: {error}" for rank, error in failed.items())
            )
        if len(set(chosen)) > 1:
            none = [rank for rank, step in enumerate(chosen) if step is None]
            why = (
                "The directory changed while they read it; make sure no other job writes to it and "
                "restore again."
            )
            if none:
                # Not a race: a rank that finds nothing where another finds checkpoints reads
                # another directory under the same path (its own node's disk).
                why = (
                    f"Rank(s) {none} found no checkpoint there at all: their hosts see a directory of "
                    f"their own at that path (a node-local disk), not the one rank 0 saves to. Put the "
                    f"checkpoint directory on a filesystem every node mounts (NFS, Lustre, GPFS...); "
                    f"for the Trainer, pass such a default_root_dir."
                )
            raise DistkitError(
                f"{_rank_label()} ranks restored different checkpoints from {redact_url(self.directory)}: "
                f"{dict(enumerate(chosen))} (rank: step). {why}"
            )
        return restored

    def _restore_newest(self, state: Mapping[str, Any], strict: bool) -> int | None:
        entries = self._dir.entries()
        if not entries and (foreign := self._dir.foreign_only()) is not None:
            raise foreign
        for entry in (e for e in entries if e.committed):
            try:
                loaded, manifest = _load_verified(self._storage, entry.path, "auto")
            except FileNotFoundError:
                continue  # deleted since the listing
            except CheckpointCorruptError as err:
                self._dir.corrupt[entry.path] = err.reason
                warnings.warn(
                    f"{_rank_label()} skipping corrupt checkpoint {redact_url(entry.path)}: {err.reason}.",
                    stacklevel=3,
                )
                continue
            if _mislabeled(entry, manifest) is not None:  # as latest(): skipped, see _skipping_mislabeled
                warnings.warn(_skipping_mislabeled(entry, manifest), stacklevel=3)
                continue
            self._dir.warn_partials(entries, above=entry.step, in_flight=None)
            _restore_into(entry.path, loaded, manifest, state, strict, stacklevel=4)
            return manifest["step"] if manifest["step"] is not None else entry.step
        self._dir.warn_partials(entries, above=-1, in_flight=None)
        return None

    # ---- retention (rank 0, after a commit)

    def _retain(self, just_saved: int) -> None:
        """Retention after the commit of ``just_saved``. Never raises: that checkpoint is committed."""
        try:
            self._dir.apply_retention(just_saved, self.keep_last, self.keep_best, self.monitor, self.mode)
        except Exception as err:
            warnings.warn(
                f"{_rank_label()} retention after saving step {just_saved} in {redact_url(self.directory)} "
                f"failed: {type(err).__name__}: {err}. The new checkpoint is committed; older ones were "
                f"not deleted this time.",
                stacklevel=3,
            )


# Public as distkit.checkpoint.CheckpointManager: tracebacks and reprs say so.
CheckpointManager.__module__ = "distkit.checkpoint"


def _check_manager_directory(storage: Any, directory: str) -> None:
    """Refuse a file, or one checkpoint, given as the directory a manager keeps its steps in
    (its steps would go inside that checkpoint, in silence). One look, when the manager is made."""
    kind = storage.kind(directory)
    if kind == "file":
        raise ValueError(
            f"CheckpointManager needs a directory to keep its checkpoints (step_000000100, ...) in, "
            f"but {redact_url(directory)} is a file. Pass a directory (a new one is made)."
        )
    if kind == "dir" and _MANIFEST_FILE in (storage.contents(directory) or set()):
        raise ValueError(
            f"{redact_url(directory)} is one checkpoint (it holds {_MANIFEST_FILE}), not a directory "
            f"of them: a CheckpointManager there would write its steps inside it. Load it with "
            f"distkit.load_checkpoint(path, state), and give the manager a directory of its own."
        )
