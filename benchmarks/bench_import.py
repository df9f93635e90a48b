"""`import distkit` against `import torch` alone: median wall time of fresh interpreters.

Run by hand:  .venv/bin/python benchmarks/bench_import.py [--runs 15]

The two imports alternate run by run so that drifts in machine speed hit both alike.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time


def _time(statement: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", statement], check=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    _time("import distkit")  # warm the file cache
    torch_s, distkit_s = [], []
    for _ in range(args.runs):
        torch_s.append(_time("import torch"))
        distkit_s.append(_time("import distkit"))
    t, d = statistics.median(torch_s), statistics.median(distkit_s)
    print(f"import torch   {t * 1e3:8.1f} ms (median of {args.runs})")
    print(f"import distkit {d * 1e3:8.1f} ms (median of {args.runs}; includes torch)")
    print(f"distkit / torch: {d / t:.3f}x  (distkit's own share: {(d - t) * 1e3:+.1f} ms)")


if __name__ == "__main__":
    main()
