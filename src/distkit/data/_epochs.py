"""Epochs: which passes move to the next epoch, and the two cases no rank can settle alone."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from distkit import runtime
from distkit.errors import DistkitError

__all__: list[str] = []


# ---------------------------------------------------------------------------------------------
# Epochs: which passes move to the next epoch (docs/data.md, "Epochs")
#
# Every rank computes its share of an epoch from the epoch number alone, so the ranks must agree on
# it without talking: a pass run to its end moves to the next epoch, a pass left early does not (a
# look at a batch on one rank must not shift that rank's split). What no rank can settle alone is
# caught: a full extra pass on some ranks (_EpochCheck, through the store) and a loop that stops
# every epoch early on every rank (_Passes.begin). Both use the process groups' collective counters
# to tell passes the ranks made together from rank-local ones; all of it is per pass, not per batch.


# distkit's collectives that go through the store, not a group: counted by the runtime.
_STORE_COLLECTIVES = ("barrier", "main_process_first", "checkpoint")


def _collectives_so_far(*, every_group: bool) -> int | None:
    """Collectives this process has issued on the default group and distkit's own (its gloo group,
    and its barriers, main-first sections and checkpoint saves, which go through the store), or on
    every group it belongs to and distkit's own.

    ``None`` without a process group, or where the backend does not count them (gloo and NCCL do).
    Without ``every_group`` the count is the same on every rank at the same point of a program,
    since every rank issues the same collectives on those (a loop whose only exchange is
    ``distkit.reduce_metrics`` or ``distkit.barrier`` counts too).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    state = runtime._current()
    try:
        if every_group:
            groups = list(dist.distributed_c10d._world.pg_map)
        else:
            groups = [dist.distributed_c10d._get_default_group()]
            if state is not None and state.cpu_group is not None:
                groups.append(state.cpu_group)
        # torch's stub of ProcessGroup lacks this getter; the binding has it.
        counts = [int(group._get_sequence_number_for_group()) for group in groups]  # type: ignore[attr-defined]
    except Exception:  # a private torch API on a backend that may lack it: then we cannot tell
        return None
    store_based = 0 if state is None else sum(state.counters.get(kind, 0) for kind in _STORE_COLLECTIVES)
    return sum(counts) + store_based


def _rank_prefix(rank: int, world_size: int) -> str:
    return f"[rank {rank}/{world_size}] " if world_size > 1 else ""


class _EpochCheck:
    """Tells the ranks apart when a full extra pass on some of them put them in different epochs.

    At the start of each pass a rank writes ``"<collectives so far>,<epoch>"`` under its key
    in the job's store; at the end of a pass during which collectives ran, it reads its two
    neighbours' keys (ranks r-1 and r+1). Passes that started after the same collective and then
    ran collectives together are the same step of the same program, so they must have the same
    epoch. A rank still in a collective-free pass may lag a whole epoch legitimately, which is why
    a pass without collectives checks nothing. One store write when a pass starts, one check and one
    read when it ends, never a wait: every key exists from the loader's construction (written
    before its collective gather).
    """

    def __init__(self, store: Any, prefix: str, rank: int, world_size: int, what: str) -> None:
        self.store: Any = store
        self.key = f"{prefix}/{rank}"
        self.neighbours = sorted({(rank - 1) % world_size, (rank + 1) % world_size} - {rank})
        self.neighbour_keys = [f"{prefix}/{other}" for other in self.neighbours]
        self.rank, self.world_size, self.what = rank, world_size, what
        self.start_count = -1

    def __getstate__(self) -> dict[str, Any]:
        # A store cannot be pickled or deep-copied; a copied sampler or loader just goes unchecked.
        return {**self.__dict__, "store": None}

    @classmethod
    def create(cls, what: str, shuffle: bool) -> _EpochCheck | None:
        """Before the construction gather, on every rank; ``None`` where there is nothing to check.

        Without shuffling every epoch splits the data alike, so ranks in different epochs still
        see disjoint, covering shares: only shuffled splits are checked.
        """
        world_size = runtime.get_world_size()
        if world_size == 1 or not (dist.is_available() and dist.is_initialized()):
            return None
        store = runtime._store()
        state = runtime._current()
        if state is None:
            return None
        # Taken on every rank whatever the options, so that ranks agree on the ids that follow.
        ident = state.next_id("data_epochs")
        if not shuffle or store is None or _collectives_so_far(every_group=False) is None:
            return None
        check = cls(store, f"data/epochs/{ident}", runtime.get_rank(), world_size, what)
        try:
            store.set(check.key, "-1,-1")  # before the gather, so every key exists after it
        except RuntimeError:
            return None
        return check

    def started(self, epoch: int) -> None:
        count = _collectives_so_far(every_group=False)
        if count is None or self.store is None:
            self.store = None
            return
        self.start_count = count
        try:
            self.store.set(self.key, f"{count},{epoch}")
        except RuntimeError:  # a store that stopped answering; the check is a safety net, not a need
            self.store = None

    def finished(self, epoch: int) -> None:
        count = _collectives_so_far(every_group=False)
        if self.store is None or count is None or count == self.start_count:
            return
        if "nccl" in str(dist.get_backend()).lower():
            # NCCL counts a collective when this host enqueues it, which may be long before the
            # other ranks reach it; once it has run on the device, every rank has issued it, so each
            # neighbour's latest pass is the one that ran alongside this one.
            torch.cuda.synchronize()
        try:
            if not self.store.check(self.neighbour_keys):
                return
            values = self.store.multi_get(self.neighbour_keys)
        except RuntimeError:
            self.store = None
            return
        for other, value in zip(self.neighbours, values, strict=True):
            other_count, other_epoch = (int(part) for part in bytes(value).decode().split(","))
            if other_count == self.start_count and other_epoch != epoch:
                raise DistkitError(
                    f"{_rank_prefix(self.rank, self.world_size)}{self.what}: this rank just ran epoch "
                    f"{epoch} while rank {other} ran epoch {other_epoch} alongside it (both passes "
                    f"started after the same collective), so their shares of the data overlap: some "
                    f"samples are seen twice in an epoch and others never. A pass run to its end moves "
                    f"a rank to the next epoch, so a full pass made on some ranks only (inspecting or "
                    f"evaluating on the training data) put them an epoch ahead. Call set_epoch(epoch) "
                    f"on every rank right before each epoch's loop, which realigns the ranks whatever "
                    f"passes ran before, or leave extra passes early (break)."
                )


