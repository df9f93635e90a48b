"""A checkpoint writer that stops at a chosen point of its last save, so a test can SIGKILL it there.

Usage: python killed_writer.py DIRECTORY {write,delete,exit} FIRST_STEP LAST_STEP [sync|async|async-sharded]

Saves steps FIRST..LAST with ``CheckpointManager(DIRECTORY, keep_last=2)``; the state of step ``s`` is
``{"w": torch.full((512, 512), s), "step": s}`` (1 MiB of tensor data, so state.pt is written in
several chunks). During the save of LAST it prints ``PAUSED in <thread>`` and sleeps at the chosen
point:

- ``write``: after the first chunk of tensor data went into state.pt (mid-save, before the commit);
  for a sharded save, once DCP has written the shard file into the staging directory;
- ``delete``: after the new checkpoint was committed and retention un-committed an old one, before
  that old one's files are deleted;
- ``exit``: no pause; the saves are asynchronous and the script returns right after the last
  ``save()`` without ``wait()``, so only interpreter exit waits for the writer.

With ``async`` the manager saves in the background (``async_save=True``), each save waited for before
the next one starts: the background save of LAST pauses on the writer thread, and ``RETURNED`` shows
that the training thread's ``save()`` had already returned. ``async-sharded`` does the same with
sharded checkpoints (``sharded=True``: ``torch.distributed.checkpoint``'s ``async_save`` writes the
shards, a world of one): the state of step ``s`` is ``{"model": <a module whose parameter w is
torch.full((512, 512), s)>, "step": s}``.

The pause is injected by wrapping distkit's own private steps (for a sharded save, the DCP writer that
distkit makes) in this process only; everything the test then inspects was done by the real code.
"""

from __future__ import annotations

import sys
import threading
import time

import torch
from torch import nn

import distkit.checkpoint as ckpt
import distkit.checkpoint._files as ckpt_files
import distkit.checkpoint._format as ckpt_format
import distkit.checkpoint._sharded as ckpt_sharded

# Longer than any test runs: the parent kills this process, it never wakes up.
_SLEEP_S = 600.0


def _pause() -> None:
    # The thread tells the test whether the pause came inside save() or on the writer thread.
    print(f"PAUSED in {threading.current_thread().name}", flush=True)
    time.sleep(_SLEEP_S)


class _Weights(nn.Module):
    def __init__(self, value: float) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.full((512, 512), value))


def main() -> None:
    directory, point, first, last = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    mode = sys.argv[5] if len(sys.argv) > 5 else "sync"
    if mode not in ("sync", "async", "async-sharded"):
        raise SystemExit(f"unknown mode {mode!r}; use 'sync', 'async' or 'async-sharded'")
    background, sharded = mode != "sync", mode == "async-sharded"
    armed = False
    if point == "write" and sharded:
        from torch.distributed.checkpoint import FileSystemWriter

        class PausingWriter(FileSystemWriter):
            def write_data(self, plan, planner):  # type: ignore[no-untyped-def]
                written = super().write_data(plan, planner)
                if armed:
                    written.wait()  # the shard file is in the staging directory
                    _pause()
                return written

        ckpt_sharded._writer = lambda staging: PausingWriter(staging, sync_files=True)
    elif point == "write":
        write = ckpt_format._ChecksumWriter.write

        def write_then_pause(self: ckpt_format._ChecksumWriter, data: object) -> int:
            n = write(self, data)
            if armed and n >= ckpt_format._PARALLEL_BYTES:
                _pause()
            return n

        ckpt_format._ChecksumWriter.write = write_then_pause  # type: ignore[method-assign]
    elif point == "delete":
        purge = ckpt_files._purge

        def pause_before_purge(path: str) -> None:
            if armed:
                _pause()
            purge(path)

        ckpt_files._purge = pause_before_purge
    elif point != "exit":
        raise SystemExit(f"unknown pause point {point!r}; use 'write', 'delete' or 'exit'")
    manager = ckpt.CheckpointManager(
        directory, keep_last=2, async_save=background or point == "exit", sharded=sharded
    )
    # A restarted writer continues its own run (a killed writer's lock died with it).
    manager.claim(resuming=True)
    for step in range(first, last + 1):
        if background:
            manager.wait()  # armed only once the previous save is over: only LAST's writer pauses
        armed = step == last
        if sharded:
            manager.save(step, {"model": _Weights(float(step)), "step": step})
        else:
            manager.save(step, {"w": torch.full((512, 512), float(step)), "step": step})
    print("RETURNED", flush=True)
    if background:
        manager.wait()


if __name__ == "__main__":
    main()
