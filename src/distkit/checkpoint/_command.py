"""The ``distkit checkpoint`` command (private): list, inspect, consolidate and import checkpoints.

``distkit checkpoint list DIR`` shows the step checkpoints of a :class:`~distkit.CheckpointManager`
directory with their state (committed, partial, corrupt, leftover), ``distkit checkpoint inspect
PATH`` one checkpoint's manifest, ``distkit checkpoint consolidate SRC DST`` writes a sharded
checkpoint as one full checkpoint (:func:`distkit.consolidate_checkpoint`), and ``distkit
checkpoint import SRC DST`` converts a Lightning or Accelerate checkpoint
(:func:`distkit.import_checkpoint`). Called by :mod:`distkit.cli`, which parses the arguments
without importing torch.

The command never destroys a checkpoint (issue 23): ``consolidate`` and ``import`` write only to a
new or empty directory outside every checkpoint, and ``list`` and ``inspect`` of a missing path exit 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from distkit._utils.secrets import redact_url
from distkit.checkpoint._errors import CheckpointCorruptError
from distkit.checkpoint._files import _join, _missing_hint, _storage_for, _verify
from distkit.checkpoint._format import _MANIFEST_FILE, _imported_from, _is_sharded_manifest
from distkit.checkpoint._retention import _mislabeled, _StepDirectory
from distkit.errors import DistkitError


def _size_text(size: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"


def _summary(path: str, manifest: dict[str, Any]) -> dict[str, Any]:
    files = manifest["files"]
    sharded = manifest.get("sharded") if _is_sharded_manifest(manifest) else None
    return {
        "path": redact_url(path),
        "format": "sharded" if sharded is not None else "full",
        "step": manifest["step"],
        "world_size": manifest.get("world_size"),
        "torch_version": manifest.get("torch_version"),
        "distkit_version": manifest.get("distkit_version"),
        "created_unix": manifest.get("created_unix"),
        "keys": manifest.get("keys"),
        "sharded_keys": None if sharded is None else sharded["keys"],
        "metrics": manifest.get("metrics", {}),
        "imported_from": _imported_from(manifest),
        "files": files,
        "bytes": sum(info["size"] for info in files.values()),
    }


def _inspect(args: argparse.Namespace) -> int:
    storage, path = _storage_for(args.path)
    try:
        manifest = _verify(storage, path, checksums=args.verify)
    except CheckpointCorruptError as err:
        print(f"distkit checkpoint: {err}")
        return 1
    summary = _summary(path, manifest)
    summary["verified"] = "sizes and checksums" if args.verify else "sizes"
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    created = summary["created_unix"]
    print(f"checkpoint   {summary['path']}")
    print(f"format       {summary['format']} (saved by {summary['world_size']} rank(s))")
    print(f"step         {summary['step']}")
    if created is not None:
        print(f"created      {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(created))}")
    print(f"versions     torch {summary['torch_version']}, distkit {summary['distkit_version']}")
    print(f"entries      {', '.join(summary['keys'] or [])}")
    if summary["imported_from"] is not None:
        print(f"imported     from {summary['imported_from']} (distkit checkpoint import)")
    if summary["sharded_keys"] is not None:
        print(f"sharded      {', '.join(summary['sharded_keys'])} (through torch.distributed.checkpoint)")
    if summary["metrics"]:
        print("metrics      " + ", ".join(f"{k}={v:g}" for k, v in summary["metrics"].items()))
    size = _size_text(summary["bytes"])
    print(f"files        {len(summary['files'])}, {size} ({summary['verified']} verified)")
    for name, info in sorted(summary["files"].items()):
        print(f"  {name:<24} {_size_text(info['size']):>12}  crc32 {info['crc32']}")
    return 0


def _list(args: argparse.Namespace) -> int:
    storage, directory = _storage_for(args.directory)
    # A typo must not read as "no checkpoints": a script that checks the exit status would go on.
    kind = storage.kind(directory)
    if kind != "dir":
        what = "does not exist" if kind is None else "is a file, not a directory of checkpoints"
        print(
            f"distkit checkpoint: error: {redact_url(directory)} {what}. Pass the directory of a "
            f"CheckpointManager (the one that holds its step_<N> directories).{_missing_hint(directory)}",
            file=sys.stderr,
        )
        return 1
    if _MANIFEST_FILE in (storage.contents(directory) or set()):
        print(
            f"distkit checkpoint: error: {redact_url(directory)} is one checkpoint, not a directory "
            f"of them: `distkit checkpoint inspect {redact_url(directory)}` shows it.",
            file=sys.stderr,
        )
        return 1
    entries = _StepDirectory(storage, directory).entries()
    inner = _join(directory, "checkpoints")
    if not entries and storage.kind(inner) == "dir" and _StepDirectory(storage, inner).entries():
        # A Trainer run's default_root_dir: its checkpoints are in its checkpoints/ sub-directory.
        print(
            f"distkit checkpoint: {redact_url(directory)} is a Trainer run directory; listing its "
            f"checkpoints, in {redact_url(inner)}:",
            file=sys.stderr,
        )
        return _list(argparse.Namespace(**{**vars(args), "directory": inner}))
    rows = []
    for entry in entries:
        row: dict[str, Any] = {"step": entry.step, "path": redact_url(entry.path)}
        if entry.leftover:
            row["status"] = "leftover of a killed save or delete"
        elif not entry.committed and not entry.holds_only_own_files:
            # Not a save that did not finish: files distkit never writes (as inspect and latest() say).
            row["status"] = (
                f"not a distkit checkpoint: no manifest.json, and files distkit did not write "
                f"({_StepDirectory.foreign(entry)})"
            )
        elif not entry.committed:
            row["status"] = "partial (no manifest.json)"
        else:
            try:
                manifest = _verify(storage, entry.path, checksums=args.verify)
            except (DistkitError, OSError) as err:
                reason = err.reason if isinstance(err, CheckpointCorruptError) else str(err)
                row["status"] = f"unreadable: {reason}"
            else:
                summary = _summary(entry.path, manifest)
                row.update(
                    status="committed",
                    format=summary["format"],
                    world_size=summary["world_size"],
                    bytes=summary["bytes"],
                    metrics=summary["metrics"],
                )
                if (step := _mislabeled(entry, manifest)) is not None:
                    row["status"] = (
                        f"mislabeled: its manifest says step {step}; latest() and restore() skip it"
                    )
        rows.append(row)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        foreign = _StepDirectory(storage, directory).foreign_only(label=False)
        # Another tool's checkpoints are not "no checkpoints": say what they are and how to load them.
        print(f"no checkpoints in {redact_url(directory)}" if foreign is None else str(foreign))
        return 0
    for row in rows:
        if row["status"] != "committed":
            print(f"{row['step']:>10}  {row['status']}")
            continue
        metrics = ", ".join(f"{k}={v:g}" for k, v in row["metrics"].items())
        print(
            f"{row['step']:>10}  committed  {row['format']:<7} {row['world_size']} rank(s)  "
            f"{_size_text(row['bytes']):>10}  {metrics}".rstrip()
        )
    return 0


def _consolidate(args: argparse.Namespace) -> int:
    from distkit.checkpoint import consolidate_checkpoint

    dst = consolidate_checkpoint(args.src, args.dst)
    print(f"wrote {redact_url(dst)} (one full state.pt; torch.load(..., weights_only=True) reads it)")
    return 0


def _import(args: argparse.Namespace) -> int:
    from distkit.checkpoint import import_checkpoint

    print(import_checkpoint(args.src, args.dst, strip_prefix=args.strip_prefix, step=args.step))
    return 0


def run_checkpoint_command(args: argparse.Namespace) -> int:
    """Run ``distkit checkpoint <action>``; return the exit status."""
    actions = {"list": _list, "inspect": _inspect, "consolidate": _consolidate, "import": _import}
    return actions[args.action](args)
