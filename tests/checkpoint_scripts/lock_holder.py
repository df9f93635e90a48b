"""Claim a checkpoint directory and hold it until killed, so a test can see a second writer refused
and a SIGKILLed holder's lock taken over.

Usage: python lock_holder.py DIRECTORY

Prints ``HELD <pid>`` once ``CheckpointManager(DIRECTORY).claim()`` returned, then sleeps.
"""

from __future__ import annotations

import os
import sys
import time

import distkit

# Longer than any test runs: the parent kills this process, it never wakes up.
_SLEEP_S = 600.0


def main() -> None:
    manager = distkit.CheckpointManager(sys.argv[1])
    manager.claim()
    print(f"HELD {os.getpid()}", flush=True)
    time.sleep(_SLEEP_S)


if __name__ == "__main__":
    main()
