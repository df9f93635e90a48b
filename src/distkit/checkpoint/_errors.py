"""The errors of distkit's checkpoints and the ``[rank R/W]`` prefix of their messages (private).

The three public errors are defined here, at the bottom of the checkpoint modules, because the
format, storage and lock modules raise them; :mod:`distkit.checkpoint` re-exports them, and users
import them from there (their ``__module__`` says so). A checkpoint path or URL appears in a
message, and in these errors' attributes, only through :func:`distkit._utils.secrets.redact_url`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from distkit._utils.secrets import redact_url
from distkit.errors import DistkitError

__all__ = ["CheckpointConflictError", "CheckpointCorruptError", "ForeignCheckpointError"]


class CheckpointCorruptError(DistkitError):
    """A checkpoint is incomplete or its files do not match their manifest.

    Attributes:
        path: The checkpoint directory (a URL without the credentials it may carry).
        reason: What is wrong, e.g. ``"state.pt is 10 bytes, the manifest says 2048"``.
    """

    # Public as distkit.checkpoint.CheckpointCorruptError: tracebacks and pickles say so.
    __module__ = "distkit.checkpoint"

    def __init__(self, path: str, reason: str) -> None:
        path = redact_url(path)
        super().__init__(
            f"checkpoint {path} is not usable: {reason}. Load an earlier checkpoint "
            f"(CheckpointManager.latest() skips such ones) or save this one again."
        )
        self.path = path
        self.reason = reason

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.path, self.reason)


class ForeignCheckpointError(DistkitError):
    """A path holds another tool's checkpoint, or files that are no checkpoint: not a distkit one.

    Raised where a distkit checkpoint is needed and the path is something else, instead of calling it
    damaged: an Accelerate ``save_state`` directory, a Lightning ``.ckpt`` file, a
    ``torch.distributed.checkpoint`` directory (torchtitan's ``step-N``) where only a distkit
    checkpoint will do (``consolidate``, ``inspect``), a :class:`CheckpointManager` directory that
    holds such checkpoints and no distkit one, or a :class:`CheckpointManager` directory given where
    one of its checkpoints is needed. The message says what the path looks like and the
    command that loads or converts it.

    Attributes:
        path: The path (a URL without the credentials it may carry).
        kind: What was recognized, for programs: ``"dcp"``, ``"accelerate"``, ``"lightning"``,
            ``"lightning-sharded"``, ``"hf-sharded"``, ``"manager"`` (a :class:`CheckpointManager`
            directory, whose ``step_<N>`` checkpoints are distkit's: pass one of them) or ``"unknown"``.
        layout: The same, in words, e.g. ``"an Accelerate save_state directory (model.safetensors,
            optimizer.bin)"``.
        fix: How to load or convert it.
        suggested: For a :class:`CheckpointManager` directory (``kind == "manager"``), the checkpoint
            to pass instead (its highest complete step's); ``None`` otherwise.

    Example:
        >>> try:  # doctest: +SKIP
        ...     distkit.load_checkpoint("runs/accelerate/checkpoint_3", state)
        ... except distkit.ForeignCheckpointError as err:
        ...     print(err.kind, err.fix)
    """

    # Public as distkit.checkpoint.ForeignCheckpointError: tracebacks and pickles say so.
    __module__ = "distkit.checkpoint"

    def __init__(
        self,
        path: str,
        kind: str,
        layout: str,
        fix: str,
        *,
        message: str | None = None,
        suggested: str | None = None,
    ) -> None:
        path = redact_url(path)
        said = fix if fix.startswith("distkit") else fix[:1].upper() + fix[1:]
        super().__init__(message or f"{path} is not a distkit checkpoint: it looks like {layout}. {said}.")
        self.path = path
        self.kind = kind
        self.layout = layout
        self.fix = fix
        self.suggested = suggested

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild_foreign, (self.path, self.kind, self.layout, self.fix, str(self), self.suggested)


def _rebuild_foreign(
    path: str, kind: str, layout: str, fix: str, message: str, suggested: str | None = None
) -> ForeignCheckpointError:
    return ForeignCheckpointError(path, kind, layout, fix, message=message, suggested=suggested)


class CheckpointConflictError(DistkitError):
    """Writing into a checkpoint directory was refused, so that no run destroys another.

    Raised on every rank by :meth:`CheckpointManager.claim` (and so by the first ``save()`` or
    ``restore()``) when another writer holds the directory's lock, or when the directory already
    holds committed checkpoints that this manager neither resumed from nor was told to overwrite;
    on object stores also by a ``save()`` after another writer took the directory over.

    Attributes:
        directory: The checkpoint directory (a URL without the credentials it may carry).
        reason: What conflicts, without the ``[rank R/W]`` prefix.
        holder: The other writer (``host``, ``pid``, ``since``, ``job``) when one was named, else
            ``None``.
        steps: The committed steps found in the directory (for a fresh run's refusal), else ``[]``.

    Example:
        >>> try:  # doctest: +SKIP
        ...     manager.save(0, state)
        ... except distkit.CheckpointConflictError as err:
        ...     print(err.directory, err.steps, err.holder)
    """

    # Public as distkit.checkpoint.CheckpointConflictError: tracebacks and pickles say so.
    __module__ = "distkit.checkpoint"

    def __init__(
        self,
        reason: str,
        *,
        directory: str,
        holder: Mapping[str, Any] | None = None,
        steps: list[int] | None = None,
        label: str = "",
    ) -> None:
        super().__init__(f"{label} {reason}" if label else reason)
        self.reason = reason
        self.directory = redact_url(directory)
        self.holder = None if holder is None else dict(holder)
        self.steps = list(steps or [])
        self._label = label

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild_conflict, (self.reason, self.directory, self.holder, self.steps, self._label)


def _rebuild_conflict(
    reason: str, directory: str, holder: dict[str, Any] | None, steps: list[int], label: str
) -> CheckpointConflictError:
    return CheckpointConflictError(reason, directory=directory, holder=holder, steps=steps, label=label)
