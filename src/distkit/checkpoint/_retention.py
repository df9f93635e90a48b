"""The step checkpoints of a manager's directory (private): finding them, verifying them, retention.

A :class:`CheckpointManager` keeps one :class:`_StepDirectory`: it lists the ``step_<N>`` checkpoints
and the leftovers of killed saves and deletes, picks the newest or best one that verifies, and after
each commit applies retention, never deleting what it cannot read or did not write.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from distkit._utils.secrets import redact_url
from distkit.checkpoint._errors import CheckpointCorruptError, ForeignCheckpointError
from distkit.checkpoint._files import _join, _read_manifest, _Storage, _verify
from distkit.checkpoint._foreign import _foreign_checkpoints
from distkit.checkpoint._format import (
    _LEFTOVER_RE,
    _MANIFEST_FILE,
    _STEP_RE,
    _foreign_files,
    _is_number,
    _is_own_file,
)
from distkit.errors import DistkitError
from distkit.runtime import _rank_label


@dataclass(frozen=True)
class _Entry:
    step: int
    path: str
    committed: bool  # a manifest exists; it may still fail verification
    leftover: bool  # a temporary name of a killed save or delete: provably distkit's, never committed
    files: frozenset[str]  # the names inside it

    @property
    def holds_only_own_files(self) -> bool:
        return all(_is_own_file(name) for name in self.files)


@dataclass
class _StepDirectory:
    """A manager's directory of step checkpoints."""

    storage: _Storage
    directory: str
    # Checkpoints retention keeps although it would delete them: warned about once each.
    kept_warned: set[str] = field(default_factory=set)
    # Checkpoints whose checksums failed when this manager read them (restore, latest) -> why:
    # retention checks sizes only, so a bit flip would pass it and count among the newest.
    corrupt: dict[str, str] = field(default_factory=dict)

    def entries(self) -> list[_Entry]:
        entries = []
        for name, files in self.storage.listing(self.directory).items():
            if match := _STEP_RE.match(name):
                committed, leftover = _MANIFEST_FILE in files, False
            elif match := _LEFTOVER_RE.match(name):
                committed, leftover = False, True
            else:
                continue
            entries.append(
                _Entry(
                    int(match.group(1)), _join(self.directory, name), committed, leftover, frozenset(files)
                )
            )
        return sorted(entries, key=lambda e: (e.step, e.committed), reverse=True)

    def foreign_only(self, *, label: bool = True) -> ForeignCheckpointError | None:
        """The error to raise when the directory holds no distkit checkpoint but other tools' ones
        (torchtitan's ``step-N``, Accelerate's ``checkpoint_N``, Lightning's ``*.ckpt``), else ``None``:
        a resume must not start over in silence where a run's checkpoints are (issue 28). An empty or
        missing directory is a fresh start and returns ``None``. Reads the directory once more."""
        found = _foreign_checkpoints(
            self.storage.listing(self.directory), self.storage.contents(self.directory) or set()
        )
        if not found:
            return None
        newest, layout = found[0]
        path = _join(self.directory, newest)
        names = ", ".join(name for name, _ in found[:5]) + (
            f", ... ({len(found)} in all)" if len(found) > 5 else ""
        )
        message = (
            f"{_rank_label() + ' ' if label else ''}the checkpoint directory "
            f"{redact_url(self.directory)} holds "
            f"no distkit checkpoint (step_<N> directories with a {_MANIFEST_FILE}) but {len(found)} of "
            f"another tool: {names}; the "
            f"newest, {newest}, looks like {layout.description}. A CheckpointManager (and "
            f"Trainer(resume='auto')) resumes only from its own checkpoints, so it did not start over in "
            f"silence here. To continue from {newest}: {layout.fix(path)}. A run started that way saves "
            f"its own step_<N> checkpoints, beside these."
        )
        return ForeignCheckpointError(
            path, layout.kind, layout.description, layout.fix(path), message=message
        )

    def first_that_verifies(
        self, candidates: list[_Entry], entries: list[_Entry], in_flight: int | None
    ) -> _Entry | None:
        for entry in candidates:
            try:
                manifest = _verify(self.storage, entry.path, checksums=True)
            except FileNotFoundError:
                continue  # deleted since the listing (retention of the writer): not damage
            except CheckpointCorruptError as err:
                self.corrupt[entry.path] = err.reason
                warnings.warn(
                    f"{_rank_label()} skipping corrupt checkpoint {redact_url(entry.path)}: {err.reason}.",
                    stacklevel=3,
                )
                continue
            if _mislabeled(entry, manifest) is not None:
                warnings.warn(_skipping_mislabeled(entry, manifest), stacklevel=3)
                continue
            self.warn_partials(entries, above=entry.step, in_flight=in_flight)
            return entry
        self.warn_partials(entries, above=-1, in_flight=in_flight)
        return None

    def warn_partials(self, entries: list[_Entry], *, above: int, in_flight: int | None) -> None:
        for entry in entries:
            if not entry.committed and entry.step > above and entry.step != in_flight:
                # Only what a distkit save leaves is "a save that did not finish" (issue 28).
                what = (
                    f"partial checkpoint {redact_url(entry.path)}: it has no {_MANIFEST_FILE} (a save that "
                    f"did not finish)"
                    if entry.leftover or entry.holds_only_own_files
                    else f"{redact_url(entry.path)}: it has no {_MANIFEST_FILE} and holds files distkit did "
                    f"not write ({self.foreign(entry)}), so it is not a distkit checkpoint"
                )
                warnings.warn(f"{_rank_label()} skipping {what}.", stacklevel=4)

    def ranked_by_metric(self, committed: list[_Entry], monitor: str, mode: str) -> list[_Entry]:
        scored = []
        for entry in committed:
            try:
                value = _read_manifest(self.storage, entry.path).get("metrics", {}).get(monitor)
            except (DistkitError, OSError):  # unreadable, newer format, or gone: not ranked
                continue
            if _is_number(value) and not math.isnan(value):
                scored.append((value if mode == "min" else -value, -entry.step, entry))
        return [entry for *_, entry in sorted(scored, key=lambda s: s[:2])]

    def apply_retention(
        self, just_saved: int, keep_last: int | None, keep_best: int | None, monitor: str | None, mode: str
    ) -> None:
        valid: list[_Entry] = []
        debris: list[_Entry] = []  # provably distkit's and incomplete: leftovers of killed saves and deletes
        for entry in self.entries():
            if entry.leftover:
                debris.append(entry)
            elif not entry.committed:
                # A step directory without a manifest: what a writer killed between its two puts
                # leaves on an object store. Removed when it holds nothing distkit did not write.
                if entry.holds_only_own_files:
                    debris.append(entry)
                else:
                    self.warn_kept(
                        entry,
                        f"it has no {_MANIFEST_FILE} and holds files distkit did not write "
                        f"({self.foreign(entry)})",
                    )
            elif entry.step == just_saved:
                valid.append(entry)  # committed a moment ago by this process
            elif entry.path in self.corrupt:
                # Neither counted among the newest (a resume skips it, so keeping it in their
                # place would leave fewer usable ones) nor deleted (it may still be repaired).
                self.warn_kept(entry, f"it cannot be read ({self.corrupt[entry.path]})")
            else:
                try:
                    manifest = _verify(self.storage, entry.path, checksums=False)
                except FileNotFoundError:
                    continue
                except (DistkitError, OSError) as err:
                    # Never delete what cannot be read: a malformed or newer manifest, a damaged,
                    # missing or special file. It may be the only copy of something.
                    reason = err.reason if isinstance(err, CheckpointCorruptError) else str(err)
                    self.warn_kept(entry, f"it cannot be read ({reason})")
                    continue
                if _mislabeled(entry, manifest) is not None:
                    # Not what its name says: neither counted among the newest (a resume skips it)
                    # nor deleted (it may be the only copy of the step it holds).
                    self.warn_kept(entry, _mislabeled_reason(entry, manifest))
                    continue
                valid.append(entry)
        keep = {just_saved}
        keep.update(e.step for e in (valid if keep_last is None else valid[:keep_last]))
        if keep_best is not None and monitor is not None:
            keep.update(e.step for e in self.ranked_by_metric(valid, monitor, mode)[:keep_best])
        # Surplus checkpoints first (the space retention is for), then the debris.
        for entry in [e for e in valid if e.step not in keep] + debris:
            try:
                self.delete_unless_foreign(entry, "it also holds")
            except OSError as err:
                warnings.warn(
                    f"{_rank_label()} retention could not delete {redact_url(entry.path)}: {err}. The new "
                    f"checkpoint is committed; delete the old one by hand to free the space.",
                    stacklevel=4,
                )

    def delete_unless_foreign(self, entry: _Entry, kept_because: str) -> bool:
        """Delete ``entry``; one that holds files distkit did not write is kept, with a warning.

        Args:
            entry: A checkpoint or leftover of this directory.
            kept_because: How the warning's reason starts: ``"it holds"`` or ``"it also holds"``.

        Returns:
            Whether this call deleted it (``False``: kept, or gone already).

        Raises:
            OSError: The deletion failed.
        """
        if not entry.leftover and not entry.holds_only_own_files:
            why = f"{kept_because} files distkit did not write ({self.foreign(entry)})"
            self.warn_kept(entry, why, stacklevel=6)  # one frame deeper than the callers' own
            return False
        try:
            self.storage.remove(entry.path)
        except FileNotFoundError:
            return False
        return True

    def delete_for_overwrite(self, entries: list[_Entry]) -> None:
        deleted: list[int] = []
        for entry in entries:
            try:
                if not self.delete_unless_foreign(entry, "it holds"):
                    continue
            except OSError as err:
                raise DistkitError(
                    f"{_rank_label()} overwrite=True could not delete {redact_url(entry.path)}: "
                    f"{type(err).__name__}: {err}. Nothing was saved; delete it by hand (or fix its "
                    f"permissions) and start again."
                ) from err
            if entry.committed:
                deleted.append(entry.step)
        if deleted:
            warnings.warn(
                f"{_rank_label()} overwrite=True: deleted the checkpoints of steps "
                f"{_shown_steps(sorted(deleted))} in {redact_url(self.directory)} before this run's first "
                f"save.",
                stacklevel=5,
            )

    @staticmethod
    def foreign(entry: _Entry) -> str:
        return ", ".join(_foreign_files(entry.files)[:5])

    def warn_kept(self, entry: _Entry, why: str, *, stacklevel: int = 5) -> None:
        # Once per checkpoint and manager: the same reason at every save would bury the log.
        if entry.path in self.kept_warned:
            return
        self.kept_warned.add(entry.path)
        warnings.warn(
            f"{_rank_label()} retention keeps {redact_url(entry.path)}: {why}. distkit never deletes what it "
            f"cannot read or did not write; look at it, and delete it by hand if it is not needed.",
            stacklevel=stacklevel,
        )


