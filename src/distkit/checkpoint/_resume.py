"""Resume state: the training loop's position and every rank's RNG streams (private; public as
:class:`distkit.checkpoint.ResumeState`)."""

from __future__ import annotations

import hashlib
import random
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from distkit import runtime
from distkit.collectives import all_gather_object
from distkit.runtime import _rank_label
from distkit.seeding import capture_rng_state, restore_rng_state


@dataclass
class ResumeState:
    """Where the training loop is, plus every rank's RNG streams, for an exact resume.

    Put it in the state you save, update its fields as the loop runs, and a load puts back the
    position and, on each rank, that rank's own python, numpy, torch CPU and CUDA generators.

    A different world size on load (say 4 ranks saved, 2 resume): the position and everything else
    are restored, but per-rank RNG streams cannot be mapped one to one, so each rank is **reseeded
    deterministically** from the saved states, its rank and the new world size, with a warning.
    The same checkpoint and world size always give the same streams.

    Attributes:
        epoch: Current epoch (0-based).
        global_step: Optimizer steps taken so far.
        batches_in_epoch: Batches already consumed in the current epoch.

    Example:
        >>> import distkit
        >>> from distkit.checkpoint import ResumeState
        >>> progress = ResumeState()
        >>> progress.global_step += 1
        >>> _ = distkit.save_checkpoint("/tmp/ckpt_example", {"progress": progress})
    """

    epoch: int = 0
    global_step: int = 0
    batches_in_epoch: int = 0

    def state_dict(self) -> dict[str, Any]:
        """The position and every rank's RNG states (tensors and lists only).

        Collective: call on every rank (it gathers the RNG states); without a process group it
        captures this process's.

        Example:
            >>> sorted(ResumeState(global_step=3).state_dict())
            ['batches_in_epoch', 'epoch', 'global_step', 'rng', 'world_size']
        """
        return {
            "epoch": int(self.epoch),
            "global_step": int(self.global_step),
            "batches_in_epoch": int(self.batches_in_epoch),
            "world_size": runtime.get_world_size(),
            "rng": all_gather_object(capture_rng_state()),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the position, and this rank's RNG streams (reseeded if the world size changed).

        Local: no communication.

        Example:
            >>> progress = ResumeState()
            >>> progress.load_state_dict(ResumeState(epoch=2).state_dict())
            >>> progress.epoch
            2
        """
        self.epoch = int(state["epoch"])
        self.global_step = int(state["global_step"])
        self.batches_in_epoch = int(state["batches_in_epoch"])
        saved = [_tree_to_cpu(s) for s in state["rng"]]
        rank, world_size = runtime.get_rank(), runtime.get_world_size()
        if int(state["world_size"]) == world_size and len(saved) == world_size:
            restore_rng_state(saved[rank])
            return
        seed = _reseed(saved, rank, world_size)
        warnings.warn(
            f"{_rank_label()} the checkpoint's RNG states were saved by {state['world_size']} rank(s) and "
            f"this job has {world_size}: per-rank streams cannot be restored one to one, so this rank "
            f"was reseeded deterministically from them (seed {seed}). The loop position, model and "
            f"optimizer are restored as saved.",
            stacklevel=2,
        )


# Public as distkit.checkpoint.ResumeState: tracebacks and reprs say so.
ResumeState.__module__ = "distkit.checkpoint"


def _tree_to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, dict):
        return {k: _tree_to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_tree_to_cpu(v) for v in obj]
    return obj


def _reseed(saved: list[dict[str, Any]], rank: int, world_size: int) -> int:
    # Derived from the saved torch CPU state of rank 0 (so it differs between checkpoints) and from
    # the new rank and world size (so ranks get different streams), never from the clock.
    digest = hashlib.sha256(bytes(saved[0]["torch"].tolist()))
    digest.update(f"{rank}/{world_size}".encode())
    seed = int.from_bytes(digest.digest()[:8], "little") & ((1 << 63) - 1)
    random.seed(seed)
    try:
        import numpy as np
    except ImportError:
        np = None  # type: ignore[assignment]
    if np is not None:
        np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)  # also every CUDA device
    return seed
