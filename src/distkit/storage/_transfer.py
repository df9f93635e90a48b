"""What download and upload share (private): retries of transient errors, the upload markers, the log.

:func:`_with_retries` retries what fails for a reason that passes (a dropped connection, a timeout,
a 5xx answer) with back-off. The markers' names and the manifest's format are the contract between
:mod:`distkit.storage._upload`, which writes them, and :mod:`distkit.storage._download`, which reads them.
"""

from __future__ import annotations

import asyncio
import difflib
import errno
import http
import inspect
import netrc
import os
import re
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

from distkit import coordination, runtime
from distkit._utils.secrets import Scrubber
from distkit.errors import DistkitError
from distkit.runtime import _rank_label

T = TypeVar("T")

# Transient network errors: 4 attempts, 1 + 2 + 4 = 7 s of back-off in all, enough to ride out a
# load balancer's restart without hiding an outage for long.
_ATTEMPTS = 4
_RETRY_BASE_S = 1.0
# Copy in 4 MiB pieces: large enough that per-call overhead vanishes, small enough to stream.
_CHUNK = 4 * 2**20
_TRANSIENT_ERRNOS = frozenset(
    {
        errno.EIO,
        errno.ECONNRESET,
        errno.ECONNREFUSED,
        errno.ECONNABORTED,
        errno.ETIMEDOUT,
        errno.EPIPE,
        errno.EHOSTUNREACH,
        errno.ENETUNREACH,
        errno.ENETDOWN,
        errno.EAGAIN,
    }
)
# The markers of a directory upload, at the top of the destination. The leading underscore makes
# dataset readers skip them (pyarrow, Spark and Hive ignore names starting with "_" or ".").
# The manifest exists only once every file is in place, as Hadoop's _SUCCESS does, so a sensor
# that waits for it needs no parsing; _DISTKIT_INCOMPLETE is what tells a partial tree written by
# distkit (failed, killed or still running) from a tree someone else wrote.
MANIFEST_NAME = "_DISTKIT_MANIFEST.json"
INCOMPLETE_NAME = "_DISTKIT_INCOMPLETE"
_MARKERS = frozenset({MANIFEST_NAME, INCOMPLETE_NAME})
_MANIFEST_FORMAT = "distkit-upload"
_MANIFEST_VERSION = 1
# An error that lists problems (files that differ from a manifest, entries an upload refuses)
# shows this many: enough to see the pattern, few enough to read in a log; the rest are counted.
_MAX_LISTED = 20


def _log() -> runtime.RankLoggerAdapter:
    return runtime.get_logger("distkit.storage")


def _protocols(fs: Any) -> tuple[str, ...]:
    protocol = fs.protocol
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


def _problem_lines(problems: list[str]) -> str:
    """``problems`` as indented lines, each after a newline: the first 20, then how many more."""
    listed = "".join(f"\n  {problem}" for problem in problems[:_MAX_LISTED])
    more = f"\n  ... and {len(problems) - _MAX_LISTED} more" if len(problems) > _MAX_LISTED else ""
    return listed + more


# Pairs of places that aiohttp refuses to take credentials from at once: an Authorization header
# beside any other credential, and a request's auth beside the URL's user part. (A session auth
# beside the URL's user part is not refused: aiohttp sends the URL's, and that is no error.)
_CREDENTIAL_CONFLICTS = (
    ("url", "header"),
    ("header", "auth"),
    ("header", "client_auth"),
    ("url", "auth"),
    ("header", "netrc"),
)


