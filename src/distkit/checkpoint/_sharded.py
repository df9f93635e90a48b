"""Sharded checkpoints through torch's Distributed Checkpoint, DCP (private).

A state whose modules hold DTensor parameters (FSDP2's ``fully_shard``) is saved by every rank: the
modules and their optimizers go through ``torch.distributed.checkpoint`` (each rank writes its own
shards, ``__<rank>_<n>.distcp``, and rank 0 DCP's ``.metadata``), everything else (a
:class:`~distkit.checkpoint.ResumeState`, counters, schedulers) into ``state.pt`` as in a full
checkpoint. distkit's commit protocol sits on top: one staging directory for all ranks, each rank's
files fsynced and checksummed by that rank, then rank 0 writes ``state.pt`` and a manifest listing
the size and CRC32 of every file, and renames the directory into place.

Optimizers are saved by parameter name, paired with their module through DCP's
``get_optimizer_state_dict``, so a checkpoint loads on any world size and into FSDP, DDP or a plain
module alike: DCP reads, for each rank, the pieces its own shards need. Reading is
:mod:`distkit.checkpoint._dcp_load`'s concern.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from typing import Any

from torch import nn

from distkit import runtime
from distkit._utils.secrets import redact_url
from distkit.checkpoint._files import _crc32_of_fd, _LocalStorage, _open_regular, _Storage
from distkit.checkpoint._format import _DCP_METADATA_FILE, _manifest_builder
from distkit.checkpoint._state import _holds_dtensors, _optimizer_owners
from distkit.errors import DistkitError
from distkit.runtime import _rank_label

# --------------------------------------------------------------------------------------------------
# What is sharded: modules with DTensor parameters, and the optimizers that update them.


def _check_sharded_option(sharded: Any) -> None:
    if isinstance(sharded, bool) or sharded == "auto":
        return
    raise ValueError(f"sharded must be 'auto', True or False, got {sharded!r}.")


def _use_sharded(state: Mapping[str, Any], sharded: Any) -> bool:
    """Whether ``state`` is saved as a sharded checkpoint (see ``sharded`` of save_checkpoint)."""
    _check_sharded_option(sharded)
    holding = [key for key, value in state.items() if _holds_dtensors(value)]
    if sharded is False and holding:
        raise ValueError(
            f"state[{holding[0]!r}] has sharded (DTensor) parameters, as FSDP2's fully_shard makes "
            f"them, and sharded=False asks for a full checkpoint that rank 0 writes alone, which "
            f"would hold only its own shards. Save with sharded='auto' (the default) or True; "
            f"distkit.consolidate_checkpoint(src, dst) makes a full copy afterwards."
        )
    return sharded is True or bool(holding)


def _split_state(state: Mapping[str, Any]) -> tuple[list[str], dict[str, str]]:
    """The entries that go through DCP (modules, and optimizers of a module in ``state``), and the
    module of each such optimizer. Everything else goes into ``state.pt``."""
    owners = _optimizer_owners(state)
    through_dcp = []
    for key, value in state.items():
        if isinstance(value, nn.Module) or key in owners:
            through_dcp.append(key)
        elif _holds_dtensors(value):
            raise ValueError(
                f"state[{key!r}] is an optimizer over sharded (DTensor) parameters, but no module of "
                f"the state holds them all, and a sharded checkpoint saves an optimizer by the names "
                f"its module gives the parameters. Put the module it trains in the same state, e.g. "
                f"{{'model': model, {key!r}: optimizer}}."
            )
    return through_dcp, owners


def _dcp_state_dicts(state: Mapping[str, Any], keys: list[str], owners: Mapping[str, str]) -> dict[str, Any]:
    """This rank's state dicts of the DCP entries: DTensors for sharded parameters, keys by name."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    out: dict[str, Any] = {}
    for key in keys:
        value = state[key]
        if isinstance(value, nn.Module):
            out[key] = get_model_state_dict(value)
        else:
            out[key] = get_optimizer_state_dict(state[owners[key]], value)
    return out


# --------------------------------------------------------------------------------------------------
# Saving: every rank writes its shards into one staging directory; rank 0 commits.


