"""Downloads fetched once per node and never half-written; uploads from rank 0 that stay in the tree.

Both speak fsspec, so a source or destination is any URL it knows (``https://``, ``s3://``,
``gs://``, ``memory://``, ``file://``) or a local path; ``storage_options`` go to the filesystem.

:func:`download` is coordinated twice: within the job by a main-first section (one rank per node
fetches while the others wait on the store, and a failure reaches all of them), and across jobs by
an ``flock`` lock beside the destination (two jobs on one node never fetch at once; the kernel
releases the lock of a holder that dies). The data goes to a temporary name in the destination's
directory, is fsynced and checked, and only then renamed into place.

:func:`upload` runs on rank 0 only. Nothing outside the source tree is ever read (each file is
opened without following links and checked to be the file the tree check saw), and each remote
object appears whole: local targets through a temporary file and a rename, object stores because a
put is atomic there, other filesystems through a temporary name and a move. A directory upload is
framed by two markers: ``_DISTKIT_INCOMPLETE`` is written first, and the manifest
``_DISTKIT_MANIFEST.json`` (every file's size and SHA-256) last, so a reader can tell a complete tree
from a partial one; :func:`download` refuses a partial one and checks a complete one against it.

Credentials in ``storage_options``, in URLs and in HTTP headers are replaced by ``***`` in every
message, exception chain, ``repr`` and log line (distkit's, and fsspec's, aiohttp's and botocore's
during a call); see :class:`distkit._utils.secrets.Scrubber`.
"""

from __future__ import annotations

# The code lives in private modules of this package, one concern each; this is their public face.
#   _download.py  download(): the lock, rank-0-first coordination, the manifest check
#   _upload.py    upload(): the tree check, safe opening, the markers, UploadHandle
#   _transfer.py  what both share: retries of transient errors, the markers' names, the log
from distkit.storage._download import ChecksumMismatchError, LockTimeoutError, download
from distkit.storage._transfer import (  # importable from here as before; not part of __all__
    INCOMPLETE_NAME as INCOMPLETE_NAME,
    MANIFEST_NAME as MANIFEST_NAME,
)
from distkit.storage._upload import UploadHandle, upload

__all__ = ["ChecksumMismatchError", "LockTimeoutError", "UploadHandle", "download", "upload"]
