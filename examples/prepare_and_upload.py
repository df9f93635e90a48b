"""The main process downloads, everyone reads; rank 0 uploads the results — without hangs.

The usual hand-written version (``if rank == 0: download(); dist.barrier()``) leaves every other
rank stuck in the barrier until the process group's timeout when the download fails. Here a
failure on the fetching rank is raised on every rank at once, and the file is fetched once per
node, checked against its SHA-256, and never seen half-written.

Run (CPU is fine):
    torchrun --standalone --nproc_per_node=2 examples/prepare_and_upload.py --workdir /tmp/dk-example
    torchrun --standalone --nproc_per_node=2 examples/prepare_and_upload.py --workdir /tmp/dk-example --http
    python examples/prepare_and_upload.py --workdir /tmp/dk-example       (a world of one)

Without ``--source`` the job first writes a small synthetic dataset, standing in for a file on a
server, and fetches it through a ``file://`` URL; ``--http`` serves it from a local HTTP server on
127.0.0.1 instead (one node only). ``--dest`` takes any fsspec URL (``s3://bucket/run``, ...).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import distkit


def make_source(directory: str) -> tuple[str, str]:
    """Write the synthetic dataset a real job would find on a server; return its path and SHA-256."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 8, generator=g)
    y = (x @ torch.randn(8, 1, generator=g) > 0).float()
    path = Path(directory) / "dataset.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"x": x, "y": y}, path)
    return str(path), hashlib.sha256(path.read_bytes()).hexdigest()


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


def serve(directory: str) -> str:
    """Serve ``directory`` over HTTP on 127.0.0.1 from a daemon thread; return the base URL."""
    handler = functools.partial(_QuietHandler, directory=directory)
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}"


def normalisation(cache: Path, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-feature mean and std, computed once by the main process and read by everyone."""
    stats_path = cache / "stats.pt"
    with distkit.main_process_first(timeout_s=600):
        if not stats_path.exists():
            tmp = stats_path.with_suffix(f".tmp{os.getpid()}")
            torch.save({"mean": x.mean(0), "std": x.std(0)}, tmp)
            os.replace(tmp, stats_path)
        return torch.load(stats_path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", required=True, help="where the cache, outputs and uploads go")
    parser.add_argument("--source", help="fsspec URL of a dataset.pt with tensors 'x' and 'y'")
    parser.add_argument("--http", action="store_true", help="serve the synthetic source over HTTP")
    parser.add_argument("--dest", help="fsspec URL for the results (default: <workdir>/uploaded)")
    args = parser.parse_args()

    env = distkit.init()
    work = Path(args.workdir).resolve()
    sha256 = None
    source = args.source
    if source is None:
        # The stand-in "server side" is prepared by the main process; every rank gets its answer.
        path, sha256 = distkit.run_on_main(make_source, str(work / "source"))
        source = f"file://{path}"
        if args.http:
            source = distkit.run_on_main(serve, str(work / "source")) + "/dataset.pt"

    # One fetch per node; the others wait, and a failure (404, checksum) is raised on all ranks.
    local = distkit.download(source, work / "cache" / "dataset.pt", sha256=sha256, timeout_s=600)
    data = torch.load(local)
    stats = normalisation(work / "cache", data["x"])
    x = (data["x"] - stats["mean"]) / stats["std"]

    dataset = TensorDataset(x, data["y"])
    sampler = DistributedSampler(dataset, num_replicas=env.world_size, rank=env.rank, seed=0)
    loader = DataLoader(dataset, batch_size=64, sampler=sampler)
    torch.manual_seed(0)
    model: nn.Module = nn.Linear(8, 1)
    if distkit.is_distributed():
        model = DDP(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    metrics: dict[str, float] = {}
    for epoch in range(3):
        sampler.set_epoch(epoch)
        loss_sum, correct, seen = 0.0, 0.0, 0
        for xb, yb in loader:
            logits = model(xb)
            loss = nn.functional.binary_cross_entropy_with_logits(logits, yb)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            loss_sum += loss.item() * len(xb)
            correct += ((logits > 0).float() == yb).sum().item()
            seen += len(xb)
        metrics = distkit.reduce_metrics({"loss": (loss_sum, seen), "accuracy": (correct, seen)})
        distkit.rank_zero_print(
            f"epoch {epoch}: loss={metrics['loss']:.4f} accuracy={metrics['accuracy']:.3f}"
        )

    # The main process writes the results; the upload runs on rank 0 only, and the other ranks
    # return at once (no barrier), so they are free to exit.
    out = work / "out"
    if distkit.is_main_process():
        out.mkdir(parents=True, exist_ok=True)
        (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
        state = model.module.state_dict() if isinstance(model, DDP) else model.state_dict()
        torch.save(state, out / "model.pt")
    dest = args.dest or str(work / "uploaded")
    handle = distkit.upload(out, dest, background=True)
    handle.wait(timeout_s=600)  # an upload error is raised here, on rank 0
    distkit.rank_zero_print(f"uploaded {out} to {handle.dest_url}")
    distkit.shutdown()


if __name__ == "__main__":
    main()