def _group() -> Any:
    return runtime._cpu_group() if runtime.get_world_size() > 1 else None


def _gather(value: Any, group: Any) -> list[Any]:
    if runtime.get_world_size() == 1:
        return [value]
    import torch.distributed as dist

    out: list[Any] = [None] * runtime.get_world_size()
    dist.all_gather_object(out, value, group=group)
    return out


def _this_ranks_failure(err: BaseException, *, rank: int | None = None) -> BaseException | None:
    """The exception this rank raised inside ``err``, or ``None`` when only other ranks failed.

    DCP raises one ``CheckpointException`` (a ``BaseException``) on every rank when any rank failed,
    listing each failing rank's exception: each rank reports its own, and rank 0 names them all.
    """
    from torch.distributed.checkpoint.api import CheckpointException

    if not isinstance(err, CheckpointException):
        return err
    mine = err.failures.get(runtime.get_rank() if rank is None else rank)
    return None if mine is None else mine[0]


def _describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


def _agree_on_staging(
    storage: _LocalStorage, target: str, guard: Callable[[], None] | None, problem: BaseException | None
) -> str:
    """Rank 0 makes the staging directory and every rank learns it, or every rank raises.

    ``problem`` is this rank's error found before (a state that could not be collected or loaded
    back): no rank writes anything then. Collective over distkit's CPU group.
    """
    staging: str | None = None
    error = problem
    if runtime.get_rank() == 0 and error is None:
        try:
            if guard is not None:
                guard()
            staging = storage.new_staging(target)
        except BaseException as err:
            error = err
    outcomes = _gather((staging, None if error is None else _describe(error)), _group())
    failed = {rank: message for rank, (_, message) in enumerate(outcomes) if message is not None}
    if failed and staging is not None:
        os.rmdir(staging)  # still empty: no rank writes before everyone agreed
    if error is not None:
        raise error
    if failed:
        raise DistkitError(
            f"{_rank_label()} saving checkpoint {redact_url(target)} failed on rank(s) {sorted(failed)} "
            f"before anything was written: "
            + "; ".join(f"rank {rank}: {message}" for rank, message in failed.items())
        )
    staging = outcomes[0][0]
    assert staging is not None
    return staging


def _own_files(staging: str, mode: int) -> dict[str, dict[str, Any]]:
    """Size and CRC32 of the files this rank wrote into ``staging`` (DCP fsynced them already)."""
    rank = runtime.get_rank()
    pattern = re.compile(rf"^__{rank}_\d+\.distcp$")
    names = sorted(n for n in os.listdir(staging) if pattern.match(n))
    if rank == 0:
        names.append(_DCP_METADATA_FILE)
    files = {}
    for name in names:
        fd = _open_regular(staging, os.path.join(staging, name))
        try:
            size = os.fstat(fd).st_size
            files[name] = {"size": size, "crc32": f"{_crc32_of_fd(fd, size):08x}"}
            os.fchmod(fd, mode)
        finally:
            os.close(fd)
    return files


def _check_shards_here(staging: str, target: str, outcomes: list[Any]) -> None:
    """Rank 0: every rank's shard files are in ``staging`` as that rank wrote them, or nothing is
    committed. Ranks on other hosts that each see their own ``target`` (a node-local disk, not a
    filesystem every node mounts) wrote theirs where rank 0 cannot see them: committed, the
    checkpoint would list files it does not hold, and every later load would skip it."""
    unseen: dict[int, list[str]] = {}
    for rank, (rank_files, _) in enumerate(outcomes):
        for name, info in rank_files.items():
            try:
                size = os.stat(os.path.join(staging, name)).st_size
            except OSError:
                size = None
            if size != info["size"]:
                unseen.setdefault(rank, []).append(name)
    if not unseen:
        return
    import shutil

    shutil.rmtree(staging, ignore_errors=True)
    ranks = sorted(unseen)
    raise DistkitError(
        f"{_rank_label()} saving sharded checkpoint {redact_url(target)}: the shard files of rank(s) "
        f"{ranks} ({', '.join(sorted(n for r in ranks for n in unseen[r])[:4])}) are not in rank 0's "
        f"staging directory, so their hosts write to a directory of their own, not one rank 0 sees. "
        f"A sharded checkpoint needs a directory on a filesystem every node mounts (NFS, Lustre, "
        f"GPFS...): pass one as the checkpoint directory (the Trainer's: default_root_dir), and "
        f"copy the committed checkpoints elsewhere afterwards if needed. Nothing was committed; the "
        f"checkpoints saved before are untouched (rank(s) {ranks} left their files in "
        f"{redact_url(staging)} on their own hosts)."
    )