def _check_http_credentials(url: str, options: Mapping[str, Any], *, shown: str) -> None:
    """Refuse an HTTP(S) ``url`` whose credentials are given in two places aiohttp will not combine.

    aiohttp, fsspec's HTTP client, raises ``ValueError("Cannot combine AUTHORIZATION header with
    AUTH argument or credentials encoded in URL")`` before it sends anything, even when both hold
    the same credential, and fsspec reports that as ``FileNotFoundError(url)``: a missing file
    instead of the conflict. ``shown`` is the URL as a message may show it.
    """
    if "::" in url or url.partition("://")[0].lower() not in ("http", "https"):
        return  # not HTTP, or an fsspec chain, whose options are each link's
    try:
        parts = urlsplit(url)
        in_url = bool(parts.username or parts.password)
    except ValueError:
        return  # a malformed URL: fsspec names it
    client = options.get("client_kwargs")
    client = client if isinstance(client, Mapping) else {}
    places: dict[str, str] = {}
    if in_url:
        places["url"] = "in the URL's user part (user:password@)"
    for where, headers in (
        ("'headers'", options.get("headers")),
        ("'client_kwargs']['headers'", client.get("headers")),
    ):
        if isinstance(headers, Mapping) and any(str(key).lower() == "authorization" for key in headers):
            places.setdefault("header", f"in an Authorization header in storage_options[{where}]")
    if options.get("auth") is not None:
        places["auth"] = "in storage_options['auth']"
    if client.get("auth") is not None:
        places["client_auth"] = "in storage_options['client_kwargs']['auth']"
    host = parts.hostname
    if client.get("trust_env") and host and not places.keys() & {"url", "auth", "client_auth"}:
        # With trust_env, aiohttp takes a request's credentials from the netrc file when none are
        # given otherwise, and then refuses an Authorization header beside them.
        found = _netrc_with(host)
        if found is not None:
            places["netrc"] = f"in the netrc file {found} (its entry for {host})"
    for first, second in _CREDENTIAL_CONFLICTS:
        if first in places and second in places:
            hint = ""
            if first == "url":
                hint = (
                    " (a URL's user:password@ is sent as the header 'Authorization: Basic <base64 of "
                    "user:password>')"
                )
            elif second == "netrc":
                hint = (
                    f" (aiohttp reads that file because storage_options['client_kwargs']['trust_env'] "
                    f"is true; to keep trust_env for a proxy, point the NETRC environment variable at a "
                    f"file without {host})"
                )
            raise ValueError(
                f"the credentials for {shown} are given twice, {places[first]} and {places[second]}; "
                f"aiohttp, fsspec's HTTP client, refuses to send a request with both, even when they "
                f"agree. Give the credential once: remove one of the two{hint}."
            )


def _netrc_with(host: str) -> str | None:
    """The netrc file aiohttp reads under ``trust_env`` (``$NETRC``, else ``~/.netrc``), if it
    holds credentials for ``host`` (a ``default`` entry counts); ``None`` otherwise, and where aiohttp
    would not read it (missing, unreadable, malformed)."""
    path = os.environ.get("NETRC")
    if path is None:
        try:
            path = str(Path.home() / ("_netrc" if sys.platform == "win32" else ".netrc"))
        except RuntimeError:  # no home directory
            return None
    try:
        entry = netrc.netrc(path).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        return None
    return None if entry is None else path


# -- retries --------------------------------------------------------------------------------------


def _is_transient(err: BaseException) -> bool:
    """Worth retrying: a dropped connection, a timeout, a 5xx answer; not a missing file."""
    if isinstance(err, DistkitError):
        return False
    if isinstance(err, FileNotFoundError):
        # fsspec's HTTP filesystem reports any failed HEAD and GET as FileNotFoundError, chaining
        # the real cause (a 503, a refused connection).
        return err.__cause__ is not None and _is_transient(err.__cause__)
    if isinstance(err, (PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError)):
        return False
    if isinstance(err, (ConnectionError, TimeoutError, asyncio.TimeoutError)):
        return True
    # Only a loaded aiohttp can have raised its errors; looking it up never imports it.
    aiohttp = sys.modules.get("aiohttp")
    if aiohttp is not None and isinstance(err, aiohttp.ClientError):
        if isinstance(err, aiohttp.ClientResponseError):
            return err.status >= 500 or err.status in (408, 429)
        return True  # connection refused or reset, payload cut short, server disconnected
    if isinstance(err, OSError):
        return err.errno in _TRANSIENT_ERRNOS
    return False


def _http_answer(err: BaseException) -> tuple[int, str] | None:
    """The status and reason phrase of the HTTP answer behind ``err``, or ``None``.

    fsspec's HTTP filesystem reports every failed request as ``FileNotFoundError(url)``, a 500 or
    a 403 as much as a 404; the answer itself is aiohttp's ``ClientResponseError`` in the chain.
    """
    aiohttp = sys.modules.get("aiohttp")  # only a loaded aiohttp can have raised its errors
    if aiohttp is None:
        return None
    seen: set[int] = set()
    link: BaseException | None = err
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        if isinstance(link, aiohttp.ClientResponseError):
            return int(link.status), _reason(int(link.status), str(link.message or ""))
        link = link.__cause__ or link.__context__
    return None


def _reason(status: int, said: str) -> str:
    """The standard phrase of ``status``, and what the server said when that differs:
    ``"Service Unavailable (failing on purpose)"``."""
    try:
        standard = http.HTTPStatus(status).phrase
    except ValueError:
        return said or "(no reason given)"
    return standard if not said or said == standard else f"{standard} ({said})"


def _described(err: BaseException) -> str:
    """What failed, for a message: the HTTP answer when there was one, else the exception."""
    answer = _http_answer(err)
    if answer is not None:
        return f"the server answered HTTP {answer[0]} {answer[1]}"
    said = f"{coordination._type_name(err)}: {err}"
    # fsspec's HTTP file system says FileNotFoundError(url) for a refused connection too: the
    # exception it came from says what happened.
    cause = err.__cause__ or err.__context__
    if cause is not None and type(cause) is not type(err):
        text = str(cause).strip().splitlines()
        said += f" (from {coordination._type_name(cause)}{': ' + text[0] if text else ''})"
    return said