def _mislabeled(entry: _Entry, manifest: Mapping[str, Any]) -> int | None:
    """The step ``manifest`` names when it is not the one ``entry``'s directory is named for, else None.

    A manifest without a step (``save_checkpoint`` without ``step=``, written into a step directory
    by hand) names no other step: the directory's name stands, as it always has.
    """
    step = manifest.get("step")
    return step if step is not None and step != entry.step else None


def _mislabeled_reason(entry: _Entry, manifest: Mapping[str, Any]) -> str:
    return (
        f"its directory is named for step {entry.step} but its manifest says step {manifest['step']} "
        f"(copied or renamed by hand?)"
    )


def _skipping_mislabeled(entry: _Entry, manifest: Mapping[str, Any]) -> str:
    # Skipped, not refused (issue 23). Either way the worst outcome, a silent resume that pairs one
    # step's state with another step's name, cannot happen: nothing of this directory is loaded.
    # Refusing would stop every requeued job on this directory until a person intervenes (a crash
    # loop under a scheduler); skipping resumes from the newest checkpoint that is what its name
    # says, as for a corrupt one, and this warning names the directory, both steps and the fix. The
    # cost is redone steps, never wrong ones.
    step = manifest["step"]
    return (
        f"{_rank_label()} skipping checkpoint {redact_url(entry.path)}: "
        f"{_mislabeled_reason(entry, manifest)}. "
        f"Resuming from it would pair step {step}'s state with step {entry.step}'s position, so an older "
        f"checkpoint is used. Delete it, or rename it to step_{step:09d} if that name is free."
    )


def _shown_steps(steps: list[int]) -> str:
    if len(steps) <= 8:
        return str(steps)
    return f"[{', '.join(map(str, steps[:3]))}, ..., {', '.join(map(str, steps[-3:]))}] ({len(steps)} in all)"
