"""download and upload against real storage: local files, memory://, HTTP and S3 servers on 127.0.0.1."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, ClassVar

import filelock
import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

import distkit
import storage_servers
from _launch import job_env, torchrun
from distkit import storage
from distkit._utils import secrets as _secrets
from distkit.storage import _transfer, _upload
from distkit.testing import RankFailedError
from storage_servers import FileServer, S3Endpoint, Stall

# The servers' fixtures, made visible to this module's tests.
http_server = storage_servers.http_server
s3 = storage_servers.s3

ROOT = Path(__file__).resolve().parents[1]
PAYLOAD = hashlib.sha256(b"seed").digest() * 32768  # 1 MiB, incompressible enough
DIGEST = hashlib.sha256(PAYLOAD).hexdigest()
SECRET = "S3CR3T-d0-not-leak-7f3a"
SHORT_SECRET = "q7Z"  # a 3-character password: too short to replace wherever it occurs
MANIFEST = "_DISTKIT_MANIFEST.json"
INCOMPLETE = "_DISTKIT_INCOMPLETE"
# Calls made in this process (not through `ranks`) run as a world of one (conftest.py).
pytestmark = pytest.mark.usefixtures("world_of_one")


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _make_tree(root: Path) -> dict[str, bytes]:
    files = {"a.txt": b"alpha\n", "sub/b.bin": bytes(range(256)) * 10, "sub/deeper/c.txt": b""}
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return files


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if ".distkit-tmp" in p.name)


def _uploaded(tree: dict[str, bytes]) -> dict[str, bytes]:
    """``tree`` (an upload's destination) less its manifest, which must describe exactly the rest."""
    files = dict(tree)
    manifest = json.loads(files.pop(MANIFEST))
    assert (manifest["format"], manifest["version"]) == ("distkit-upload", 1)
    assert INCOMPLETE not in files
    promised = {rel: (entry["size"], entry["sha256"]) for rel, entry in manifest["files"].items()}
    assert promised == {rel: (len(data), hashlib.sha256(data).hexdigest()) for rel, data in files.items()}
    return files


def _memory_tree(root: str) -> dict[str, bytes]:
    memory = fsspec.filesystem("memory")
    return {p[len(root) + 1 :]: memory.cat_file(p) for p in memory.find(root)}  # cat would glob


def _bucket_tree(bucket: Any, root: str) -> dict[str, bytes]:
    return {p[len(root) + 1 :]: bucket.cat_file(p) for p in bucket.find(root)}


# -- download: sources ------------------------------------------------------------------------------


def test_http_download_is_verified_and_not_fetched_again(http_server: FileServer, tmp_path: Path) -> None:
    http_server.files["/data.bin"] = PAYLOAD
    dest = tmp_path / "cache" / "data.bin"  # the directory is created
    assert distkit.download(http_server.url("/data.bin"), dest, sha256=DIGEST.upper()) == dest
    assert dest.read_bytes() == PAYLOAD
    requests = list(http_server.requests)
    assert http_server.gets["/data.bin"] == 1
    assert distkit.download(http_server.url("/data.bin"), str(dest), sha256=DIGEST) == dest
    assert http_server.requests == requests  # an existing, verified dest costs no request at all
    assert _leftovers(dest.parent) == []


def test_existing_dest_that_fails_its_checksum_is_fetched_again(
    http_server: FileServer, tmp_path: Path
) -> None:
    http_server.files["/data.bin"] = PAYLOAD
    dest = tmp_path / "data.bin"
    dest.write_bytes(b"stale")
    distkit.download(http_server.url("/data.bin"), dest, sha256=DIGEST)
    assert dest.read_bytes() == PAYLOAD and http_server.gets["/data.bin"] == 1


def test_directories_download_from_file_urls_memory_and_s3(tmp_path: Path, s3: S3Endpoint) -> None:
    files = _make_tree(tmp_path / "src")
    assert _tree(distkit.download(f"file://{tmp_path / 'src'}", tmp_path / "from-file")) == files

    memory = fsspec.filesystem("memory")
    for rel, data in files.items():
        memory.pipe(f"/dk-download/tree/{rel}", data)
    assert _tree(distkit.download("memory://dk-download/tree", tmp_path / "from-memory")) == files

    bucket = s3.bucket("dk-download")
    for rel, data in files.items():
        bucket.pipe(f"dk-download/tree/{rel}", data)
    bucket.pipe("dk-download/data.bin", PAYLOAD)
    got = distkit.download("s3://dk-download/tree", tmp_path / "from-s3", storage_options=s3.options())
    assert _tree(got) == {rel: data for rel, data in files.items()}
    one = distkit.download(
        "s3://dk-download/data.bin", tmp_path / "one.bin", sha256=DIGEST, storage_options=s3.options()
    )
    assert one.read_bytes() == PAYLOAD
    assert _leftovers(tmp_path) == []


def test_bad_checksums_are_rejected_and_leave_nothing(tmp_path: Path) -> None:
    (tmp_path / "src.bin").write_bytes(PAYLOAD)
    with pytest.raises(storage.ChecksumMismatchError) as info:
        distkit.download(tmp_path / "src.bin", tmp_path / "dest.bin", sha256="f" * 64)
    assert (info.value.expected, info.value.actual) == ("f" * 64, DIGEST)
    copy = pickle.loads(pickle.dumps(info.value))  # e.g. sent back by a multiprocessing pool
    assert (str(copy), copy.actual) == (str(info.value), DIGEST)
    assert not (tmp_path / "dest.bin").exists()
    _make_tree(tmp_path / "src")
    with pytest.raises(ValueError, match="sha256 checks a single file"):
        distkit.download(tmp_path / "src", tmp_path / "copy", sha256=DIGEST)
    assert not (tmp_path / "copy").exists() and _leftovers(tmp_path) == []
    with pytest.raises(ValueError, match="64 hexadecimal digits"):
        distkit.download(tmp_path / "src", tmp_path / "copy", sha256="abc")


# -- download: coordination -----------------------------------------------------------------------


def fetch_in_job(url: str, dest: str, markers: str) -> str:
    # Say "this job's fetching rank has arrived"; the server holds its one GET until both jobs did.
    Path(markers, f"{os.environ['TEST_JOB']}-{distkit.get_rank()}").touch()
    path = distkit.download(url, dest, sha256=DIGEST, timeout_s=60)
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_two_jobs_downloading_the_same_url_at_once_fetch_it_once(
    ranks, http_server: FileServer, tmp_path: Path
) -> None:
    markers = tmp_path / "markers"
    markers.mkdir()
    http_server.files["/shared.bin"] = PAYLOAD
    http_server.stalls["/shared.bin"] = Stall(
        after_bytes=len(PAYLOAD) // 2,
        release=lambda: (markers / "a-0").exists() and (markers / "b-0").exists(),
    )
    dest = str(tmp_path / "cache" / "shared.bin")
    results: dict[str, Any] = {}

    def job(name: str) -> None:
        try:
            results[name] = ranks.run(
                fetch_in_job,
                http_server.url("/shared.bin"),
                dest,
                str(markers),
                world_size=2,
                fresh=True,
                env={"TEST_JOB": name},
                timeout_s=120,
            )
        except BaseException as err:
            results[name] = err

    threads = [threading.Thread(target=job, args=(name,)) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=180)
    assert results == {"a": [DIGEST, DIGEST], "b": [DIGEST, DIGEST]}
    # The one GET was held until both jobs had called download(): the two ran at once.
    assert http_server.stalls["/shared.bin"].released.is_set()
    assert http_server.gets["/shared.bin"] == 1
    assert _leftovers(tmp_path / "cache") == []


def download_and_die(url: str, dest: str) -> None:
    target = Path(dest)
    prefix = f".{target.name}.distkit-tmp-"

    def kill_when_half_written() -> None:
        while True:
            for entry in os.scandir(target.parent):
                if entry.name.startswith(prefix) and entry.stat().st_size > 0:
                    os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(0.01)

    threading.Thread(target=kill_when_half_written, daemon=True).start()
    distkit.download(url, dest, timeout_s=60)


def test_download_killed_halfway_leaves_nothing_at_dest_and_the_next_call_succeeds(
    ranks, http_server: FileServer, tmp_path: Path
) -> None:
    http_server.files["/big.bin"] = PAYLOAD
    http_server.stalls["/big.bin"] = Stall(after_bytes=len(PAYLOAD) // 2, release=lambda: False)
    dest = tmp_path / "big.bin"
    with pytest.raises(RankFailedError) as info:
        ranks.run(download_and_die, http_server.url("/big.bin"), str(dest), world_size=1, fresh=True)
    assert info.value.failures[0].exitcode == -signal.SIGKILL
    assert not dest.exists()
    (partial,) = _leftovers(tmp_path)
    assert 0 < (tmp_path / partial).stat().st_size < len(PAYLOAD)

    del http_server.stalls["/big.bin"]
    distkit.download(http_server.url("/big.bin"), dest, sha256=DIGEST, timeout_s=60)
    assert dest.read_bytes() == PAYLOAD
    assert _leftovers(tmp_path) == []  # the killed fetch's temporary file was removed
    assert http_server.gets["/big.bin"] == 2


def download_with_wrong_checksum(url: str, dest: str) -> str:
    try:
        distkit.download(url, dest, sha256="0" * 64, timeout_s=60)
    except storage.ChecksumMismatchError as err:
        return f"own {err.expected[:4]} {err.actual} {err}"
    except distkit.MainProcessError as err:
        return f"waited {err.exc_type}"
    return "no error"


def test_checksum_mismatch_raises_on_every_rank_and_leaves_nothing(
    ranks, http_server: FileServer, tmp_path: Path
) -> None:
    http_server.files["/data.bin"] = PAYLOAD
    dest = tmp_path / "data.bin"
    main, other = ranks.run(
        download_with_wrong_checksum, http_server.url("/data.bin"), str(dest), world_size=2
    )
    assert main.startswith(f"own 0000 {DIGEST} [rank 0/2] the sha256 of {http_server.url('/data.bin')} is")
    assert other == "waited distkit.storage.ChecksumMismatchError"
    assert not dest.exists() and _leftovers(tmp_path) == []


# -- download: locks ------------------------------------------------------------------------------

_HOLDER = (
    "import filelock, sys, time\n"
    "lock = filelock.FileLock(sys.argv[1]); lock.acquire()\n"
    "print('held', flush=True); time.sleep(120)\n"
)


def _hold_lock(path: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_lock_of_a_killed_holder_is_reclaimed(tmp_path: Path) -> None:
    (tmp_path / "src.bin").write_bytes(PAYLOAD)
    dest = tmp_path / "dest.bin"
    holder = _hold_lock(tmp_path / "dest.bin.lock")
    holder.kill()
    holder.wait(timeout=10)
    # timeout_s bounds the wait: a lock not released by the holder's death would raise here.
    distkit.download(tmp_path / "src.bin", dest, sha256=DIGEST, timeout_s=10)
    assert dest.read_bytes() == PAYLOAD


def test_lock_held_by_a_live_process_times_out_naming_the_lock_file(tmp_path: Path) -> None:
    (tmp_path / "src.bin").write_bytes(PAYLOAD)
    lock = tmp_path / "dest.bin.lock"
    holder = _hold_lock(lock)
    try:
        start = time.monotonic()
        with pytest.raises(storage.LockTimeoutError) as info:
            distkit.download(tmp_path / "src.bin", tmp_path / "dest.bin", timeout_s=0.5)
        assert time.monotonic() - start < 30
    finally:
        holder.kill()
        holder.wait(timeout=10)
    assert isinstance(info.value, filelock.Timeout) and isinstance(info.value, distkit.DistkitError)
    assert info.value.lock_file == str(lock)
    copy = pickle.loads(pickle.dumps(info.value))
    assert (str(copy), copy.lock_file) == (str(info.value), str(lock))
    assert str(info.value).startswith(f"[rank 0/1] could not take the download lock {lock} within 0.5 s")
    assert not (tmp_path / "dest.bin").exists()


# -- download: network errors ---------------------------------------------------------------------


def test_transient_http_errors_are_retried_then_succeed(
    http_server: FileServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(_transfer, "_RETRY_BASE_S", 0.01)
    caplog.set_level(logging.WARNING, logger="distkit")
    http_server.files["/data.bin"] = PAYLOAD
    http_server.fail_next(2)  # the HEAD and the GET of the first attempt's look-up
    dest = distkit.download(http_server.url("/data.bin"), tmp_path / "data.bin", sha256=DIGEST)
    assert dest.read_bytes() == PAYLOAD
    assert [status for _, _, status in http_server.requests].count(503) == 2
    assert http_server.gets["/data.bin"] == 1
    assert "retrying in 0.01 s (attempt 2 of 4)" in caplog.text


def test_missing_source_is_not_retried(http_server: FileServer, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        distkit.download(http_server.url("/missing.bin"), tmp_path / "missing.bin")
    assert len(http_server.requests) == 2  # one HEAD and fsspec's GET fallback, no retry


def download_from_dead_server(url: str, dest: str) -> str:
    saved, _transfer._RETRY_BASE_S = _transfer._RETRY_BASE_S, 0.01
    try:
        distkit.download(url, dest, timeout_s=60)
    except distkit.MainProcessError as err:
        return f"waited {err.exc_type}: {err.exc_message}"
    except distkit.DistkitError as err:
        return f"own {err}"
    finally:
        _transfer._RETRY_BASE_S = saved
    return "no error"


def test_network_errors_after_the_retries_are_raised_on_every_rank(
    ranks, http_server: FileServer, tmp_path: Path
) -> None:
    http_server.files["/data.bin"] = PAYLOAD
    http_server.fail_next(1000)
    url = http_server.url("/data.bin")
    main, other = ranks.run(download_from_dead_server, url, str(tmp_path / "d.bin"), world_size=2)
    assert main.startswith(f"own [rank 0/2] looking up {url} failed after 4 attempts")
    assert other.startswith(f"waited distkit.errors.DistkitError: [rank 0/2] looking up {url} failed after 4")
    assert len(http_server.requests) == 8  # 4 attempts of HEAD + GET, from rank 0 only


# -- upload ---------------------------------------------------------------------------------------


def test_upload_writes_trees_and_files_to_local_memory_and_s3(tmp_path: Path, s3: S3Endpoint) -> None:
    files = _make_tree(tmp_path / "out")
    assert distkit.upload(tmp_path / "out", str(tmp_path / "up")).done()
    assert _uploaded(_tree(tmp_path / "up")) == files
    distkit.upload(tmp_path / "out" / "a.txt", f"file://{tmp_path}/single/")
    assert _tree(tmp_path / "single") == {"a.txt": files["a.txt"]}  # one file: one object, no markers

    memory = fsspec.filesystem("memory")
    distkit.upload(tmp_path / "out", "memory://dk-upload/run")
    assert _uploaded(_memory_tree("/dk-upload/run")) == files

    bucket = s3.bucket("dk-upload")
    handle = distkit.upload(tmp_path / "out", "s3://dk-upload/run", storage_options=s3.options())
    assert handle.done() and repr(handle).endswith("state='done')")
    assert _uploaded(_bucket_tree(bucket, "dk-upload/run")) == files
    # Named after the file, as s3fs names it, though s3fs is handed the opened file, not its name.
    assert bucket.info("dk-upload/run/a.txt")["ContentType"] == "text/plain"
    assert not [p for p in memory.find("/dk-upload") + bucket.find("dk-upload") if ".distkit-tmp" in p]


def test_upload_refuses_entries_outside_the_tree_before_writing_anything(tmp_path: Path) -> None:
    tree = tmp_path / "out"
    files = _make_tree(tree)
    (tmp_path / "secret.txt").write_text("outside")
    (tree / "etc").symlink_to("/etc")
    (tree / "sub" / "up.txt").symlink_to("../../secret.txt")
    (tree / "inner-link.txt").symlink_to("sub/b.bin")
    for dest in (str(tmp_path / "up"), "memory://dk-refused/run"):
        with pytest.raises(distkit.DistkitError) as info:
            distkit.upload(tree, dest)
        message = str(info.value)
        assert "refused before writing anything: 2 entries" in message
        assert "etc: symlink to /etc, outside" in message
        assert f"sub/up.txt: symlink to {(tmp_path / 'secret.txt').resolve()}, outside" in message
    assert not (tmp_path / "up").exists() and not fsspec.filesystem("memory").exists("/dk-refused")
    with pytest.raises(ValueError, match=r"'\.\.' component"):
        distkit.upload(tree, "memory://dk-refused/run/../../elsewhere")

    (tree / "etc").unlink()
    (tree / "sub" / "up.txt").unlink()
    distkit.upload(tree, str(tmp_path / "up"))
    assert _uploaded(_tree(tmp_path / "up")) == {**files, "inner-link.txt": files["sub/b.bin"]}


def upload_from_rank_zero(tree: str, dest: str, marker: str) -> tuple[bool, bool]:
    other_returned_first = False
    if distkit.get_rank() == 0:
        # Upload only once rank 1 has returned from its own call: a barrier inside upload() would
        # keep rank 1 from returning before this rank arrives, and this wait would run out.
        deadline = time.monotonic() + 30
        while not os.path.exists(marker) and time.monotonic() < deadline:
            time.sleep(0.01)
        other_returned_first = os.path.exists(marker)
    # The source exists on rank 0 only, as results written by the main process do.
    handle = distkit.upload(tree if distkit.get_rank() == 0 else tree + "-not-here", dest)
    if distkit.get_rank() == 1:
        Path(marker).touch()
    return handle.done(), other_returned_first


def test_upload_runs_on_rank_zero_and_the_others_return_at_once(ranks, tmp_path: Path) -> None:
    files = _make_tree(tmp_path / "out")
    marker = str(tmp_path / "rank1-returned")
    main, other = ranks.run(upload_from_rank_zero, str(tmp_path / "out"), str(tmp_path / "up"), marker)
    assert main == (True, True)  # rank 1 had returned before rank 0 even called upload()
    assert other[0] is True
    assert _uploaded(_tree(tmp_path / "up")) == files


def test_background_upload_error_surfaces_at_wait(tmp_path: Path, s3: S3Endpoint) -> None:
    _make_tree(tmp_path / "out")
    handle = distkit.upload(
        tmp_path / "out", "s3://dk-no-such-bucket/run", background=True, storage_options=s3.options()
    )
    with pytest.raises(FileNotFoundError, match="bucket does not exist"):
        handle.wait(timeout_s=60)
    assert handle.done() and repr(handle).endswith("state='failed')")
    with pytest.raises(FileNotFoundError):
        handle.wait(timeout_s=1)  # the same error again, for every caller


def test_background_upload_finishes_and_wait_has_a_deadline(tmp_path: Path, http_server: FileServer) -> None:
    files = _make_tree(tmp_path / "out")
    handle = distkit.upload(tmp_path / "out", str(tmp_path / "up"), background=True)
    handle.wait(timeout_s=60)
    assert handle.done() and _uploaded(_tree(tmp_path / "up")) == files

    http_server.upload_gate.clear()  # the server sits on the upload until the gate opens
    slow = distkit.upload(tmp_path / "out" / "a.txt", http_server.url("/a.txt"), background=True)
    with pytest.raises(TimeoutError, match=r"is still running after 0\.2 s"):
        slow.wait(timeout_s=0.2)
    assert not slow.done() and repr(slow).endswith("state='running')")
    http_server.upload_gate.set()
    with pytest.raises(Exception, match="405"):  # the server's answer, once it gives one
        slow.wait(timeout_s=60)


# -- upload: complete or visibly partial -----------------------------------------------------------


def test_download_checks_a_tree_against_its_upload_manifest_and_leaves_the_markers_out(
    tmp_path: Path,
) -> None:
    files = _make_tree(tmp_path / "out")
    (tmp_path / "out" / MANIFEST).write_text("{}")  # e.g. from a copy of an upload: not uploaded
    distkit.upload(tmp_path / "out", "memory://dk-manifest/run")
    assert _uploaded(_memory_tree("/dk-manifest/run")) == files
    assert _tree(distkit.download("memory://dk-manifest/run", tmp_path / "copy")) == files

    memory = fsspec.filesystem("memory")
    memory.pipe("/dk-manifest/run/a.txt", b"ALPHA\n")  # same size, other bytes
    with pytest.raises(storage.ChecksumMismatchError, match="the upload manifest of") as info:
        distkit.download("memory://dk-manifest/run", tmp_path / "changed")
    assert info.value.expected == hashlib.sha256(files["a.txt"]).hexdigest()
    memory.rm("/dk-manifest/run/sub/b.bin")
    with pytest.raises(
        distkit.DistkitError, match=r"does not match its upload manifest.*\n  sub/b\.bin: missing"
    ):
        distkit.download("memory://dk-manifest/run", tmp_path / "missing")
    assert not (tmp_path / "changed").exists() and not (tmp_path / "missing").exists()
    assert _leftovers(tmp_path) == []


def _write_files(root: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)


def test_upload_whose_server_starts_failing_midway_is_marked_partial_and_refused_by_download(
    tmp_path: Path, s3: S3Endpoint
) -> None:
    first = {f"part-{i}.bin": bytes([i]) * 1000 for i in range(8)}
    second = {rel: data.upper() + b"2" for rel, data in first.items()}  # a later version of each
    _write_files(tmp_path / "v1", first)
    _write_files(tmp_path / "v2", second)
    bucket = s3.bucket("dk-partial")
    distkit.upload(tmp_path / "v1", "s3://dk-partial/run", storage_options=s3.options())
    # Uploading the next version over it: the marker's put, the removal of the old manifest and
    # two files' puts pass; then the server refuses the (unknown) access key, as S3 does.
    with s3.checking_keys_after(4), pytest.raises(PermissionError, match="Access Key Id"):
        distkit.upload(tmp_path / "v2", "s3://dk-partial/run", storage_options=s3.options())
    written = _bucket_tree(bucket, "dk-partial/run")
    assert INCOMPLETE in written and MANIFEST not in written  # the old manifest went first
    replaced = [rel for rel, data in second.items() if written[rel] == data]
    assert 0 < len(replaced) < len(second)  # a mix of both versions
    with pytest.raises(distkit.DistkitError, match="holds a partial upload") as info:
        distkit.download("s3://dk-partial/run", tmp_path / "copy", storage_options=s3.options())
    assert f"started {json.loads(written[INCOMPLETE])['started']} by process {os.getpid()}" in str(info.value)
    assert not (tmp_path / "copy").exists() and _leftovers(tmp_path) == []

    distkit.upload(tmp_path / "v2", "s3://dk-partial/run", storage_options=s3.options())
    assert _uploaded(_bucket_tree(bucket, "dk-partial/run")) == second  # the mark is gone
    copy = distkit.download("s3://dk-partial/run", tmp_path / "copy", storage_options=s3.options())
    assert _tree(copy) == second


class SmallObjectMemoryFileSystem(MemoryFileSystem):
    """fsspec's memory filesystem under its own protocol, with an object store's size limit on each
    object it writes: an object over ``limit`` bytes is refused with EFBIG (not retried)."""

    protocol = ("smallobj",)
    store: ClassVar[dict[str, Any]] = {}  # its own store, apart from memory://
    pseudo_dirs: ClassVar[list[str]] = [""]
    limit = 1024

    @classmethod
    def _strip_protocol(cls, path):  # type: ignore[no-untyped-def]
        return super()._strip_protocol(path.removeprefix("smallobj://") if isinstance(path, str) else path)

    def _check_size(self, path: str, size: int) -> None:
        if size > self.limit:
            raise OSError(errno.EFBIG, f"object of {size} bytes, over the limit of {self.limit}", path)

    def pipe_file(self, path, value, mode="overwrite", **kwargs):  # type: ignore[no-untyped-def]
        self._check_size(path, len(value))
        return super().pipe_file(path, value, mode=mode, **kwargs)

    def put_file(self, lpath, rpath, *args, **kwargs):  # type: ignore[no-untyped-def]
        self._check_size(rpath, os.path.getsize(lpath))
        return super().put_file(lpath, rpath, *args, **kwargs)


fsspec.register_implementation("smallobj", SmallObjectMemoryFileSystem, clobber=True)


def test_an_upload_whose_manifest_cannot_be_written_stays_partial_and_download_refuses_it(
    tmp_path: Path,
) -> None:
    # 16 files of 2 or 3 bytes each pass the store's 1 KiB limit, and so does the partial marker;
    # the manifest (a size and a SHA-256 per file, about 2 KB) is refused: the upload fails on
    # its very last write.
    files = {f"part-{i:02d}.txt": f"{i}\n".encode() for i in range(16)}
    _write_files(tmp_path / "out", files)
    store = SmallObjectMemoryFileSystem.store
    store.clear()
    try:
        with pytest.raises(OSError, match="over the limit") as info:
            distkit.upload(tmp_path / "out", "smallobj://dk-no-manifest/run")
        assert info.value.errno == errno.EFBIG and MANIFEST in str(info.value.filename)
        fs = SmallObjectMemoryFileSystem()
        written = {p.rsplit("/", 1)[1] for p in fs.find("/dk-no-manifest/run")}
        assert set(files) <= written  # every file arrived; only the manifest did not
        assert INCOMPLETE in written and MANIFEST not in written, (
            f"the destination holds {sorted(written)}: the partial marker was removed before the "
            f"manifest was written, so a tree without its manifest no longer reads as incomplete"
        )
        with pytest.raises(distkit.DistkitError, match="holds a partial upload"):
            distkit.download("smallobj://dk-no-manifest/run", tmp_path / "copy")
        assert not (tmp_path / "copy").exists() and _leftovers(tmp_path) == []
    finally:
        store.clear()


def _checked_upload(source: Path, dest: str, options: dict[str, Any] | None = None) -> Any:
    """An upload whose tree has been checked and whose files are not opened yet: a fixed point at
    which a test changes the tree. ``run()`` does the rest."""
    options = dict(options or {})
    return _upload._plan_upload(source, dest, options, _secrets.Scrubber(options, dest))


@pytest.mark.parametrize("dest_kind", ["local", "memory", "s3"])
def test_a_file_swapped_for_a_symlink_after_the_check_is_never_followed(
    tmp_path: Path, s3: S3Endpoint, dest_kind: str
) -> None:
    tree = tmp_path / "out"
    _make_tree(tree)
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"private data outside the tree")
    bucket = s3.bucket("dk-swapped") if dest_kind == "s3" else None
    dest, options, written = {
        "local": (str(tmp_path / "up"), {}, lambda: _tree(tmp_path / "up")),
        "memory": ("memory://dk-swapped/run", {}, lambda: _memory_tree("/dk-swapped/run")),
        "s3": ("s3://dk-swapped/run", s3.options(), lambda: _bucket_tree(bucket, "dk-swapped/run")),
    }[dest_kind]
    upload = _checked_upload(tree, dest, options)
    (tree / "sub" / "b.bin").unlink()
    (tree / "sub" / "b.bin").symlink_to(outside)
    with pytest.raises(
        distkit.DistkitError, match=r"stopped at sub/b\.bin: it was replaced by a symbolic link"
    ):
        upload.run()
    found = written()
    assert b"private data outside the tree" not in found.values()
    assert "sub/b.bin" not in found and INCOMPLETE in found and MANIFEST not in found


@pytest.mark.parametrize("swap", ["another file", "a FIFO"])
def test_a_file_replaced_after_the_check_stops_the_upload_without_blocking(tmp_path: Path, swap: str) -> None:
    tree = tmp_path / "out"
    files = _make_tree(tree)
    upload = _checked_upload(tree, str(tmp_path / "up"))
    victim = tree / "sub" / "b.bin"
    if swap == "a FIFO":
        victim.unlink()
        os.mkfifo(victim)  # opened without O_NONBLOCK, this would wait for a writer forever
    else:
        (tree / "sub" / "new.bin").write_bytes(b"x" * len(files["sub/b.bin"]))
        os.replace(tree / "sub" / "new.bin", victim)
    what = "another file" if swap == "another file" else "something that is not a regular file"
    with pytest.raises(distkit.DistkitError, match=rf"stopped at sub/b\.bin: it was replaced by {what}"):
        upload.run()
    assert sorted(_tree(tmp_path / "up")) == [INCOMPLETE, "a.txt"]  # the files before it, and the mark


def test_file_names_with_glob_characters_land_under_their_own_names(tmp_path: Path, s3: S3Endpoint) -> None:
    names = ["what?.txt", "whatX.txt", "star*.txt", "[ab].txt", "a.txt", "sub[1]/x?.bin", "sub1/x.bin"]
    files = {name: name.encode() for name in names}
    for rel, data in files.items():
        (tmp_path / "out" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "out" / rel).write_bytes(data)
    distkit.upload(tmp_path / "out", "memory://dk-glob/run")
    assert _uploaded(_memory_tree("/dk-glob/run")) == files
    bucket = s3.bucket("dk-glob")
    distkit.upload(tmp_path / "out", "s3://dk-glob/run", storage_options=s3.options())
    assert _uploaded(_bucket_tree(bucket, "dk-glob/run")) == files
    distkit.upload(tmp_path / "out", str(tmp_path / "up"))
    assert _uploaded(_tree(tmp_path / "up")) == files


def test_names_an_object_store_would_store_elsewhere_are_refused_before_writing(
    tmp_path: Path, s3: S3Endpoint
) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "ok.txt").write_bytes(b"ok")
    (tmp_path / "out" / "model?versionId=3").write_bytes(b"weights")  # s3fs reads a version id
    bucket = s3.bucket("dk-misplaced")
    with pytest.raises(
        distkit.DistkitError, match=r"model\?versionId=3: s3:// would store it as 'dk-misplaced/run/model'"
    ):
        distkit.upload(tmp_path / "out", "s3://dk-misplaced/run", storage_options=s3.options())
    assert bucket.find("dk-misplaced") == []


@pytest.mark.parametrize("umask", [0o077, 0o022, 0o002])
def test_uploaded_and_downloaded_files_follow_the_process_umask(tmp_path: Path, umask: int) -> None:
    _make_tree(tmp_path / "out")
    (tmp_path / "one.bin").write_bytes(PAYLOAD)
    previous = os.umask(umask)
    try:
        distkit.upload(tmp_path / "out", str(tmp_path / "up"))
        distkit.upload(tmp_path / "one.bin", f"file://{tmp_path}/single/")
        distkit.download(tmp_path / "one.bin", tmp_path / "copy.bin", sha256=DIGEST)
        distkit.download(f"file://{tmp_path / 'out'}", tmp_path / "copy")
    finally:
        os.umask(previous)
    expected = {"file": 0o666 & ~umask, "dir": 0o777 & ~umask}
    made = [tmp_path / "up", tmp_path / "copy", tmp_path / "single" / "one.bin", tmp_path / "copy.bin"]
    made += [*(tmp_path / "up").rglob("*"), *(tmp_path / "copy").rglob("*")]
    modes = {str(p.relative_to(tmp_path)): oct(p.stat().st_mode & 0o777) for p in made}
    assert modes == {
        str(p.relative_to(tmp_path)): oct(expected["dir" if p.is_dir() else "file"]) for p in made
    }


# -- secrets --------------------------------------------------------------------------------------


def _shown(err: BaseException) -> str:
    return "".join(traceback.format_exception(type(err), err, err.__traceback__)) + repr(err)


def download_with_secret(url: str, dest: str) -> str:
    try:
        distkit.download(url, dest, storage_options={"headers": {"Authorization": f"Bearer {SECRET}"}})
    except Exception as err:
        return _shown(err)
    return "no error"


def test_secrets_never_appear_in_errors_reprs_or_logs(
    ranks, http_server: FileServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="distkit")
    http_server.expected_auth = "Bearer the-right-token"
    http_server.files["/data.bin"] = PAYLOAD
    url = http_server.url("/data.bin")
    options = {"headers": {"Authorization": f"Bearer {SECRET}"}}
    # The server quotes rejected credentials back: fsspec's own error carries the secret...
    with pytest.raises(Exception) as raw:
        fsspec.filesystem("http", **options).info(url)
    assert SECRET in _shown(raw.value)

    # ...but nothing distkit raises, logs or shows does, on the fetching rank or the waiting one.
    main, other = ranks.run(download_with_secret, url, str(tmp_path / "d.bin"), world_size=2)
    assert "401" in main and "***" in main and "MainProcessError" in other
    assert SECRET not in main and SECRET not in other

    _make_tree(tmp_path / "out")
    handle = distkit.upload(tmp_path / "out" / "a.txt", url, background=True, storage_options=options)
    with pytest.raises(Exception) as failed:
        handle.wait(timeout_s=60)
    assert "***" in str(failed.value) and SECRET not in _shown(failed.value)
    assert SECRET not in repr(handle)

    password_url = f"http://user:{SECRET}@127.0.0.1:{http_server.port}/missing.bin?sig={SECRET}"
    with pytest.raises(Exception) as missing:
        distkit.download(password_url, tmp_path / "m.bin")
    assert SECRET not in _shown(missing.value)
    assert caplog.text and SECRET not in caplog.text


# Credential headers, each holding SECRET, as a client sends them.
HEADERS = {
    "Authorization": f"Bearer {SECRET}-authorization",
    "Cookie": f"session={SECRET}-cookie",
    "X-Api-Key": f"{SECRET}-api-key",
}


def _everything_shown(err: BaseException) -> str:
    """All that code could print of ``err``: its formatted traceback, and the str, repr, args and
    attributes of every exception in its ``__cause__``/``__context__`` chain."""
    parts = ["".join(traceback.format_exception(type(err), err, err.__traceback__))]
    seen: set[int] = set()
    stack: list[BaseException | None] = [err]
    while stack:
        exc = stack.pop()
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        parts += [str(exc), repr(exc), repr(exc.args), *(repr(value) for value in vars(exc).values())]
        stack += [exc.__cause__, exc.__context__]
    return "\n".join(parts)


class _Keep(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []
        self.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))  # with the traceback of exc_info, if any


@pytest.fixture
def root_log() -> Any:
    """What every logger emits (fsspec, aiohttp, botocore, s3fs, distkit), with the root at DEBUG."""
    root = logging.getLogger()
    keep, level = _Keep(), root.level
    root.addHandler(keep)
    root.setLevel(logging.DEBUG)
    try:
        yield keep.lines
    finally:
        root.removeHandler(keep)
        root.setLevel(level)


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_credentials_stay_out_of_http_errors_their_whole_chains_and_all_logs(
    http_server: FileServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, root_log: list[str]
) -> None:
    monkeypatch.setattr(_transfer, "_RETRY_BASE_S", 0.01)
    http_server.files["/data.bin"] = PAYLOAD
    options = {"headers": HEADERS}
    missing = http_server.url(f"/missing.bin?sig={SECRET}-sig&se=2030")
    # aiohttp keeps the request's headers on its error, where only repr shows them.
    with pytest.raises(FileNotFoundError) as raw:
        fsspec.filesystem("http", **options).info(http_server.url("/missing.bin"))
    assert SECRET in repr(raw.value.__cause__)

    failures: list[BaseException] = []
    password_url = f"http://user:{SHORT_SECRET}@127.0.0.1:{http_server.port}/missing.bin"
    # The URL's user part is the Authorization header: the other headers go with it.
    other_headers = {"headers": {k: v for k, v in HEADERS.items() if k != "Authorization"}}
    for url, given in (
        (http_server.url("/missing.bin"), options),
        (missing, options),
        (password_url, other_headers),
    ):
        with pytest.raises(FileNotFoundError) as info:  # a 404: still a FileNotFoundError
            distkit.download(url, tmp_path / "d.bin", storage_options=given)
        failures.append(info.value)
    http_server.fail_next(1000)  # 500s: retried, then given up
    for url in (http_server.url(f"/data.bin?sig={SECRET}-sig"), f"http://127.0.0.1:{_closed_port()}/x"):
        with pytest.raises(distkit.DistkitError, match="failed after 4 attempts") as info:
            distkit.download(url, tmp_path / "d.bin", storage_options=options)
        failures.append(info.value)
    http_server.fail_next(0)
    http_server.expected_auth = "Bearer the-right-one"  # rejects the upload, quoting the header back
    (tmp_path / "a.txt").write_bytes(b"a")
    with pytest.raises(Exception, match="401") as info:
        distkit.upload(
            tmp_path / "a.txt", http_server.url(f"/a.txt?sig={SECRET}-sig"), storage_options=options
        )
    failures.append(info.value)

    for failure in failures:
        shown = _everything_shown(failure)
        assert SECRET not in shown and f":{SHORT_SECRET}@" not in shown, shown
    assert str(failures[0]).startswith(http_server.url("/missing.bin (caused by aiohttp"))
    assert "/missing.bin?sig=***&se=***" in str(failures[1])  # still says which file
    logs = "\n".join(root_log)
    assert "retrying in 0.01 s" in logs and "fsspec.http" in logs  # fsspec logged the requests...
    assert SECRET not in logs and f":{SHORT_SECRET}@" not in logs  # ...with the credentials hidden


def test_credentials_stay_out_of_s3_errors_and_of_botocore_debug_logs(
    tmp_path: Path, s3: S3Endpoint, root_log: list[str]
) -> None:
    _make_tree(tmp_path / "out")
    s3.bucket("dk-secrets").pipe("dk-secrets/data.bin", PAYLOAD)
    options = s3.options(key=f"AKIA{SECRET}", secret=f"{SECRET}-secret", token=f"{SECRET}-session")
    with s3.checking_keys_after(0):
        with pytest.raises(PermissionError) as up:
            distkit.upload(tmp_path / "out", "s3://dk-secrets/run", storage_options=options)
        with pytest.raises(PermissionError) as down:
            distkit.download("s3://dk-secrets/data.bin", tmp_path / "d.bin", storage_options=options)
    for failure in (up.value, down.value):
        assert SECRET not in _everything_shown(failure)
    logs = "\n".join(root_log)
    assert "botocore" in logs and "Authorization" in logs  # botocore logged its requests...
    assert SECRET not in logs  # ...with the key id, the session token and the signature hidden


def test_every_kind_of_credential_option_is_hidden_and_ordinary_options_are_not() -> None:
    options = {
        "passphrase": "pass-phrase-value",
        "connection_string": "DefaultEndpointsProtocol=https;AccountKey=account-key-value",
        "credentials": {"private_key": "credentials-value"},
        "creds": "creds-value",
        "sig": "sig-value",
        "github_pat": "pat-value-1",
        "client_kwargs": {"headers": {"Cookie": "c=cookie-value", "X-Api-Key": "k9", "Bearer": "bearer-v"}},
        "endpoint_url": "http://minio.local:9000",
        "path": "keep-this-path",
    }
    scrub = _secrets.Scrubber(options, "https://tok3n-as-user@host/x")
    secrets = ["pass-phrase-value", "account-key-value", "credentials-value", "creds-value", "sig-value"]
    secrets += ["pat-value-1", "cookie-value", "bearer-v", "tok3n-as-user"]
    text = scrub.text(" ".join(secrets) + " k9 ok9x http://minio.local:9000 keep-this-path")
    assert not [secret for secret in secrets if secret in text], text
    assert " k9 " not in text and "ok9x" in text  # a short secret goes only where it stands alone
    assert "http://minio.local:9000" in text and "keep-this-path" in text
    assert _secrets.redact_url("simplecache::https://u:pw@h/x?X-Amz-Signature=s&v=1") == (
        "simplecache::https://***@h/x?X-Amz-Signature=***&v=***"
    )


def test_download_messages_keep_query_parameter_names_and_hide_only_their_values(
    http_server: FileServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # docs/coordination.md, "Secrets": the names stay, to debug with (long ones too, which are
    # also pieces of the query string the Scrubber hides).
    caplog.set_level(logging.INFO, logger="distkit")
    http_server.files["/data.bin"] = PAYLOAD
    query = f"X-Amz-Signature={SECRET}&X-Amz-Date=20300101T000000Z&se=2030"
    shown = "?X-Amz-Signature=***&X-Amz-Date=***&se=***"
    distkit.download(http_server.url(f"/data.bin?{query}"), tmp_path / "d.bin")
    assert f"/data.bin{shown} to " in caplog.text, caplog.text
    with pytest.raises(FileNotFoundError) as missing:
        distkit.download(http_server.url(f"/missing.bin?{query}"), tmp_path / "m.bin")
    assert str(missing.value).startswith(http_server.url(f"/missing.bin{shown} (caused by")), missing.value
    assert SECRET not in _everything_shown(missing.value) and SECRET not in caplog.text
    assert "20300101T000000Z" not in _everything_shown(missing.value)  # a long value, under any name


def test_credentials_given_both_in_the_url_and_a_header_are_refused_naming_the_conflict(
    http_server: FileServer, tmp_path: Path
) -> None:
    # aiohttp refuses to send both, and fsspec reported that as FileNotFoundError(url).
    http_server.files["/data.bin"] = PAYLOAD
    url = f"http://user:{SECRET}@127.0.0.1:{http_server.port}/data.bin"
    twice = r"given twice, in the URL's user part \(user:password@\) and in an Authorization header"
    options = {"headers": {"authorization": f"Bearer {SECRET}-header"}}
    with pytest.raises(ValueError, match=twice + r" in storage_options\['headers'\]") as down:
        distkit.download(url, tmp_path / "d.bin", storage_options=options)
    client = {"client_kwargs": {"headers": {"Authorization": f"Bearer {SECRET}-header"}}}
    with pytest.raises(ValueError, match=twice + r" in storage_options\['client_kwargs'\]\['headers'\]"):
        distkit.download(url, tmp_path / "d.bin", storage_options=client)
    (tmp_path / "a.txt").write_bytes(b"a")
    with pytest.raises(ValueError, match=twice) as up:
        distkit.upload(tmp_path / "a.txt", url, storage_options=options)
    for failure in (down.value, up.value):
        assert "Give the credential once" in str(failure) and SECRET not in _everything_shown(failure)
    assert http_server.requests == [] and not (tmp_path / "d.bin").exists()
    # Either one alone is sent.
    assert distkit.download(url, tmp_path / "d.bin").read_bytes() == PAYLOAD
    distkit.download(http_server.url("/data.bin"), tmp_path / "e.bin", storage_options=options)


def test_a_header_beside_a_netrc_entry_read_under_trust_env_is_refused_naming_the_file(
    http_server: FileServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With trust_env, aiohttp takes the host's netrc entry as the request's credentials and refuses
    # an Authorization header beside it; fsspec reported that as FileNotFoundError(url).
    http_server.files["/data.bin"] = PAYLOAD
    netrc_file = tmp_path / "netrc"
    netrc_file.write_text(f"machine 127.0.0.1 login user password {SECRET}\n")
    monkeypatch.setenv("NETRC", str(netrc_file))
    options = {"client_kwargs": {"trust_env": True}, "headers": {"Authorization": f"Bearer {SECRET}-header"}}
    with pytest.raises(
        ValueError, match=rf"in the netrc file {re.escape(str(netrc_file))} \(its entry for "
    ) as down:
        distkit.download(http_server.url("/data.bin"), tmp_path / "d.bin", storage_options=options)
    (tmp_path / "a.txt").write_bytes(b"a")
    with pytest.raises(ValueError, match="point the NETRC environment variable at a file without") as up:
        distkit.upload(tmp_path / "a.txt", http_server.url("/a.txt"), storage_options=options)
    for failure in (down.value, up.value):
        assert "in an Authorization header in storage_options['headers']" in str(failure)
        assert SECRET not in _everything_shown(failure)
    assert http_server.requests == [] and not (tmp_path / "d.bin").exists()
    # Without trust_env aiohttp does not read the file, and a file without the host is no conflict.
    distkit.download(
        http_server.url("/data.bin"), tmp_path / "d.bin", storage_options={"headers": options["headers"]}
    )
    netrc_file.write_text("machine elsewhere.example login user password other\n")
    distkit.download(http_server.url("/data.bin"), tmp_path / "e.bin", storage_options=options)


def test_a_misspelt_http_storage_option_is_named_with_the_one_meant(
    http_server: FileServer, tmp_path: Path
) -> None:
    # fsspec's HTTP file system hands options it does not know to every aiohttp request, whose
    # TypeError it reported as FileNotFoundError(url): "the file is missing" for a typo.
    http_server.files["/data.bin"] = PAYLOAD
    header = {"Authorization": f"Bearer {SECRET}"}
    with pytest.raises(TypeError) as down:
        distkit.download(http_server.url("/data.bin"), tmp_path / "d.bin", storage_options={"header": header})
    said = str(down.value)
    assert "nothing was sent" in said and "storage_options['header'] is no option" in said, said
    assert "Did you mean 'headers'?" in said and SECRET not in _everything_shown(down.value)
    assert http_server.requests == [] and not (tmp_path / "d.bin").exists()
    with pytest.raises(
        TypeError, match=r"storage_options\['timeout_s'\] is no option.*Did you mean 'timeout'\?"
    ):
        distkit.download(http_server.url("/data.bin"), tmp_path / "d.bin", storage_options={"timeout_s": 5})
    # A missing file is still FileNotFoundError.
    with pytest.raises(FileNotFoundError):
        distkit.download(
            http_server.url("/missing.bin"), tmp_path / "m.bin", storage_options={"headers": header}
        )
    # An upload's request: aiohttp's own TypeError (was: "ClientSession._request() got an unexpected
    # keyword argument 'header'", naming no storage option).
    (tmp_path / "a.txt").write_bytes(b"a")
    with pytest.raises(TypeError) as up:
        distkit.upload(tmp_path / "a.txt", http_server.url("/a.txt"), storage_options={"header": header})
    said = str(up.value)
    assert "uploading to" in said and "storage_options['header'] is no option" in said, said
    assert "Did you mean 'headers'?" in said and SECRET not in _everything_shown(up.value)


# -- the example ----------------------------------------------------------------------------------


def test_example_runs_under_torchrun_with_a_local_http_server(tmp_path: Path) -> None:
    proc = subprocess.run(
        torchrun(str(ROOT / "examples" / "prepare_and_upload.py"), "--workdir", str(tmp_path), "--http"),
        capture_output=True,
        text=True,
        timeout=240,
        env=job_env(),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "uploaded" in proc.stdout
    assert sorted(p.name for p in (tmp_path / "uploaded").iterdir()) == [MANIFEST, "metrics.json", "model.pt"]