class _Passes:
    """Per-pass bookkeeping of a loader or sampler: which pass is running, and whether passes left
    early keep restarting the same epoch (a loop that stops every epoch after a few steps)."""

    def __init__(self, what: str, rank: int, world_size: int, *, training: bool) -> None:
        self.what, self.rank, self.world_size, self.training = what, rank, world_size, training
        self.check: _EpochCheck | None = None
        # Whether a started pass has not ended yet (run to its end, left, or superseded).
        self.live = False
        # Collectives on every group when the live pass started: did the ranks make it together?
        self.count_at_start: int | None = None
        # Passes in a row, from the same position, left early while the ranks communicated.
        self.early = 0

    def begin(self, epoch: int, fix: str) -> None:
        """A pass starts at ``epoch``; raises if it would repeat two passes left early before it."""
        if self.early >= 2:
            together = " while the ranks communicated" if self.world_size > 1 else ""
            raise DistkitError(
                f"{_rank_prefix(self.rank, self.world_size)}{self.what}: the last {self.early} passes "
                f"over epoch {epoch} were left early{together} (a loop that stops every epoch after "
                f"some steps), and a pass left early does not move to the next epoch (so that a look "
                f"at a batch on one rank cannot shift that rank's share of the data): this pass would "
                f"hand out the same samples again. {fix}"
            )
        self.count_at_start = _collectives_so_far(every_group=True)
        if self.check is not None:
            self.check.started(epoch)
        self.live = True

    def end_full(self, epoch: int) -> None:
        """The live pass ran to its end at ``epoch``; raises if the ranks turn out to be misaligned."""
        self.live = False
        self.early = 0
        if self.check is not None:
            self.check.finished(epoch)

    def end_early(self, *, more_than_one_batch: bool) -> bool:
        """The live pass ended before its end; returns whether the ranks made it together.

        With several ranks, a pass during which this rank issued no collective was made by this rank
        alone (a look at a batch, a debugging pass); in a world of one every pass is the job's.
        """
        self.live = False
        if self.world_size == 1:
            shared = True
        else:
            now = _collectives_so_far(every_group=True)
            shared = now is None or self.count_at_start is None or now != self.count_at_start
        if shared and more_than_one_batch and self.training:
            self.early += 1
        return shared

    def reset(self) -> None:
        """``set_epoch`` or ``load_state_dict``: the epoch is the caller's, nothing repeats."""
        self.live = False
        self.early = 0
