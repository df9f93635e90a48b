"""Save into a directory until a real write fails, and report what the caller saw (one JSON line).

Usage: python failing_write.py DIRECTORY {disk-full,file-size-limit}

Saves step 1 (64 KiB of tensor data) with ``CheckpointManager(DIRECTORY, keep_last=1)``, then step 2
(8 MiB), which must fail:

- ``disk-full``: DIRECTORY is on a small filesystem (the test mounts a 2 MiB tmpfs in a private mount
  namespace), so the write fails with ENOSPC; then an async save of step 3 fails the same way and
  its error reaches ``wait()``;
- ``file-size-limit``: RLIMIT_FSIZE is lowered to 1 MiB after step 1, so the write fails with EFBIG
  (Python ignores SIGXFSZ, so the kernel returns the error instead of killing the process).

Everything runs in this process against the real filesystem; the parent asserts on the report:
the errors (type, errno, message), what the directory holds afterwards, and whether step 1 still
loads and verifies.
"""

from __future__ import annotations

import json
import os
import resource
import sys

import torch

import distkit


def describe(err: BaseException) -> dict[str, object]:
    cause = err.__cause__
    return {
        "type": type(err).__name__,
        "errno": getattr(err, "errno", None),
        "message": str(err),
        "cause": None if cause is None else f"{type(cause).__name__}: {cause}",
    }


def main() -> None:
    directory, mode = sys.argv[1], sys.argv[2]
    report: dict[str, object] = {}
    manager = distkit.CheckpointManager(directory, keep_last=1)
    manager.save(1, {"w": torch.full((16384,), 1.0)})
    big = {"w": torch.full((2 << 20,), 2.0)}  # 8 MiB
    if mode == "file-size-limit":
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))
    try:
        manager.save(2, big)
        report["sync"] = None
    except Exception as err:
        report["sync"] = describe(err)
    if mode == "file-size-limit":
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    else:
        background = distkit.CheckpointManager(directory, keep_last=1, async_save=True)
        manager.close()  # hand the directory over to the async manager
        background.claim(resuming=True)
        background.save(3, big)
        try:
            background.wait()
            report["async"] = None
        except Exception as err:
            report["async"] = describe(err)
        background.close()
    report["listing"] = sorted(os.listdir(directory))
    loaded = distkit.load_checkpoint(os.path.join(directory, "step_000000001"))
    report["step1_intact"] = bool(torch.equal(loaded["w"], torch.full((16384,), 1.0)))
    print("REPORT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
