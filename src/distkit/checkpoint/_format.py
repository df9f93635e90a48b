"""What a checkpoint's files hold (private): the names, ``state.pt``'s serialization, the manifest.

``state.pt`` is one ``torch.save`` written through a sink that coalesces small writes and can
checksum on the way; ``manifest.json`` records its size and CRC32 and is built and parsed here,
field by field. A sharded checkpoint adds the files of torch's Distributed Checkpoint (``.metadata``
and one ``__<rank>_<n>.distcp`` per rank), all listed in the same manifest, whose ``format`` then
says ``distkit-sharded-checkpoint``. Where the files live and how they are opened is
:mod:`distkit.checkpoint._files`' concern.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeGuard, TypeVar

import torch

from distkit import runtime
from distkit._utils.fs import TEMP_MARKER
from distkit._utils.secrets import redact_url
from distkit.checkpoint._errors import CheckpointCorruptError
from distkit.errors import DistkitError

# The files of a checkpoint directory, and the names of the step directories a manager keeps.
_STATE_FILE = "state.pt"
_MANIFEST_FILE = "manifest.json"
_OWN_FILES = frozenset({_STATE_FILE, _MANIFEST_FILE})
_FORMAT = "distkit-checkpoint"
# A sharded checkpoint's format has its own name, so that a distkit without sharded checkpoints
# reports one as unreadable (skipped by latest(), kept by retention) instead of loading its state.pt
# alone, which holds everything but the sharded modules and optimizers.
_SHARDED_FORMAT = "distkit-sharded-checkpoint"
# The files torch.distributed.checkpoint's FileSystemWriter writes: the global metadata (through a
# temporary name), and each rank's data files.
_DCP_METADATA_FILE = ".metadata"
_DCP_FILE_RE = re.compile(r"^(\.metadata(\.tmp)?|__\d+_\d+\.distcp)$")
_FORMAT_VERSION = 1
_STEP_RE = re.compile(r"^step_(\d+)$")
# Leftovers of a local save or delete that was killed: temporary names made by distkit._utils.fs.temp_name.
_LEFTOVER_RE = re.compile(r"^\.step_(\d+)" + re.escape(TEMP_MARKER) + "-")
# Chunks smaller than this (zip headers, alignment padding, small tensors) are gathered into writes
# of about _COALESCE_BYTES; larger ones go straight through.
_PARALLEL_BYTES = 1 << 16
_COALESCE_BYTES = 1 << 20
# A manifest is about 1 KB (a few thousand metrics or keys stay far below this); a bigger file is not
# one, and reading it whole would only cost memory.
_MAX_MANIFEST_BYTES = 16 << 20

_T = TypeVar("_T")
_U = TypeVar("_U")


# --------------------------------------------------------------------------------------------------
# Serialization: torch.save into a sink that checksums on the way.


def _run_beside(background: Callable[[], _T], foreground: Callable[[], _U]) -> tuple[_T, _U]:
    """Run ``background`` on a helper thread while ``foreground`` runs here; return both results.

    Both callables release the GIL for their heavy part (zlib, file I/O), so on a machine with a free
    core they overlap. A plain thread rather than an executor: executors refuse new work once the
    interpreter starts to exit, which is exactly when an async save may still be writing. Where no
    thread can be started at all, the two simply run one after the other.
    """
    box: list[Any] = []

    def target() -> None:
        try:
            box.append((True, background()))
        except BaseException as err:
            box.append((False, err))

    helper = threading.Thread(target=target, name="distkit-checkpoint-helper", daemon=True)
    try:
        helper.start()
        started = True
    except RuntimeError:  # "can't create new thread at interpreter shutdown"
        target()
        started = False
    try:
        result = foreground()
    finally:
        if started:
            helper.join()
    ok, value = box[0]
    if not ok:
        raise value
    return value, result


class _ChecksumWriter:
    """The file object ``torch.save`` writes into: passes bytes on to ``write``.

    Small chunks (zip headers, alignment padding, small tensors) are gathered first to save system
    calls. With ``checksum=True`` (object stores, where there is no fsync to hide it behind) it
    keeps a CRC32, computing it for large chunks on a helper thread while they are written.

    A failed write is kept in ``error``: torch.save's C++ writer swallows the exception of a Python
    sink and reports only "unexpected pos ..." (a full disk would read as a torch bug), so
    :func:`_serialize` raises this one instead.
    """

    def __init__(self, write: Callable[[Any], Any], *, checksum: bool) -> None:
        self._write = write
        self._checksum = checksum
        self._pending = bytearray()
        self.crc = 0
        self.size = 0
        self.error: BaseException | None = None

    def _send(self, data: Any) -> None:
        try:
            self._write(data)
        except BaseException as err:
            self.error = err
            raise

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n = view.nbytes
        self.size += n
        if n < _PARALLEL_BYTES:
            self._pending += view
            if len(self._pending) >= _COALESCE_BYTES:
                self.flush()
            return n
        self.flush()
        if not self._checksum:
            self._send(view)
            return n
        # The view points into the tensor's memory, valid until this call returns: both finish here.
        crc = self.crc
        self.crc, _ = _run_beside(lambda: zlib.crc32(view, crc), lambda: self._send(view))
        return n

    def flush(self) -> None:
        if self._pending:
            if self._checksum:
                self.crc = zlib.crc32(self._pending, self.crc)
            self._send(self._pending)
            self._pending = bytearray()

    def close(self) -> None:
        self.flush()


# torch.save computes a CRC32 of every zip record for the zip headers, which torch.load never checks;
# the manifest's checksum covers the whole file, so that pass (120 ms of CPU for a 200 MB state
# here) is turned off while distkit writes. The setting is process-wide and read when a writer is
# created, so a torch.save that another thread starts meanwhile also writes zero CRCs (harmless to
# torch.load); a reference count keeps overlapping distkit saves from restoring it too early.
_crc_lock = threading.Lock()
_crc_users = 0
_crc_saved = True


@contextlib.contextmanager
def _without_torch_crc() -> Iterator[None]:
    global _crc_users, _crc_saved
    from torch.utils.serialization import config

    with _crc_lock:
        if _crc_users == 0:
            _crc_saved = config.save.compute_crc32
            config.save.compute_crc32 = False
        _crc_users += 1
    try:
        yield
    finally:
        with _crc_lock:
            _crc_users -= 1
            if _crc_users == 0:
                config.save.compute_crc32 = _crc_saved


def _serialize(payload: Mapping[str, Any], write: Callable[[Any], Any], *, checksum: bool) -> dict[str, Any]:
    sink = _ChecksumWriter(write, checksum=checksum)
    try:
        with _without_torch_crc():
            # torch annotates the file as a path or IO[bytes]; its docs ask only for write() and
            # flush(), which the sink has.
            torch.save(dict(payload), sink)  # type: ignore[arg-type]
        sink.close()
    except Exception:
        if sink.error is not None:
            # The real cause (ENOSPC, EFBIG, ...), not torch's "unexpected pos" that followed it.
            raise sink.error from None
        raise
    return {"size": sink.size, "crc32": f"{sink.crc:08x}"}


# --------------------------------------------------------------------------------------------------
# The manifest: written last by a save, checked field by field before a load trusts it.


def _is_own_file(name: str) -> bool:
    """Whether a file of that name in a checkpoint directory is one distkit (or DCP for it) writes."""
    return name in _OWN_FILES or _DCP_FILE_RE.match(name) is not None


def _foreign_files(names: set[str] | frozenset[str]) -> list[str]:
    return sorted(name for name in names if not _is_own_file(name))


def _manifest_builder(
    step: int | None,
    metrics: Mapping[str, float] | None,
    keys: list[str],
    *,
    sharded: Mapping[str, Any] | None = None,
    shard_files: Mapping[str, dict[str, Any]] | None = None,
    source: Mapping[str, str] | None = None,
    world_size: int | None = None,
) -> Callable[[dict[str, Any]], bytes]:
    """The manifest, once ``state.pt``'s size and CRC32 are known.

    A full checkpoint's manifest is exactly format 1 of ``distkit-checkpoint``; ``sharded`` (the
    entries written through DCP and which module each optimizer belongs to) and ``shard_files``
    (DCP's files, with their sizes and CRC32) make it a ``distkit-sharded-checkpoint``. ``source``
    (the optional field ``source``: ``{"tool": ..., "version": ...}``) marks a checkpoint that
    ``distkit checkpoint import`` converted from another tool's; readers that do not know the field
    ignore it, as format 1 allows. ``world_size`` is that of the job whose state this is: this
    job's unless given (a consolidated export keeps its source's).
    """
    from distkit._version import __version__

    def build(info: dict[str, Any]) -> bytes:
        manifest = {
            "format": _FORMAT if sharded is None else _SHARDED_FORMAT,
            "format_version": _FORMAT_VERSION,
            "step": step,
            "world_size": runtime.get_world_size() if world_size is None else world_size,
            "torch_version": torch.__version__,
            "distkit_version": __version__,
            "created_unix": time.time(),
            "keys": keys,
            "metrics": dict(metrics or {}),
            "files": {_STATE_FILE: info, **dict(shard_files or {})},
        }
        if sharded is not None:
            manifest["sharded"] = dict(sharded)
        if source is not None:
            manifest["source"] = dict(source)
        return json.dumps(manifest, indent=1).encode()

    return build


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_plain_name(name: Any) -> bool:
    # A file listed in a manifest sits in the checkpoint directory itself: no path, no "..".
    return isinstance(name, str) and name not in ("", ".", "..") and not any(c in name for c in "/\\\0")


def _is_file_entry(info: Any) -> bool:
    return (
        isinstance(info, dict)
        and _is_int(info.get("size"))
        and info["size"] >= 0
        and isinstance(info.get("crc32"), str)
        and re.fullmatch(r"[0-9a-f]{8}", info["crc32"]) is not None
    )


# Every field of a format-1 manifest: (name, required, check, what is expected). distkit reads the
# required ones; the others describe the checkpoint and are checked when present, since a value of
# the wrong type means the file is not what distkit wrote.
_MANIFEST_FIELDS: tuple[tuple[str, bool, Callable[[Any], bool], str], ...] = (
    ("step", True, lambda v: v is None or (_is_int(v) and v >= 0), "an integer >= 0 or null"),
    (
        "files",
        True,
        lambda v: (
            isinstance(v, dict)
            and _STATE_FILE in v
            and all(_is_plain_name(k) and _is_file_entry(i) for k, i in v.items())
        ),
        f'an object naming {_STATE_FILE} and other plain file names, each {{"size": <int >= 0>, '
        f'"crc32": <8 hex digits>}}',
    ),
    (
        "metrics",
        False,
        lambda v: isinstance(v, dict) and all(_is_number(x) for x in v.values()),
        "an object of numbers",
    ),
    (
        "keys",
        False,
        lambda v: isinstance(v, list) and all(isinstance(k, str) for k in v),
        "a list of strings",
    ),
    ("world_size", False, lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    ("torch_version", False, lambda v: isinstance(v, str), "a string"),
    ("distkit_version", False, lambda v: isinstance(v, str), "a string"),
    ("created_unix", False, _is_number, "a number"),
    (
        "source",
        False,
        lambda v: (
            isinstance(v, dict) and all(isinstance(k, str) and isinstance(x, str) for k, x in v.items())
        ),
        'an object of strings, e.g. {"tool": "lightning", "version": "2.4.0"}',
    ),
)


def _shown(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _parse_manifest(path: str, raw: bytes) -> dict[str, Any]:
    """The manifest in ``raw``, checked field by field; anything malformed is a CheckpointCorruptError."""

    def malformed(why: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(path, f"its {_MANIFEST_FILE} {why}")

    try:
        manifest = json.loads(raw)
    except (ValueError, RecursionError) as err:  # UnicodeDecodeError is a ValueError
        raise malformed(f"is not valid JSON ({err})") from err
    if not isinstance(manifest, dict):
        raise malformed(f"holds a JSON {type(manifest).__name__}, not an object")
    if manifest.get("format") not in (_FORMAT, _SHARDED_FORMAT):
        raise malformed(
            f"has format {_shown(manifest.get('format'))}, not {_FORMAT!r}: it is not a distkit manifest"
        )
    version = manifest.get("format_version")
    if not _is_int(version) or version < 1:
        raise malformed(f"has format_version {_shown(version)}; expected an integer >= 1")
    if version > _FORMAT_VERSION:
        from distkit._version import __version__

        raise DistkitError(
            f"checkpoint {redact_url(path)} has format_version {version} (its {_MANIFEST_FILE} says "
            f"so), but this distkit ({__version__}) reads format_version {_FORMAT_VERSION} only: it was "
            f"written by a newer distkit. Upgrade distkit (pip install -U distkit) to load it."
        )
    for name, required, check, expected in _MANIFEST_FIELDS:
        if name not in manifest:
            if required:
                raise malformed(f"has no {name!r} field")
            continue
        if not check(manifest[name]):
            raise malformed(f"has {name} {_shown(manifest[name])}; expected {expected}")
    if manifest["format"] == _SHARDED_FORMAT:
        _check_sharded_fields(manifest, malformed)
    return manifest


def _is_sharded_manifest(manifest: Mapping[str, Any]) -> bool:
    return manifest.get("format") == _SHARDED_FORMAT


def _imported_from(manifest: Mapping[str, Any]) -> str | None:
    """The tool a checkpoint was imported from (``distkit checkpoint import``), in words, else ``None``."""
    source = manifest.get("source")
    if not source:
        return None
    tool = source.get("tool", "another tool")
    version = f" {source['version']}" if source.get("version") else ""
    return f"{_TOOL_NAMES.get(tool, tool)}{version}"


_TOOL_NAMES = {"lightning": "Lightning", "accelerate": "Accelerate"}


def _check_sharded_fields(
    manifest: dict[str, Any], malformed: Callable[[str], CheckpointCorruptError]
) -> None:
    sharded = manifest.get("sharded")
    expected = 'an object {"keys": [<entry names>], "optimizers": {<optimizer entry>: <module entry>}}'
    if not (
        isinstance(sharded, dict)
        and isinstance(sharded.get("keys"), list)
        and all(isinstance(k, str) for k in sharded["keys"])
        and isinstance(sharded.get("optimizers"), dict)
        and all(isinstance(k, str) and v in sharded["keys"] for k, v in sharded["optimizers"].items())
    ):
        raise malformed(f"has sharded {_shown(sharded)}; expected {expected}")
    if _DCP_METADATA_FILE not in manifest["files"]:
        raise malformed(f"lists no {_DCP_METADATA_FILE} although the checkpoint is sharded")