def _advice(err: BaseException) -> str:
    answer = _http_answer(err)
    if answer is None:
        return "Check that the source is reachable from this machine, then run again."
    if answer[0] in (408, 429):
        return "The server is busy or limits the rate of requests: run again later."
    return (
        "A 5xx answer is a failure of the server, not of this machine or the URL: run again later, "
        "or ask whoever runs the server."
    )


def _http_failure(err: BaseException, what: str, scrub: Scrubber) -> BaseException | None:
    """A ``FileNotFoundError`` that stands for an HTTP answer other than 404/410 (see
    :func:`_http_answer`), as the error that answer means; ``None`` to raise ``err`` as it is. A
    404 or 410 stays a ``FileNotFoundError`` and gets a note naming the status."""
    if isinstance(err, TypeError) and _raised_in_aiohttp(err):
        return _refused_locally(err, what, scrub)  # an upload's request: aiohttp's error as it is
    if not isinstance(err, FileNotFoundError):
        return None
    unsent = _refused_locally(err.__cause__, what, scrub)
    if unsent is not None:
        return unsent
    answer = _http_answer(err)
    if answer is None:
        return None
    status, reason = answer
    said = f"{_rank_label()} {what}: the server answered HTTP {status} {reason}"
    if status in (404, 410):
        if hasattr(err, "add_note"):  # Python >= 3.11; on 3.10 the error goes on without the note
            err.add_note(scrub.text(said))
        return None
    if status in (401, 403):
        return PermissionError(
            scrub.text(
                f"{said}: it refused the request's credentials. Pass the right ones in "
                f"storage_options (for HTTP, an Authorization header in its 'headers'), or check that "
                f"they may read this URL."
            )
        )
    return DistkitError(
        scrub.text(
            f"{said}, a client error that is not retried. Check the URL and the storage_options "
            f"(headers, query parameters) the server expects."
        )
    )


def _raised_in_aiohttp(err: BaseException) -> bool:
    """Whether ``err`` was raised inside aiohttp (its innermost frame is aiohttp's)."""
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and f"{os.sep}aiohttp{os.sep}" in tb.tb_frame.f_code.co_filename


def _refused_locally(cause: BaseException | None, what: str, scrub: Scrubber) -> BaseException | None:
    """The error meant when the HTTP client refused to send a request at all: ``cause``, a
    ``TypeError`` or ``ValueError`` raised before anything went out (an option it does not take,
    credentials in two places), which fsspec reports as ``FileNotFoundError(url)`` when it looks a
    file up; ``None`` for any other ``cause``."""
    aiohttp = sys.modules.get("aiohttp")
    if not isinstance(cause, (TypeError, ValueError)) or (
        aiohttp is not None and isinstance(cause, aiohttp.ClientError)
    ):
        return None
    refused = f"{coordination._type_name(cause)}: {cause}"
    said = f"{_rank_label()} {what}: nothing was sent; the HTTP client refused the request ({refused})"
    unknown = re.search(r"unexpected keyword argument '([^']+)'", str(cause))
    if isinstance(cause, TypeError) and unknown is not None and aiohttp is not None:
        name = unknown.group(1)
        import fsspec

        known = {
            *inspect.signature(fsspec.get_filesystem_class("http")).parameters,
            *inspect.signature(aiohttp.ClientSession._request).parameters,
        }
        close = difflib.get_close_matches(
            name, sorted(known - {"self", "kwargs", "method", "str_or_url"}), n=1
        )
        meant = f" Did you mean {close[0]!r}?" if close else ""
        return TypeError(
            scrub.text(
                f"{said}. storage_options[{name!r}] is no option of fsspec's HTTP file system, which "
                f"hands each option it does not know to every aiohttp request.{meant}"
            )
        )
    return ValueError(scrub.text(f"{said}. Fix the storage_options (or the URL) it names, then run again."))


def _with_retries(fn: Callable[[], T], *, what: str, scrub: Scrubber) -> T:
    attempt = 1
    while True:
        try:
            return fn()
        except Exception as err:
            if not _is_transient(err):
                failure = _http_failure(err, what, scrub)
                if failure is None:
                    raise
                raise failure from err
            if attempt >= _ATTEMPTS:
                raise DistkitError(
                    scrub.text(
                        f"{_rank_label()} {what} failed after {_ATTEMPTS} attempts: {_described(err)}. "
                        f"{_advice(err)}"
                    )
                ) from err
            delay = _RETRY_BASE_S * 2 ** (attempt - 1)
            _log().warning(
                "%s",
                scrub.text(
                    f"{what} failed ({_described(err)}); retrying in {delay:g} s "
                    f"(attempt {attempt + 1} of {_ATTEMPTS})"
                ),
            )
            time.sleep(delay)
            attempt += 1