class _ShardedSave:
    """One sharded save, as every rank sees it: started on the training thread, finished there (a
    synchronous save) or on a writer thread (``dcp.async_save``)."""

    def __init__(
        self,
        storage: _LocalStorage,
        target: str,
        staging: str,
        manifest: Callable[[Mapping[str, dict[str, Any]]], Callable[[dict[str, Any]], bytes]],
        extras: dict[str, Any] | None,
        mode: int,
        guard: Callable[[], None] | None,
    ) -> None:
        self.storage = storage
        self.target = target
        self.staging = staging
        self.manifest = manifest  # the manifest builder, given every rank's files
        self.extras = extras  # what goes into state.pt (rank 0 only)
        self.mode = mode
        self.guard = guard

    def finish(self, written: Callable[[], None], group: Any) -> None:
        """Wait for this rank's shards (``written``), checksum them, and commit on rank 0.

        Collective over ``group``. Raises on every rank when any rank failed; rank 0's error names them.
        """
        files: dict[str, Any] | None = None
        own: BaseException | None = None
        try:
            written()
            files = _own_files(self.staging, self.mode)
        except BaseException as err:
            own = _this_ranks_failure(err)
        outcomes = _gather((files, None if own is None else _describe(own)), group)
        if runtime.get_rank() != 0:
            if own is not None:
                raise own
            return  # rank 0 commits and reports through the caller's handshake
        failed = {rank: message for rank, (_, message) in enumerate(outcomes) if message is not None}
        if failed:
            import shutil

            shutil.rmtree(self.staging, ignore_errors=True)
            if own is not None:
                raise own
            raise DistkitError(
                f"{_rank_label()} writing the shards of checkpoint {redact_url(self.target)} failed on "
                f"rank(s) {sorted(failed)}: "
                + "; ".join(f"rank {rank}: {message}" for rank, message in failed.items())
                + ". Nothing was committed; the checkpoints saved before are untouched."
            )
        every_file: dict[str, dict[str, Any]] = {}
        for rank_files, _ in outcomes:
            every_file.update(rank_files)
        _check_shards_here(self.staging, self.target, outcomes)
        if self.guard is not None:
            self.guard()
        assert self.extras is not None
        self.storage.commit_staged(
            self.target, self.staging, self.extras, self.manifest(every_file), self.mode
        )


def _prepare_sharded_save(
    storage: _Storage,
    target: str,
    state: Mapping[str, Any],
    *,
    step: int | None,
    metrics: Mapping[str, float] | None,
    file_mode: int,
    guard: Callable[[], None] | None,
    collect: Callable[[Mapping[str, Any]], dict[str, Any]],
    check: Callable[[Mapping[str, Any]], None],
    snapshot: Callable[[Any], Any] | None = None,
) -> tuple[_ShardedSave, dict[str, Any]]:
    """Every rank: collect the state, agree on a staging directory; return the save to finish and
    this rank's DCP state dicts (to hand to ``dcp.save`` or ``dcp.async_save``).

    ``collect`` turns the other entries into their state (collective: a ResumeState gathers RNG
    states), ``check`` refuses what a weights-only load could not read back (rank 0), and
    ``snapshot`` copies rank 0's ``state.pt`` payload to CPU memory (an asynchronous save).
    """
    if not isinstance(storage, _LocalStorage):
        raise ValueError(
            f"sharded checkpoints are written to a local directory (or a file:// URL), got "
            f"{redact_url(target)}: every rank writes its own shard files into it, so on several "
            f"nodes it must be a filesystem they all mount (NFS, Lustre, GPFS...). Save to such a "
            f"path and copy the committed checkpoint to the object store afterwards."
        )
    through_dcp, owners = _split_state(state)
    extras = collect({k: v for k, v in state.items() if k not in through_dcp})
    problem: BaseException | None = None
    dcp_state: dict[str, Any] = {}
    try:
        dcp_state = _dcp_state_dicts(state, through_dcp, owners)
        if runtime.get_rank() == 0:
            check(extras)
            if snapshot is not None:
                extras = snapshot(extras)
    except Exception as err:
        problem = err
    staging = _agree_on_staging(storage, target, guard, problem)
    info = {"engine": "torch.distributed.checkpoint", "keys": through_dcp, "optimizers": owners}

    def manifest(files: Mapping[str, dict[str, Any]]) -> Callable[[dict[str, Any]], bytes]:
        return _manifest_builder(step, metrics, list(state), sharded=info, shard_files=files)

    save = _ShardedSave(
        storage,
        os.path.abspath(target),
        staging,
        manifest,
        extras if runtime.get_rank() == 0 else None,
        file_mode,
        guard,
    )
    return save, dcp_state


