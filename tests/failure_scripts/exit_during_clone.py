"""A process that exits while the hang doctor's second store connection is still being made.

Run by tests/test_failure_exit.py; prints nothing, exits with 3 (the script's own code) unless
the process aborts at exit. A store server runs in a child process, stopped (SIGSTOP) so that
distkit's ``_clone`` blocks in torch's C++ on a daemon thread, as the doctor's watchdog does on a
busy machine; a shell resumes it half a second after the script exits, while (without the exit's
wait) the interpreter is finalizing, which an object's ``__del__`` keeps doing for a second.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from distkit._doctor import doctor

SERVER = """
import os
import time
from datetime import timedelta
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
print(store.port, flush=True)
parent = os.getppid()
while os.getppid() == parent:  # ends with the script, however that ends
    time.sleep(0.1)
"""

server = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
assert server.stdout is not None
port = int(server.stdout.readline())
client = dist.TCPStore(
    "127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=60)
)
os.kill(server.pid, signal.SIGSTOP)


def watchdog() -> None:
    doctor._clone(client)


threading.Thread(target=watchdog, daemon=True).start()
while not any(t.name == "distkit-store-clone" for t in threading.enumerate()):
    time.sleep(0.01)
time.sleep(0.2)  # the connection is made and waits for the stopped server's answer


class SlowTeardown:
    def __del__(self, sleep=time.sleep) -> None:  # type: ignore[no-untyped-def]
        sleep(1.0)  # the interpreter is finalizing meanwhile


keep = SlowTeardown()
subprocess.Popen(["sh", "-c", f"sleep 0.5; kill -CONT {server.pid}"])
sys.exit(3)
