"""Credentials kept out of what distkit shows and writes: error messages, exception chains, log
records, and the artefacts of a run (private).

:func:`redact_url` hides the user part and the query values of a URL; :class:`Scrubber` hides the
credentials of one call (its ``storage_options`` and URLs) in text, in exceptions (the whole
``__cause__``/``__context__`` chain) and, while :meth:`Scrubber.active`, in every log record the
process creates, including those of fsspec, aiohttp and botocore. :func:`redact_text`,
:func:`redact_data` and :func:`redact_argv` apply the same URL, header and bearer-token redaction to
what a run writes or sends: its configuration (``config.yaml``, ``hparams.json``, the trackers'
parameters), metric names, and the command line a tracker records.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import re
import threading
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeVar
from urllib.parse import quote, quote_plus, unquote, unquote_plus, urlsplit, urlunsplit

from distkit.errors import DistkitError, MainProcessError

__all__ = [
    "Scrubber",
    "is_credential_key",
    "is_secret_name",
    "redact_argv",
    "redact_data",
    "redact_text",
    "redact_url",
]

T = TypeVar("T")

# A name (of an option, header or query parameter) is a secret's when, lower-cased and without
# separators, it contains one of these: key, secret, token, password/passwd, passphrase,
# credential(s)/creds, auth/Authorization, signature, cookie, bearer, connection_string (adlfs),
# sas (Azure SAS strings).
_SECRET_PARTS = (
    "key",
    "secret",
    "token",
    "passw",
    "passphrase",
    "cred",
    "auth",
    "signature",
    "cookie",
    "bearer",
    "connectionstring",
    "sas",
)
# ...or when one of its words is one of these, which as substrings are in ordinary names (path,
# pattern, design): sig (Azure SAS signature), pat (personal access token), pwd, pass.
_SECRET_WORDS = frozenset({"sig", "pat", "pwd", "pass"})
# Secrets at least this long are replaced wherever they occur; shorter ones only as whole words,
# so that a 3-letter password does not blank out every word that contains those letters.
_SUBSTRING_MIN_LEN = 6
# Parts of a secret (a token after "Bearer", a cookie's value) that are replaced on their own too,
# since servers quote them back without the rest; shorter parts are scheme words like "Bearer".
_PIECE_MIN_LEN = 8
_REDACTED = "***"
# Credentials that need no configured value to be recognised: URLs (their user part and query
# values), the values of credential headers however a library prints them ('Authorization':
# 'Bearer ...', Cookie: a=b, b'AWS4-HMAC-SHA256 Credential=...'), and bearer tokens.
_URL_RE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]*[^\s'\"<>).,;:]")
_HEADER_RE = re.compile(
    r"(?i)\b((?:proxy-)?authorization|(?:set-)?cookie|x-api-key|api-key|x-auth-token|"
    r"x-amz-security-token|x-goog-api-key|ocp-apim-subscription-key)"
    r"(['\"]?\s*[:=]\s*b?['\"]?)([^'\"\r\n]+)"
)
_BEARER_RE = re.compile(r"(?i)\b(bearer\s+)[A-Za-z0-9._~+/=-]{8,}")


def is_secret_name(name: str) -> bool:
    """Whether an option, header or query parameter called ``name`` holds a credential.

    Case-insensitive; see the module's word lists. ``"X-Api-Key"``, ``"client_secret"``,
    ``"sas_token"``, ``"connection_string"``, ``"sig"`` and ``"github_pat"`` do; ``"path"`` and
    ``"endpoint_url"`` do not.
    """
    compact = re.sub(r"[^a-z0-9]", "", name.lower())
    if any(part in compact for part in _SECRET_PARTS):
        return True
    words = {word.lower() for word in re.findall(r"[A-Z]+(?![a-z])|[A-Z]?[a-z0-9]+", name)}
    return not words.isdisjoint(_SECRET_WORDS)


# Words that name a credential in a configuration key (is_credential_key), and the beginnings and
# endings of compound words that do (apikey, hf_token, aws_secret_access_key, db_password).
_CREDENTIAL_WORDS = frozenset(
    {
        "key",
        "secret",
        "token",
        "password",
        "passwd",
        "passphrase",
        "credential",
        "credentials",
        "creds",
        "auth",
        "authorization",
        "signature",
        "cookie",
        "bearer",
        "connectionstring",
        *_SECRET_WORDS,
        *_SECRET_PARTS,
    }
)
_CREDENTIAL_ENDINGS = (
    "apikey",
    "accesskey",
    "secretkey",
    "privatekey",
    "secret",
    "token",
    "password",
    "passwd",
)
_CREDENTIAL_BEGINNINGS = ("passw", "secret", "credential")
# Nesting deeper than this is not configuration data (a cycle, or an object graph): left as it is.
_MAX_DEPTH = 32


def is_credential_key(name: str) -> bool:
    """Whether a configuration key called ``name`` holds a credential, so that its text is hidden.

    Narrower than :func:`is_secret_name`, which decides for storage options and headers: a
    configuration's names are a model's and a dataset's (``tokenizer``, ``max_tokens``, ``keys``,
    ``author``), and hiding their values would break the saved config. A key is a credential's
    when one of its words (split at ``_``, ``-``, ``.`` and case changes) is one (``key``,
    ``token``, ``secret``, ``password``, ``auth``, ``sig``, ``sas``...), or ends like one
    (``apikey``, ``hftoken``, ``dbpassword``).

    Example:
        >>> names = ("api_key", "hf_token", "AWS_SECRET_ACCESS_KEY", "tokenizer", "keys")
        >>> [is_credential_key(name) for name in names]
        [True, True, True, False, False]
    """
    words = [word.lower() for word in re.findall(r"[A-Z]+(?![a-z])|[A-Z]?[a-z0-9]+", name)]
    return any(
        word in _CREDENTIAL_WORDS
        or word.endswith(_CREDENTIAL_ENDINGS)
        or word.startswith(_CREDENTIAL_BEGINNINGS)
        for word in words
    )


def redact_text(text: str) -> str:
    """``text`` with the credentials that need no configured value to be recognised replaced by
    ``***``: a URL's user part and query values (as :func:`redact_url`), the values of credential
    headers, and bearer tokens.

    Example:
        >>> redact_text("saving to memory://AK:pw@bucket/run?token=t0k")
        'saving to memory://***@bucket/run?token=***'
    """
    return _redact_patterns(text)


def redact_data(value: Any, *, secret: bool = False) -> Any:
    """A copy of configuration data (mappings, lists, strings, numbers) fit to be written or sent:
    every string (keys included) through :func:`redact_text`, and every string under a key that
    :func:`is_credential_key` names, at any depth, replaced by ``***`` whole. Numbers, booleans and
    ``None`` stay; another object stays unless its text shows a credential (then it is that text,
    redacted). Idempotent: redacting redacted data changes nothing.

    Args:
        value: The data.
        secret: Whether ``value`` is itself a credential's (the value of such a key).

    Example:
        >>> redact_data({"dirpath": "s3://AK:pw@b/run", "api_token": "t0k", "tokenizer": "gpt2"})
        {'dirpath': 's3://***@b/run', 'api_token': '***', 'tokenizer': 'gpt2'}
    """
    return _redact_data(value, secret, 0)


def _redact_data(value: Any, secret: bool, depth: int) -> Any:
    if value is None or isinstance(value, (bool, int, float, complex)):
        return value
    if isinstance(value, str):
        return _REDACTED if secret and value else redact_text(value)
    if isinstance(value, (bytes, bytearray)):
        return _REDACTED.encode() if secret and value else value
    if depth > _MAX_DEPTH:
        return value
    if isinstance(value, Mapping):
        return {
            (redact_text(key) if isinstance(key, str) else key): _redact_data(
                item, secret or (isinstance(key, str) and is_credential_key(key)), depth + 1
            )
            for key, item in value.items()
        }
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [_redact_data(item, secret, depth + 1) for item in value]
        return items if isinstance(value, list) else tuple(items)
    try:
        text = str(value)
    except Exception:  # a broken __str__: nothing of it is shown
        return value
    if secret:
        return _REDACTED
    cleaned = redact_text(text)
    return value if cleaned == text else cleaned


def redact_argv(argv: Iterable[str]) -> list[str]:
    """A command line fit to be recorded: each argument through :func:`redact_text`, and the value
    of an option whose last name part is a credential key (``--data.api_token VALUE``,
    ``--data.api_token=VALUE``) replaced by ``***``.

    Example:
        >>> redact_argv(["--data.url", "s3://AK:pw@b/x", "--data.api_token", "t0k", "--lr=0.1"])
        ['--data.url', 's3://***@b/x', '--data.api_token', '***', '--lr=0.1']
    """
    cleaned: list[str] = []
    hide_next = False
    for argument in argv:
        if hide_next and not argument.startswith("-"):
            cleaned.append(_REDACTED)
            hide_next = False
            continue
        hide_next = False
        if argument.startswith("-"):
            name, equals, _ = argument.lstrip("-").partition("=")
            if is_credential_key(name.rpartition(".")[2]):
                if equals:
                    cleaned.append(argument.partition("=")[0] + "=" + _REDACTED)
                    continue
                hide_next = True
        cleaned.append(redact_text(argument))
    return cleaned


def _redact_fields(query: str) -> str:
    # Every value goes, not only those with credential-looking names: a signed URL's parameters
    # are named by its issuer, and their names are enough to debug with.
    fields = []
    for field in query.split("&"):
        name, sep, _ = field.partition("=")
        fields.append(f"{name}={_REDACTED}" if sep else _REDACTED)
    return "&".join(fields)


def _chain_links(url: str) -> list[str]:
    # fsspec chains URLs with "::"; the "::" of an IPv6 address ("http://[::1]:80/") is inside brackets.
    return re.split(r"::(?![^\[]*\])", url)


def redact_url(url: str) -> str:
    """``url`` with its user part and the values of its query parameters replaced by ``***``.

    Anything without ``://`` (a local path) is returned as it is; each link of a chained fsspec URL
    (``simplecache::s3://...``) is redacted on its own.

    Example:
        >>> redact_url("https://user:pw@host/data.bin?sig=abc&se=2030")
        'https://***@host/data.bin?sig=***&se=***'
    """
    links = _chain_links(url)
    if len(links) > 1:
        return "::".join(redact_url(link) for link in links)
    if "://" not in url:
        return url
    try:
        parts = urlsplit(url)
    except ValueError:  # a malformed netloc: keep only the scheme
        return url.partition("://")[0] + "://" + _REDACTED
    if "@" not in parts.netloc and not parts.query and "=" not in parts.fragment:
        return url
    netloc = parts.netloc
    if "@" in netloc:
        netloc = f"{_REDACTED}@{netloc.rpartition('@')[2]}"
    fragment = _redact_fields(parts.fragment) if "=" in parts.fragment else parts.fragment
    query = _redact_fields(parts.query) if parts.query else ""
    return urlunsplit((parts.scheme, netloc, parts.path, query, fragment))


def _redact_patterns(text: str) -> str:
    text = _URL_RE.sub(lambda match: redact_url(match.group(0)), text)
    text = _HEADER_RE.sub(lambda match: f"{match.group(1)}{match.group(2)}{_REDACTED}", text)
    return _BEARER_RE.sub(lambda match: f"{match.group(1)}{_REDACTED}", text)


def _basic_auth(login: str, password: str) -> str:
    return base64.b64encode(f"{login}:{password}".encode()).decode("ascii")


class _SecretSet:
    """Collects the strings to hide, with the forms a library may print them in."""

    def __init__(self) -> None:
        self.values: set[str] = set()

    def add(self, value: str, *, whole: bool = True, pieces: bool = True) -> None:
        """Hide ``value`` (``whole``) and its parts of 8 characters or more (``pieces``), in each
        form a library may print them in."""
        if not value or not value.strip("*"):
            return
        for form in {value, unquote(value), unquote_plus(value), quote(value, safe=""), quote_plus(value)}:
            if whole:
                self.values.add(form)
            if not pieces:
                continue
            for piece in re.split(r"[\s;,=&]+", form):
                if len(piece) >= _PIECE_MIN_LEN:
                    self.values.add(piece)
        scheme, _, credentials = value.strip().partition(" ")
        if scheme.lower() == "basic" and credentials:  # an Authorization header: its password too
            with contextlib.suppress(ValueError, UnicodeDecodeError):
                self.add(base64.b64decode(credentials, validate=True).decode().partition(":")[2])

    def visit(self, obj: Any, *, secret: bool, depth: int = 0) -> None:
        if depth > 8:  # option values are plain data; this only stops a cycle
            return
        if isinstance(obj, Mapping):
            for name, value in obj.items():
                named = secret or (isinstance(name, str) and is_secret_name(name))
                self.visit(value, secret=named, depth=depth + 1)
        elif isinstance(obj, (list, tuple, set, frozenset)):
            items = list(obj)
            if secret and len(items) >= 2 and isinstance(items[0], str) and isinstance(items[1], str):
                # A (login, password) pair such as aiohttp.BasicAuth: its header form too.
                self.add(_basic_auth(items[0], items[1]))
            for item in items:
                self.visit(item, secret=secret, depth=depth + 1)
        elif isinstance(obj, (str, bytes)):
            if secret:
                self.add(obj.decode(errors="replace") if isinstance(obj, bytes) else obj)
        elif secret and hasattr(obj, "__dict__"):  # a credentials object: its string attributes
            self.visit(vars(obj), secret=True, depth=depth + 1)

    def add_url(self, url: str) -> None:
        for link in _chain_links(url):
            if "://" not in link:
                continue
            try:
                parts = urlsplit(link)
                username, password = parts.username, parts.password
            except ValueError:
                continue
            if password:
                self.add(password)
                self.add(_basic_auth(unquote(username or ""), unquote(password)))
            elif username:  # a token used as the user name (https://TOKEN@host/...)
                self.add(username)
            for part in (parts.query, parts.fragment):
                if not part:
                    continue
                # The whole query, but not its pieces: the parameters' names are among them, and
                # names stay shown (redact_url keeps them; they are what a reader debugs with).
                self.add(part, pieces=False)
                for field in part.split("&"):
                    name, sep, value = field.partition("=")
                    # A bare field (?TOKEN) is all value, hidden whole as redact_url hides it; so is
                    # a value under a credential's name, however short. Any other value by its
                    # pieces of 8 characters or more: an issuer's own names (X-Amz-Credential's
                    # neighbours, Azure's skoid) may still carry ids worth hiding.
                    whole = not sep or is_secret_name(unquote_plus(name))
                    value = value if sep else name
                    self.add(value, whole=whole)
                    self.add(unquote_plus(value), whole=whole)  # and its percent-encodings


def _safe_text(describe: Callable[[Any], str], value: Any) -> str:
    try:
        return describe(value)
    except Exception:  # a broken __repr__ must not hide the original error
        return ""


def _chain(err: BaseException) -> list[BaseException]:
    """``err`` and every exception reachable from it: causes, contexts (suppressed or not),
    members of exception groups."""
    found: list[BaseException] = []
    seen: set[int] = set()
    stack: list[BaseException | None] = [err]
    while stack:
        exc = stack.pop()
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        found.append(exc)
        stack.extend((exc.__context__, exc.__cause__))
        stack.extend(getattr(exc, "exceptions", ()) or ())
    return found


def _everything_shown(err: BaseException) -> str:
    # What any code could print of the chain: str, repr, args and attributes of each member
    # (aiohttp puts the request's headers into an attribute that only repr shows), notes, and
    # the formatted traceback.
    parts = [_safe_text(lambda e: "".join(traceback.format_exception(type(e), e, e.__traceback__)), err)]
    for exc in _chain(err):
        parts += [_safe_text(str, exc), _safe_text(repr, exc), _safe_text(repr, exc.args)]
        parts += [_safe_text(repr, value) for value in getattr(exc, "__dict__", {}).values()]
        parts += [_safe_text(str, note) for note in getattr(exc, "__notes__", ()) or ()]
    return "\n".join(parts)


def _type_name(exc: BaseException) -> str:
    cls = type(exc)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


class Scrubber:
    """Hides the credentials of one call in text, exceptions and, while active, log records.

    The credentials are the values of ``options`` under secret names (:func:`is_secret_name`, at
    any depth: ``client_kwargs``, ``headers``), the user part and query values of ``urls``, in the
    forms libraries print them in (percent-encoded or not, an ``Authorization: Basic`` header);
    any URL's user part and query values, credential headers and bearer tokens are hidden too.

    Example:
        >>> scrub = Scrubber({"headers": {"Authorization": "Bearer abc123def"}}, "https://h/x?sig=s1gn4ture")
        >>> scrub.text("401: sent 'Bearer abc123def' to https://h/x?sig=s1gn4ture")
        "401: sent '***' to https://h/x?sig=***"
        >>> result = scrub.call(fetch, url)  # doctest: +SKIP
    """

    def __init__(self, options: Any = None, *urls: str) -> None:
        found = _SecretSet()
        found.visit(options, secret=False)
        for url in urls:
            found.add_url(url)
        # Longest first, so that a secret containing another is replaced whole.
        values = sorted(found.values, key=lambda s: (-len(s), s))
        alternatives = [
            re.escape(s)
            if len(s) >= _SUBSTRING_MIN_LEN
            else rf"(?<![A-Za-z0-9]){re.escape(s)}(?![A-Za-z0-9])"
            for s in values
        ]
        self._pattern = re.compile("|".join(alternatives)) if alternatives else None

    def text(self, text: str) -> str:
        """``text`` with every credential replaced by ``***``."""
        # The patterns first: they keep a URL's parameter names, which replacing a whole query
        # string as one secret would not.
        text = _redact_patterns(text)
        return self._pattern.sub(_REDACTED, text) if self._pattern is not None else text

    def url(self, url: str) -> str:
        """``url`` as it may be shown: :func:`redact_url`, then :meth:`text`."""
        return self.text(redact_url(url))

    def clean(self, err: BaseException) -> BaseException:
        """``err`` itself when nothing in it or its chain shows a credential, else a scrubbed copy.

        The copy has ``err``'s type when that is a built-in exception or :class:`DistkitError`
        (a ``FileNotFoundError`` stays one), a :class:`DistkitError` otherwise; its message holds
        the messages of the whole chain, scrubbed, but none of the original objects.
        """
        shown = _everything_shown(err)
        if self.text(shown) == shown:
            return err
        if isinstance(err, MainProcessError):
            return MainProcessError(
                self.text(str(err)),
                exc_type=err.exc_type,
                exc_message=self.text(err.exc_message),
                remote_traceback=self.text(err.remote_traceback),
            )
        causes = ""
        seen = {id(err)}
        link = err.__cause__ or (None if err.__suppress_context__ else err.__context__)
        while link is not None and id(link) not in seen:
            seen.add(id(link))
            causes += f" (caused by {_type_name(link)}: {_safe_text(str, link)})"
            link = link.__cause__ or (None if link.__suppress_context__ else link.__context__)
        message = _safe_text(str, err)
        replacement: BaseException | None = None
        if type(err).__module__ == "builtins" or type(err) is DistkitError:
            with contextlib.suppress(Exception):
                replacement = type(err)(self.text(message + causes))
        if replacement is None:
            replacement = DistkitError(self.text(f"{_type_name(err)}: {message}{causes}"))
        if isinstance(err, OSError) and isinstance(replacement, OSError):
            replacement.errno = err.errno
        for note in getattr(err, "__notes__", ()) or ():
            if hasattr(replacement, "add_note"):  # Python >= 3.11
                replacement.add_note(self.text(str(note)))
        return replacement

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` with log records scrubbed meanwhile; what it raises is :meth:`clean`-ed."""
        with self.active():
            try:
                return fn(*args)
            except Exception as err:
                failure = self.clean(err)
                if failure is err:
                    raise
        # Raised outside the except block, so the scrubbed error has no context holding a secret.
        raise failure

    @contextlib.contextmanager
    def active(self) -> Iterator[Scrubber]:
        """Scrub every log record the process creates (any logger, any thread) until the block ends.

        fsspec's async filesystems log from their own event-loop thread, so the scrubbing cannot be
        limited to the calling thread; records without a credential are left as they are.
        """
        _activate(self)
        try:
            yield self
        finally:
            _deactivate(self)


# Scrubbers of the calls in progress, replaced whole (never mutated) so the record factory can read
# it without a lock.
_active: tuple[Scrubber, ...] = ()
_active_lock = threading.Lock()
_installed_factory: Callable[..., logging.LogRecord] | None = None


def _activate(scrubber: Scrubber) -> None:
    global _active
    with _active_lock:
        # Installed again if someone set another factory since (one that wraps ours scrubs twice,
        # which changes nothing).
        if logging.getLogRecordFactory() is not _installed_factory:
            _install_record_factory()
        _active = (*_active, scrubber)


def _deactivate(scrubber: Scrubber) -> None:
    global _active
    with _active_lock:
        items = list(_active)
        for index, item in enumerate(items):
            if item is scrubber:
                del items[index]
                break
        _active = tuple(items)


def _install_record_factory() -> None:
    # A record factory sees every record of every logger and thread when it is created, before
    # any handler or filter (a filter on the root logger would miss records of other loggers,
    # and one on each handler would miss handlers added later). Installed on first use and left
    # in place; with no call in progress it costs one global read per record.
    global _installed_factory
    previous = logging.getLogRecordFactory()

    def scrubbing_factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        scrubbers = _active
        if scrubbers:
            _scrub_record(record, scrubbers)
        return record

    logging.setLogRecordFactory(scrubbing_factory)
    _installed_factory = scrubbing_factory


def _scrub_all(text: str, scrubbers: Iterable[Scrubber]) -> str:
    for scrubber in scrubbers:
        text = scrubber.text(text)
    return text


def _scrub_record(record: logging.LogRecord, scrubbers: tuple[Scrubber, ...]) -> None:
    try:
        message = record.getMessage()
    except Exception:
        return  # a malformed record: logging reports it when it is emitted
    cleaned = _scrub_all(message, scrubbers)
    if cleaned != message:
        record.msg, record.args = cleaned, ()
    if record.exc_info and record.exc_info[1] is not None:
        text = _safe_text(lambda info: "".join(traceback.format_exception(*info)), record.exc_info)
        cleaned = _scrub_all(text, scrubbers)
        if cleaned != text:
            # Formatters print exc_text when exc_info is gone; the original objects must not reach
            # a handler that formats them itself.
            record.exc_info, record.exc_text = None, cleaned.rstrip("\n")
    if record.stack_info:
        record.stack_info = _scrub_all(record.stack_info, scrubbers)