@contextlib.contextmanager
def _single_process_quietly() -> Iterator[None]:
    """Without a process group DCP warns that it assumes a single process, which is what distkit
    means (a world of one): that warning is dropped, nothing else."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="torch.distributed is disabled, unavailable or uninitialized"
        )
        yield


def _writer(staging: str) -> Any:
    from torch.distributed.checkpoint import FileSystemWriter

    # sync_files: every shard is fsynced before its rank reports it written.
    return FileSystemWriter(staging, sync_files=True)


def _save_sharded(
    storage: _Storage,
    target: str,
    state: Mapping[str, Any],
    *,
    step: int | None,
    metrics: Mapping[str, float] | None,
    file_mode: int,
    guard: Callable[[], None] | None,
    collect: Callable[[Mapping[str, Any]], dict[str, Any]],
    check: Callable[[Mapping[str, Any]], None],
) -> None:
    """A synchronous sharded save (collective); rank 0 has committed when it returns there."""
    import torch.distributed.checkpoint as dcp

    save, dcp_state = _prepare_sharded_save(
        storage,
        target,
        state,
        step=step,
        metrics=metrics,
        file_mode=file_mode,
        guard=guard,
        collect=collect,
        check=check,
    )
    group = _group()

    def write() -> None:
        with _single_process_quietly():
            dcp.save(dcp_state, storage_writer=_writer(save.staging), process_group=group)

    save.finish(write, group)


def _start_async_sharded(
    storage: _Storage,
    target: str,
    state: Mapping[str, Any],
    *,
    step: int | None,
    metrics: Mapping[str, float] | None,
    file_mode: int,
    guard: Callable[[], None] | None,
    collect: Callable[[Mapping[str, Any]], dict[str, Any]],
    check: Callable[[Mapping[str, Any]], None],
    snapshot: Callable[[Any], Any],
    group: Any,
    on_done: Callable[[BaseException | None], None],
    name: str,
) -> threading.Thread:
    """Start a sharded save with ``dcp.async_save`` (collective): the shards are copied to CPU memory
    here, written by DCP's thread, then checksummed and committed by the returned (started) thread,
    which calls ``on_done`` with the outcome. ``group`` is a gloo group that only these threads use,
    since they run collectives while the training thread runs its own."""
    import torch.distributed.checkpoint as dcp

    save, dcp_state = _prepare_sharded_save(
        storage,
        target,
        state,
        step=step,
        metrics=metrics,
        file_mode=file_mode,
        guard=guard,
        collect=collect,
        check=check,
        snapshot=snapshot,
    )
    # A Future, or on newer torch an AsyncSaveResponse that holds the upload's Future.
    response: Any = dcp.async_save(dcp_state, storage_writer=_writer(save.staging), process_group=group)
    upload: Future[Any] = getattr(response, "upload_completion", response)

    def run() -> None:
        error: BaseException | None = None
        try:
            save.finish(upload.result, group)
        except BaseException as err:
            error = err
        on_done(error)

    thread = threading.Thread(target=run, name=name)
    thread.start()
    return thread
