"""A checkpoint writer that stops at a chosen point of its last save, so a test can SIGKILL it there.

Usage: python killed_writer.py DIRECTORY {write,delete,exit} FIRST_STEP LAST_STEP [sync|async]

Saves steps FIRST..LAST with ``CheckpointManager(DIRECTORY, keep_last=2)``; the state of step ``s`` is
``{"w": torch.full((512, 512), s), "step": s}`` (1 MiB of tensor data, so state.pt is written in
several chunks). During the save of LAST it prints ``PAUSED`` and sleeps at the chosen point:

- ``write``: after the first chunk of tensor data went into state.pt (mid-save, before the commit);
- ``delete``: after the new checkpoint was committed and retention un-committed an old one, before
  that old one's files are deleted;
- ``exit``: no pause; the saves are asynchronous and the script returns right after the last
  ``save()`` without ``wait()``, so only interpreter exit waits for the writer.

With ``async`` the manager saves in the background (``async_save=True``), each save waited for before
the next one starts: the background save of LAST pauses on the writer thread, and ``RETURNED`` shows
that the training thread's ``save()`` had already returned.

The pause is injected by wrapping distkit's own private steps in this process only; everything the
test then inspects was done by the real code.
"""

from __future__ import annotations

import sys
import time

import torch

import distkit.checkpoint as ckpt
import distkit.checkpoint._files as ckpt_files
import distkit.checkpoint._format as ckpt_format

# Longer than any test runs: the parent kills this process, it never wakes up.
_SLEEP_S = 600.0


def _pause() -> None:
    print("PAUSED", flush=True)
    time.sleep(_SLEEP_S)


def main() -> None:
    directory, point, first, last = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    background = (sys.argv[5] if len(sys.argv) > 5 else "sync") == "async"
    armed = False
    if point == "write":
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
    manager = ckpt.CheckpointManager(directory, keep_last=2, async_save=background or point == "exit")
    # A restarted writer continues its own run (a killed writer's lock died with it).
    manager.claim(resuming=True)
    for step in range(first, last + 1):
        if background:
            manager.wait()  # armed only once the previous save is over: only LAST's writer pauses
        armed = step == last
        manager.save(step, {"w": torch.full((512, 512), float(step)), "step": step})
    print("RETURNED", flush=True)
    if background:
        manager.wait()


if __name__ == "__main__":
    main()
