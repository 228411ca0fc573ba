"""Byte-level access to checkpoint storage through fsspec (``file://`` or a plain path, ``memory://``, ``s3://``).

Retries transient errors with bounded exponential backoff, checks the storage before training
(``validate``), and keeps credentials out of every message, log line and location string.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import inspect
import logging
import math
import os
import random
import re
import stat
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar
from urllib.parse import unquote

import fsspec
import fsspec.core

from elastic.config import ConfigError, env_number
from elastic.redact import USERINFO, is_credential, redact_url, redact_urls_in

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Schemes of object stores (s3fs, gcsfs, adlfs, ossfs): no directories (no makedirs, and a missing
# "directory" is just an empty listing), and a URL starts with a bucket (container) name.
_OBJECT_STORES = ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "oss")
_S3 = ("s3", "s3a")
_LOCAL = ("file", "local")

# storage_options keys whose values are secrets. Values of any key that merely *looks* secret are
# redacted too, so a new backend's credential option cannot leak by omission.
# "pass" covers password, passwd and passphrase (SFTP's key file); "pwd" and "bearer" what some
# backends call a password or a token. Not "pw" alone: as a part of a word it matches too much.
_SECRET_KEY_HINTS = ("secret", "token", "pass", "pwd", "credential", "key", "sas", "signature", "auth", "bearer",
                     "connection_string", "cookie")

# Errors that retrying cannot fix. Everything else (OSError, botocore/aiohttp connection errors,
# timeouts) is treated as transient.
_PERMANENT = (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError, FileExistsError,
              ValueError, TypeError, KeyError, NotImplementedError, ConfigError, MemoryError, OverflowError)
# MemoryError and OverflowError: a read whose bytes do not fit (or whose range does not fit an
# index) fails the same way on every try. Retried as transient, one was reported as a storage
# outage, and a resume waited ``resume_timeout_s`` for storage that was up all along.
# Plain OSErrors that retrying cannot fix either: s3fs turns S3's InvalidArgument, InvalidRequest,
# InvalidBucketName and KeyTooLongError into EINVAL or ENAMETOOLONG, and a local disk that is full,
# over quota or read-only says so by errno. Retried as transient, each cost a step ~1 s of sleeps in
# blocking mode and was reported as an outage ("storage_outage") rather than a refusal.
# botocore's errors for credentials it cannot find or read, by name (botocore comes with s3fs,
# and is not imported here): the same on every try in this process. Retried as transient, a
# controller or node without credentials was an "outage", and a resume waited resume_timeout_s
# for storage that answered the driver.
# And botocore's checks of a request or of its client's settings before anything is sent
# (ParamValidationError: a bucket named "my bucket"; an addressing style or a setting it does not
# know), which s3fs passes through as they are: retried, each was reported as storage down.
_PERMANENT_NAMES = frozenset({"NoCredentialsError", "PartialCredentialsError", "ProfileNotFound",
                              "ParamValidationError", "InvalidConfigError", "InvalidS3AddressingStyleError"})
# Of those, the ones a later lookup can cure: the process's filesystems are dropped and the next
# call makes another, whose client looks its credentials up again (``Storage._forget_filesystem``),
# at most once per CREDENTIALS_LOOKUP_S: with none to be found, each lookup runs botocore's whole
# chain (the instance-metadata endpoint's timeouts included).
_CREDENTIALS_LOST = frozenset({"NoCredentialsError", "PartialCredentialsError"})
# S3's answers for credentials gone stale: temporary ones expired (a token a sidecar or a cron
# rewrites in ~/.aws, static to botocore), keys rotated in the file. The client holds them for
# the process, so without a new lookup no write succeeded again and no step committed for the
# rest of the run. Permanent or not (TokenRefreshRequired is retried), each drops the filesystem.
_CREDENTIALS_STALE_CODES = frozenset({"ExpiredToken", "ExpiredTokenException", "InvalidToken",
                                      "InvalidAccessKeyId", "TokenRefreshRequired"})
CREDENTIALS_LOOKUP_S = 10.0
_credentials_forgotten_at = -math.inf  # time.monotonic() of the last drop, in this process
_PERMANENT_ERRNOS = frozenset({errno.EINVAL, errno.ENAMETOOLONG, errno.EMSGSIZE, errno.EROFS, errno.ENOSPC,
                               errno.EDQUOT})
# S3 error codes whose errno says otherwise than the error (s3fs maps codes to errnos: its table,
# s3fs/errors.py, keeps the ClientError as the OSError's cause). Transient under EINVAL: a body cut
# short or garbled on the way (IncompleteBody, BadDigest: the next try sends it whole) and
# temporary credentials to refresh (TokenRefreshRequired: botocore refreshes them on the next
# request). Taken for refusals, one dropped a step's part for a blip. Permanent though their
# errno is no refusal: a bucket in another region or behind another endpoint (PermanentRedirect,
# 301) and an operation the endpoint lacks (NotImplemented, 501). Retried as an outage, each cost
# a write its retries, and the event said to wait for storage that will never take it.
_S3_TRANSIENT_CODES = frozenset({"IncompleteBody", "BadDigest", "TokenRefreshRequired"})
_S3_PERMANENT_CODES = frozenset({"PermanentRedirect", "301", "NotImplemented", "501"})


def _s3_error_code(exc: BaseException) -> str | None:
    """The S3 error code of an error s3fs translated from botocore's ClientError (its cause)."""
    cause = exc.__cause__
    response = getattr(cause, "response", None)
    if isinstance(response, dict):
        code = (response.get("Error") or {}).get("Code")
        return str(code) if code is not None else None
    return None


def _permanent(exc: BaseException) -> bool:
    """Whether retrying cannot fix ``exc`` (a refusal), as opposed to a transient error."""
    code = _s3_error_code(exc)
    if code in _S3_TRANSIENT_CODES:
        return False
    if code in _S3_PERMANENT_CODES:
        return True
    return (isinstance(exc, _PERMANENT) or type(exc).__name__ in _PERMANENT_NAMES
            or (isinstance(exc, OSError) and exc.errno in _PERMANENT_ERRNOS))


def _write_local(path: str, parts: list) -> None:
    """A local file written whole or not at all, and durable before this returns.

    Written to a temporary name beside it, fsynced, renamed over ``path``, and the directory
    fsynced. Why: written in place, a reader (a resume, ``elastic checkpoints`` on a live run)
    could open the manifest between its truncation and its last byte and take a committed step
    for corrupt; and without the directory's fsync the entry of a file that reached the disk
    need not have (POSIX), so a crash could lose the newest manifest after retention had
    deleted the older steps. The fsync of each file keeps the order the commit relies on: the
    manifest reaches the disk after the shards it vouches for. A temporary file left by a crash
    goes with its step's directory (retention, or the sweep of uncommitted ones)."""
    directory = os.path.dirname(path)
    _make_dirs_durable(directory)
    tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
    try:
        with open(tmp, "wb") as f:
            for part in parts:
                f.write(part)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(directory)


def _make_dirs_durable(directory: str) -> None:
    """``os.makedirs``, and each directory it creates made durable in its parent: a step's new
    directory is an entry of the run's, and without that directory's fsync a crash could lose
    the whole step, manifest and all, whose files were fsynced (POSIX)."""
    created, d = [], directory
    while d and not os.path.isdir(d):
        created.append(d)
        parent = os.path.dirname(d)
        if parent == d:
            break
        d = parent
    if not created:
        return
    os.makedirs(directory, exist_ok=True)
    for d in created:  # deepest first
        _fsync_dir(os.path.dirname(d) or ".")


def _fsync_dir(directory: str) -> None:
    """fsync a directory (its entries durable). A filesystem whose directories take no fsync
    (Linux answers EINVAL, or ENOTSUP: some SMB/CIFS and FUSE mounts) is left as it is, as SQLite
    and LevelDB leave it: the file is whole under its final name already, and with EINVAL taken
    for a refusal every shard and manifest write failed, while the storage check (which writes
    through the filesystem's own call) had passed."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
    finally:
        os.close(fd)


class StorageError(RuntimeError):
    """A storage operation failed. The message is already redacted."""


class StorageUnavailable(StorageError):
    """A storage operation kept failing with transient errors after every retry."""


class FileRefused(StorageError):
    """A file that is not what a checkpoint writes, so it was not read (or not whole): not a
    regular file (a FIFO, a device, a directory) or larger than the bound the caller read it
    with. About the file, not the storage: permanent, and a checkpoint's reader takes it for a
    corrupt step. ``reason``: the message without the file's location."""

    def __init__(self, reason: str, where: str = ""):
        super().__init__(f"{where} refused: {reason}" if where else reason)
        self.reason, self.where = reason, where

    def __reduce__(self):
        # Rebuilt from its fields when pickled (it may cross to another process, as the other
        # errors do); the default (the message as the only argument) would nest the location.
        return type(self), (self.reason, self.where)


def _read_local(path: str, limit: int | None) -> bytes:
    """The regular file ``path``: all of it, or at most ``limit`` bytes.

    Opened without blocking and checked before a byte is read. Why: a FIFO under a manifest's
    name blocked ``open`` for good (a resume, and the cleanup thread under its lock), and a
    link to ``/dev/zero`` was read without end. And the bytes asked for are bounded by the
    file's own size, not only by ``limit``: a read allocates what it asks for up front, and a
    manifest's record that says 2**40 bytes must cost no more than the file holds. The file
    growing after the ``fstat`` still shows: one byte past its size is asked for."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FileRefused("not a regular file (a FIFO, a device or a directory); checkpoints write none")
    except BaseException:
        os.close(fd)
        raise
    with open(fd, "rb") as f:  # owns fd from here: closed on every way out
        return f.read() if limit is None else f.read(min(limit, st.st_size + 1))


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded exponential backoff: ``attempts`` tries, sleeping base_s, 2*base_s, ... capped at max_s.

    Environment variables override the defaults so tests (and impatient operators) can make it tiny.
    """

    attempts: int = field(default_factory=lambda: env_number("ELASTIC_STORAGE_ATTEMPTS", 4))
    base_s: float = field(default_factory=lambda: env_number("ELASTIC_STORAGE_BACKOFF_S", 0.2))
    max_s: float = field(default_factory=lambda: env_number("ELASTIC_STORAGE_BACKOFF_MAX_S", 5.0))

    def delay_s(self, attempt: int) -> float:
        """Sleep before retry number ``attempt`` (0-based), with jitter so ranks do not retry in lockstep."""
        # The exponent capped: past ~1,000 retries (ELASTIC_STORAGE_ATTEMPTS allows it, an outage
        # of over an hour) base_s * 2**attempt no longer fits a float, an OverflowError inside a retry.
        return min(self.max_s, self.base_s * (2.0 ** min(attempt, 60))) * random.uniform(0.5, 1.0)


# The pauses between lookups of S3 credentials in a node's check at a run's start (``check_here``),
# all of them within _CREDENTIALS_PATIENCE_S: botocore answers a lookup that timed out or was
# throttled (the instance-metadata endpoint, with a node's many processes asking at once) as "no
# credentials", the same as none to be found. Mid-run such a miss is looked up again, at most once
# per CREDENTIALS_LOOKUP_S (``Storage._forget_filesystem``); at the start it ended the run.
_CREDENTIALS_RETRY = RetryPolicy(attempts=4, base_s=0.5, max_s=2.0)
# How long those lookups and pauses may take together: no lookup starts unless it would end by
# then, taking it to last as long as the slowest one so far. A lookup on a node outside AWS whose
# instance-metadata address drops packets takes ~2 s (botocore waits 1 s on each of its requests
# there), so 5 s still holds a second lookup after a blip, and at worst (a lookup slower than
# those before it) the check ends a couple of seconds past 5 s, well under 10 s. Bounded only by
# CREDENTIALS_LOOKUP_S (10 s, checked before each sleep alone), a lookup could start near 9.5 s
# and the check run ~12 s: a rank that writes checkpoints in-process runs it in its configure
# call, which the controller gives collective_timeout_s, and with a short one killed it as hung
# where it should have reported the ConfigError naming its node.
_CREDENTIALS_PATIENCE_S = 5.0


def looks_secret(key: Any) -> bool:
    """Whether a storage_options key looks like it holds a credential (``_SECRET_KEY_HINTS``)."""
    return any(h in str(key).lower() for h in _SECRET_KEY_HINTS)


def _secret_values(options: Any, secret: bool = False) -> set[str]:
    """Every string (or number: a secret that happens to be all digits, parsed as one) in
    storage_options stored under a key that looks like a credential, at any depth below it:
    ``auth=("user", "pass")`` and ``headers={"Authorization": ...}`` as much as ``secret=...``;
    the value of a (name, value) pair whose name looks like one, under any key
    (``{"headers": [("Authorization", "Bearer ...")]}``: aiohttp takes headers as a list of
    pairs); and bytes, as text and as their repr shows them."""
    found: set[str] = set()
    if isinstance(options, Mapping):
        for key, value in options.items():
            found |= _secret_values(value, secret or looks_secret(key))
    elif isinstance(options, (list, tuple)):
        named = len(options) == 2 and isinstance(options[0], (str, bytes)) and looks_secret(options[0])
        for i, value in enumerate(options):
            found |= _secret_values(value, secret or (named and i == 1))
    elif isinstance(options, (set, frozenset)):
        for value in options:
            found |= _secret_values(value, secret)
    elif secret and isinstance(options, (bytes, bytearray)):
        found |= {bytes(options).decode("utf-8", "backslashreplace"), repr(bytes(options))[2:-1]}
    elif secret and isinstance(options, (str, int, float)) and not isinstance(options, bool):
        if len(str(options)) >= 4:  # a 1-3 character "secret" would redact half of every message
            found.add(str(options))
    return found


class Redactor:
    """Replaces known secret values, and the userinfo and query string of any URL, in text with ``***``."""

    # Where botocore finds credentials when storage_options name none: a process that opens s3://
    # storage hides their values too (``Storage._filesystem``), as botocore's errors and the
    # repr of its requests can show them.
    AWS_ENVIRONMENT = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN")

    def __init__(self, storage_options: dict | None, extra: tuple[str, ...] = ()):
        options = storage_options or {}
        self._secrets: set[str] = set()
        self._pattern: re.Pattern | None = None
        self.hide(*_secret_values(options), *extra)

    def hide(self, *secrets: str) -> None:
        """Hide ``secrets`` too (those under 4 characters would redact half of every message)."""
        known = self._secrets | {s for s in secrets if s and len(s) >= 4}
        if known == self._secrets:
            return
        # Each secret also as text shows it once escaped: percent-encoded in a URL or a signed
        # request's canonical form, JSON-escaped in a JSON body or log line, as Python's repr
        # writes it inside a dict of options. Longest first, so a form that contains another
        # is replaced whole.
        import json
        from urllib.parse import quote, quote_plus

        forms = {form for s in known
                 for form in (s, quote(s, safe=""), quote(s), quote_plus(s), json.dumps(s)[1:-1], repr(s)[1:-1])}
        pattern = re.compile("|".join(re.escape(f) for f in sorted(forms, key=len, reverse=True)))
        self._secrets, self._pattern = known, pattern  # __call__ reads the pattern once: the old one or this

    def __call__(self, text: str) -> str:
        text = redact_urls_in(str(text))
        pattern = self._pattern
        return pattern.sub("***", text) if pattern is not None else text


def _join(*parts: str) -> str:
    """Join path parts with '/'; fsspec paths are POSIX-style on every backend."""
    out = parts[0].rstrip("/")
    for part in parts[1:]:
        part = part.strip("/")
        if part:
            out = f"{out}/{part}" if out else part
    return out


_SCHEME_TYPO = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):(?!//)")  # 2+ letters: "C:" is a drive, not a scheme


def resolve_url(url: str) -> str:
    """Make a local path absolute (``~`` expanded), plain or ``file://``/``local://``, so every
    process (each with its own cwd and no say in it) means the same place; refuse what would
    quietly be written somewhere the user did not mean.

    - ``file://ckpt`` is relative to the cwd of whichever process opens it: the controller
      and each worker would resolve it apart. ``~`` is expanded here, before ``abspath``
      would make it ``<cwd>/~``.
    - ``s3:/bucket/x`` (one slash) has no scheme to fsspec and would be a local directory named
      ``s3:``, the credentials ignored: a known scheme not followed by ``//`` is an error.
    - An object store URL with no bucket (``s3://``, ``gs://``, ``az://``) would take the run
      name as its bucket."""
    if not url.strip():
        raise ConfigError("RunConfig.storage is empty; give a URL (file:///dir, memory://name, s3://BUCKET/prefix) "
                          "or a path.")
    protocol, path = fsspec.core.split_protocol(url)
    if protocol is None:
        typo = _SCHEME_TYPO.match(url)
        if typo and typo.group(1).lower() in fsspec.available_protocols():
            scheme = typo.group(1)
            raise ConfigError(f"RunConfig.storage starts with '{scheme}:' but not '{scheme}://'; write "
                              f"{scheme}://BUCKET/prefix (or ./{scheme}:... for a local directory of that name).")
        return os.path.abspath(os.path.expanduser(url))
    if protocol in _LOCAL:
        if not path:  # abspath("") is the cwd of whichever process asks
            raise ConfigError(f"RunConfig.storage='{protocol}://' names no directory; use {protocol}:///absolute/path.")
        return f"{protocol}://{os.path.abspath(os.path.expanduser(path))}"
    if protocol in _OBJECT_STORES and not path.strip("/"):
        raise ConfigError(f"RunConfig.storage='{protocol}://' names no bucket; use {protocol}://BUCKET/prefix.")
    if protocol in _OBJECT_STORES:
        # "s3://b/runs/" and "s3://b/runs//" mean the directory "s3://b/runs"; joined as they were,
        # the second put the run under the key prefix "runs//" (object stores keep empty segments),
        # which a resume given "s3://b/runs" never found.
        return url.rstrip("/")
    return url


def _s3_defaults(options: dict) -> dict:
    """``storage_options`` for s3fs, with botocore's own checksums off unless the user set them.

    Why: every file we write is named in the step's manifest with its size and sha256, and every
    read of a checkpoint verifies them (``CheckpointStore``), so botocore's CRC32 on each PUT
    (default since botocore 1.36) and its check of each GET hash the same bytes a second time, on
    the training process's CPU. Measured with s3fs against moto on loopback (plain HTTP), one
    1.6 MB shard PUT: 6.0 ms of client CPU with them, 4.5 ms without. The request stays signed:
    without a checksum header botocore puts the body's sha256 in the signature (hashlib, which
    runs outside the GIL), over HTTPS too, where it would otherwise send the CRC32 as a trailer
    of a chunked upload. A value the user gives in ``config_kwargs`` wins; a botocore too old to
    know the options gets nothing added.
    """
    try:
        from botocore.config import Config
    except ImportError:  # s3fs missing: the scheme check reports it
        return options
    known = Config.OPTION_DEFAULTS
    config = dict(options.get("config_kwargs") or {})
    for name in ("request_checksum_calculation", "response_checksum_validation"):
        if name in known:
            config.setdefault(name, "when_required")
    return {**options, "config_kwargs": config}


@functools.cache
def _reads_concurrently(fs_class: type) -> bool:
    """Whether this s3fs reads a whole object as concurrent ranged GETs (``max_concurrency``,
    s3fs 2025 on). Older versions read with one GET and do not take the argument."""
    try:
        return "max_concurrency" in inspect.signature(fs_class._cat_file).parameters
    except (AttributeError, TypeError, ValueError):
        return False


class Storage:
    """One storage root (an fsspec URL) and relative paths under it.

    All paths given to methods are relative to the root, '/'-separated strings. The filesystem is
    created lazily (and dropped when pickled) so constructing a Storage never touches the network.
    """

    def __init__(self, url: str, storage_options: dict | None = None, retry: RetryPolicy | None = None):
        if not isinstance(url, str) or not url:
            raise ConfigError(f"RunConfig.storage must be a non-empty string URL or path, got {url!r}.")
        self.url = url
        self.storage_options = dict(storage_options or {})
        self.retry = retry or RetryPolicy()
        self.protocol = fsspec.core.split_protocol(url)[0] or "file"
        self.redact = Redactor(self.storage_options, extra=_url_secrets(url))
        self.location = self.redact(redact_url(url))
        self._fs: Any = None
        self._root: str | None = None

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_fs"] = None
        state["_root"] = None
        return state

    def __repr__(self) -> str:
        return f"Storage({self.location!r})"

    # ---- filesystem -------------------------------------------------------------------------
    def _filesystem(self) -> tuple[Any, str]:
        # Read once, into locals: another thread (the committer's cleanup, an agent's flush) may
        # drop it meanwhile (``_forget_filesystem``), and this call must not return None.
        fs, root = self._fs, self._root
        if fs is None:
            from elastic.redact import quiet_credential_loggers

            self._check_scheme()
            options = _s3_defaults(self.storage_options) if self.protocol in _S3 else self.storage_options
            if self.protocol in _S3:
                # The credentials botocore finds in this process's environment (the ranks' and
                # agents' may differ from the driver's, where this Storage was made).
                self.redact.hide(*(os.environ.get(name, "") for name in Redactor.AWS_ENVIRONMENT))
            try:
                fs, root = fsspec.core.url_to_fs(self.url, **options)
                # Here, not before: importing the filesystem made its libraries' loggers, and each
                # takes its filter now. Every process that talks to storage comes through here,
                # whatever logging it was given (elastic/redact.py).
                quiet_credential_loggers()
                if self.protocol == "memory":
                    from elastic.checkpoint import memory

                    if memory.in_run_process():  # the run's shared memory (elastic/checkpoint/memory.py)
                        fs = memory.cluster_filesystem()
            except (TypeError, ValueError) as exc:
                raise ConfigError(
                    f"RunConfig.storage_options are not accepted by the {self.protocol}:// filesystem "
                    f"for {self.location!r}: {self.redact(str(exc))}"
                ) from None
            root = root.rstrip("/") if root not in ("/", "") else root
            self._fs, self._root = fs, root
        return fs, root  # type: ignore[return-value]

    def _forget_filesystem(self) -> None:
        """Drop this process's filesystems of this kind, so the next call (of this ``Storage`` or
        of any made later) makes a new one, whose client looks its credentials up again. Why:
        botocore looks credentials up once, when s3fs makes its client, and fsspec keeps the
        filesystem (and so the client) for the process. A rank whose first lookup failed (the
        instance-metadata endpoint throttling a node's many processes at start, a credentials
        file mounted a moment late) wrote no part for the rest of the run, and no step committed
        again. fsspec's cache is dropped as a whole (``clear_instance_cache``, its public call):
        each rank builds a new ``Storage`` at every group it joins and every restore, and those
        took the cached filesystem. Other storages in the process just make theirs again. The
        cache goes at most once per ``CREDENTIALS_LOOKUP_S``; this storage's own reference
        always, so it takes whatever the cache holds next (one made after the last drop)."""
        global _credentials_forgotten_at
        fs, self._fs = self._fs, None
        if fs is not None and time.monotonic() - _credentials_forgotten_at >= CREDENTIALS_LOOKUP_S:
            _credentials_forgotten_at = time.monotonic()
            type(fs).clear_instance_cache()

    def _check_scheme(self) -> None:
        if self.protocol in _S3 and USERINFO.match(self.url):
            # s3fs reads no user:password@ from the URL: it would take "KEY:SECRET@bucket" for the
            # bucket's name and show it, the secret in it, in botocore's errors.
            raise ConfigError(
                f"RunConfig.storage={self.location!r} carries credentials in the URL, which s3fs does not read "
                "there; pass them in RunConfig.storage_options (key, secret, token) or the AWS environment or "
                "profile, and use s3://BUCKET/prefix."
            )
        try:
            fsspec.get_filesystem_class(self.protocol)
        except ValueError as exc:
            raise ConfigError(
                f"RunConfig.storage={self.location!r} has an unknown URL scheme {self.protocol + '://'!r} "
                f"({self.redact(str(exc))}); use file://, memory://, s3:// or a plain path."
            ) from None
        except ImportError as exc:
            raise ConfigError(
                f"RunConfig.storage={self.location!r} needs a package that is not installed "
                f"({self.redact(str(exc))}); for s3:// run `pip install s3fs`."
            ) from None

    @property
    def is_object_store(self) -> bool:
        return self.protocol in _OBJECT_STORES

    @property
    def is_local(self) -> bool:
        """A path on each node's own filesystem (``file://``, a plain path): the same directory on
        every node only where a shared filesystem is mounted there."""
        return self.protocol in _LOCAL

    def full_path(self, rel: str = "") -> str:
        _, root = self._filesystem()
        return _join(root, rel) if rel else root

    def describe(self, rel: str = "") -> str:
        """A redacted, human-readable location for ``rel``, for messages."""
        return _join(self.location, rel) if rel else self.location

    # ---- retry ------------------------------------------------------------------------------
    def _call(self, op: str, rel: str, fn: Callable[[], T], retry: RetryPolicy | None = None) -> T:
        """Run ``fn`` with bounded retries; raise redacted errors only."""
        policy = retry or self.retry
        attempts = max(1, policy.attempts)
        last: BaseException | None = None
        for attempt in range(attempts):
            try:
                return fn()
            except ConfigError:
                raise
            except FileRefused as exc:
                raise FileRefused(exc.reason, f"{op} {self.describe(rel)}") from None
            except FileNotFoundError as exc:
                raise FileNotFoundError(f"{op}: not found: {self.describe(rel)} ({self.redact(str(exc))})") from None
            except Exception as exc:  # noqa: BLE001 - transient by elimination; retried, then wrapped
                if type(exc).__name__ in _CREDENTIALS_LOST or _s3_error_code(exc) in _CREDENTIALS_STALE_CODES:
                    self._forget_filesystem()
                if _permanent(exc):
                    raise StorageError(
                        f"{op} {self.describe(rel)} failed: {type(exc).__name__}: {self.redact(str(exc))}"
                    ) from None
                last = exc
                if attempt + 1 < attempts:
                    delay = policy.delay_s(attempt)
                    logger.debug("%s %s failed (%s: %s); retry %d/%d in %.2fs", op, self.describe(rel),
                                 type(exc).__name__, self.redact(str(exc)), attempt + 1, attempts - 1, delay)
                    time.sleep(delay)
        assert last is not None
        # ``from None``: the original exception's text and traceback locals may carry credentials.
        raise StorageUnavailable(
            f"{op} {self.describe(rel)} failed after {attempts} attempts: "
            f"{type(last).__name__}: {self.redact(str(last))}"
        ) from None

    # ---- operations -------------------------------------------------------------------------
    def write_bytes(self, rel: str, data: bytes | list) -> None:
        """Write ``data``: bytes, or a list of buffers that are written one after another (a local
        file straight from them; other filesystems get them joined)."""
        fs, _ = self._filesystem()
        path = self.full_path(rel)
        parts = data if isinstance(data, list) else [data]
        self._refuse_links("write", rel)

        def write() -> None:
            if self.protocol in _LOCAL:
                _write_local(path, parts)
                return
            if not self.is_object_store:
                fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
            fs.pipe_file(path, parts[0] if len(parts) == 1 else b"".join(parts))

        try:
            self._call("write", rel, write)
        except FileNotFoundError as exc:
            # A write that finds nothing means the bucket (or mount) is gone: a storage problem.
            raise StorageError(str(exc)) from None

    def read_bytes(self, rel: str, size: int | None = None, max_size: int | None = None) -> bytes:
        """The file ``rel``. ``size``: its size, when a manifest's record gives it; then at most
        ``size + 1`` bytes are read, so a file replaced by a larger one (or appended to) costs no
        more memory or transfer than its record says, and the caller's size check still sees
        that it does not match. ``max_size``: for a file whose size nothing records (a
        manifest), the most it may hold: at most ``max_size + 1`` bytes are read, in one
        request, and a larger file is a ``FileRefused``, as is (on local storage) anything but
        a regular file (``_read_local``).

        On S3, a file of unknown size (a manifest, a rank's meta) or one no larger than s3fs's
        block is read with a single GET. Why: s3fs (2025 on) first asks for the size, to split a
        large object into concurrent ranged GETs: a HEAD, and for a missing key a LIST as well (to
        tell a directory from nothing). That is two requests for a manifest where one does, and
        three for a missing one, which the GC of uncommitted steps asks about for every step it
        removes (with a checkpoint every step, most steps). A shard larger than a block keeps the
        concurrent read."""
        fs, _ = self._filesystem()
        path = self.full_path(rel)
        bound = size if size is not None else max_size
        if self.protocol in _LOCAL:
            data = self._call("read", rel, lambda: _read_local(path, None if bound is None else bound + 1))
        else:
            data = self._read_remote(fs, rel, path, size, bound)
        if size is None and max_size is not None and len(data) > max_size:
            raise FileRefused(f"larger than {max_size} bytes", f"read {self.describe(rel)}")
        return data

    def _read_remote(self, fs: Any, rel: str, path: str, size: int | None, bound: int | None) -> bytes:
        """``read_bytes`` on storage other than local files: at most ``bound + 1`` bytes when
        ``bound`` is given (``size``, or ``max_size`` for a file of unknown size: one ranged
        request)."""
        kwargs = {}
        if self.protocol in _S3 and _reads_concurrently(type(fs)) and (size is None or size <= fs.default_block_size):
            kwargs["max_concurrency"] = 1
        # s3fs answers a size (ours below, and its own before a concurrent read) from its listing
        # cache: a listing of the step's directory taken before this file landed (elastic
        # checkpoints on a live run) made a committed shard FileNotFoundError, so the step read
        # as corrupt. Dropping the file's entries costs no request.
        fs.invalidate_cache(path)
        if bound is None:
            return self._call("read", rel, lambda: fs.cat_file(path, **kwargs))

        def read() -> bytes:
            if "max_concurrency" in kwargs or self.protocol not in _S3 or size is None:
                # One ranged read, an empty record's too (one byte: a file that is not empty
                # shows without being read whole). S3 refuses a range that starts at the end
                # of an empty object (416 InvalidRange, an EINVAL here): then its size says so.
                try:
                    return fs.cat_file(path, start=0, end=bound + 1, **kwargs)
                except Exception as exc:  # noqa: BLE001 - re-raised unless the object is empty
                    # An empty record's range, refused by a store other than S3 in its own words
                    # (its read of an empty object was whole before): its size says so too.
                    refused = not bound or (isinstance(exc, OSError) and exc.errno == errno.EINVAL
                                            and self.protocol in _S3)
                    if refused and fs.size(path) == 0:
                        return b""
                    raise
            # A shard above s3fs's block keeps its concurrent ranged GETs, which need no range
            # from us: its size first (the HEAD s3fs would make anyway), and one range if larger.
            actual = fs.size(path)
            return fs.cat_file(path, start=0, end=bound + 1) if actual > bound else fs.cat_file(path)

        return self._call("read", rel, read)

    def exists(self, rel: str, retry: RetryPolicy | None = None) -> bool:
        fs, _ = self._filesystem()
        path = self.full_path(rel)
        return bool(self._call("exists", rel, lambda: fs.exists(path), retry))

    def list_dir(self, rel: str = "", detail: bool = False, skip_links: bool = False) -> list:
        """Immediate children of ``rel``: names (detail=False) or dicts {name, type, size}.

        A missing directory lists as empty (object stores have no empty directories). The listing
        cache is dropped first: other processes (workers, the controller) write here too.
        ``skip_links``: symbolic links (local storage) are left out (``_refuse_links``).
        """
        fs, _ = self._filesystem()
        path = self.full_path(rel)

        def ls() -> list:
            fs.invalidate_cache()
            try:
                return fs.ls(path, detail=True)
            except FileNotFoundError:
                return []

        entries = self._call("list", rel, ls)
        out = []
        for entry in entries:
            name = str(entry["name"]).rstrip("/").rsplit("/", 1)[-1]
            if not name or str(entry["name"]).rstrip("/") == path.rstrip("/"):
                continue  # some backends list the directory itself
            if skip_links and self.protocol in _LOCAL and os.path.islink(_join(path, name)):
                continue
            if detail:
                out.append({"name": name, "type": entry.get("type", "file"), "size": int(entry.get("size") or 0)})
            else:
                out.append(name)
        return sorted(out, key=lambda e: e["name"] if detail else e)

    def _refuse_links(self, op: str, rel: str, itself: bool = False) -> None:
        """StorageError if a directory on the way from the root to ``rel`` (or, with ``itself``,
        ``rel`` itself) is a symbolic link, on local storage.

        Why: a run's directory may sit in a directory others can write (``/tmp/ckpt``), and a
        step directory another user made a link (to their files, or to anything this user can
        write) turned the run's writes, and retention's and GC's deletes, on what it points to.
        Checkpoints make no links. The root itself may be one (a user's ``ckpt -> /mnt/big``).
        A link made between this check and the call it guards is not caught: that needs write
        access to the run directory itself, which already lets anyone rewrite its checkpoints."""
        if self.protocol not in _LOCAL:
            return
        _, root = self._filesystem()
        parts = [p for p in rel.split("/") if p]
        for i in range(1, len(parts) + (1 if itself else 0)):
            sub = "/".join(parts[:i])
            if os.path.islink(_join(root, sub)):
                raise StorageError(f"{op} {self.describe(rel)} refused: {self.describe(sub)} is a symbolic link, "
                                   "which no checkpoint makes (made by someone else?); left as it is")

    def delete(self, rel: str) -> None:
        """Delete one file; a missing file is not an error."""
        fs, _ = self._filesystem()
        path = self.full_path(rel)
        self._refuse_links("delete", rel)
        try:
            self._call("delete", rel, lambda: fs.rm_file(path))
        except FileNotFoundError:
            pass

    def delete_files(self, rels: list[str], dir_rel: str) -> bool:
        """Delete the files ``rels`` (missing ones are not an error), then the directory ``dir_rel``
        if nothing else is in it. False if it still holds something: call ``delete_tree``.

        Why not always ``delete_tree``: it first finds what to delete (fsspec's ``expand_path``: a
        walk on disk, a LIST and more on S3), for every step retention drops. The committer knows
        a step's files; on an object store one bulk DELETE does, and a key nobody listed (a
        part written twice under two world sizes) leaves an uncommitted prefix that the GC sweep
        removes."""
        if not rels:
            return False
        fs, _ = self._filesystem()
        paths = [self.full_path(r) for r in rels]
        self._refuse_links("delete", dir_rel, itself=True)
        for r in rels:
            self._refuse_links("delete", r)
        if self.is_object_store:
            self._call("delete", dir_rel, lambda: self._delete_objects(fs, paths))
            return True

        def rm() -> bool:
            for path in paths:
                try:
                    fs.rm_file(path)
                except FileNotFoundError:
                    pass
            try:
                fs.rmdir(self.full_path(dir_rel))
            except FileNotFoundError:
                pass
            except OSError:  # not empty
                return False
            return True

        return self._call("delete", dir_rel, rm)

    def _delete_objects(self, fs: Any, paths: list[str]) -> None:
        """Delete the keys ``paths`` of an object store in bulk (absent keys are fine); raise if one
        is left.

        On S3, DeleteObjects through s3fs's own client call, 1000 keys a request (S3's limit), its
        answer checked key by key. Why not ``fs.rm(paths)``: s3fs sends the same request but drops
        the answer's "Errors" (``S3FileSystem._bulk_delete``: "we ... don't raise on any errors"),
        and a key S3 refused (InternalError, SlowDown, AccessDenied under object lock) would pass
        for deleted. The store deletes manifests first so that a failed delete never leaves a
        committed step with missing files; a manifest refused in silence would. Other object
        stores keep ``fs.rm``, on the assumption that it raises for a file it could not delete."""
        if self.protocol not in _S3:
            fs.rm(paths)
            return
        from botocore.exceptions import ClientError
        from s3fs.errors import translate_boto_error

        bucket = fs.split_path(paths[0])[0]  # every path is under the root, in its bucket
        for start in range(0, len(paths), 1000):
            chunk = paths[start:start + 1000]
            for path in chunk:
                fs.invalidate_cache(path)  # and its parents' listings, as ``fs.rm`` does
            out = fs.call_s3("delete_objects", Bucket=bucket,
                             Delete={"Objects": [{"Key": fs.split_path(p)[1]} for p in chunk], "Quiet": True})
            # NoSuchKey: S3 itself reports an absent key as deleted, some S3-compatible stores do not.
            errors = [e for e in out.get("Errors", []) if e.get("Code") != "NoSuchKey"]
            if errors:
                # The first key's error code decides the exception, as s3fs would for one key:
                # AccessDenied is a PermissionError (not retried), InternalError an OSError (retried).
                message = (f"DeleteObjects left {len(errors)} of {len(chunk)} keys: "
                           + "; ".join(f"{e.get('Key')}: {e.get('Code')} {e.get('Message', '')}".rstrip()
                                       for e in errors[:5]))
                raise translate_boto_error(ClientError({"Error": errors[0]}, "DeleteObjects"), message, False)

    def delete_tree(self, rel: str) -> None:
        """Delete a directory and everything under it; a missing directory is not an error."""
        if not rel.strip("/"):
            raise ValueError("refusing to delete the storage root")
        fs, _ = self._filesystem()
        path = self.full_path(rel)
        self._refuse_links("delete", rel, itself=True)

        def rm() -> None:
            fs.invalidate_cache()
            if self.protocol in _S3:
                # The keys under the prefix, then the checked bulk delete: ``fs.rm(recursive=True)``
                # makes the same two requests but drops the per-key errors (_delete_objects), and
                # a key left behind would pass for deleted.
                keys = fs.find(path)
                if keys:
                    self._delete_objects(fs, keys)
                return
            try:
                fs.rm(path, recursive=True)
            except FileNotFoundError:
                return

        self._call("delete", rel, rm)

    # ---- validation -------------------------------------------------------------------------
    def validate(self, probe_dir: str = "") -> None:
        """Fail fast, before training, with a ConfigError that says what to change.

        Checks the scheme, S3 credentials and bucket, then writes, reads back and deletes a small
        probe file under ``probe_dir`` so permission problems show up now rather than at step 1000.
        """
        fs, root = self._open_checked()
        quick = self._quick_retry()
        if self.protocol in _S3:
            bucket = self._named_bucket(root)
            try:
                found = self._bucket_found(fs, bucket)
            except StorageError as exc:
                raise ConfigError(self.redact(
                    f"RunConfig.storage={self.location!r}: cannot reach bucket {bucket!r}: {exc}. "
                    "Check RunConfig.storage_options (endpoint_url, region, credentials); if the storage is "
                    "down, start again once it answers (a run that is already training waits for it)."
                )) from None
            if not found:
                raise ConfigError(self.redact(
                    f"RunConfig.storage={self.location!r}: bucket {bucket!r} does not exist (or these "
                    "credentials cannot see it); create it or fix the bucket name."
                ))
        try:
            self._probe(quick, probe_dir)
        except StorageUnavailable as exc:
            # Transient errors that outlasted the retries (NFS's EIO, S3's SlowDown): the storage
            # did not answer, which no path or permission explains. Still refused here, before
            # training, but said as what it is.
            raise ConfigError(
                f"RunConfig.storage={self.location!r} did not answer the check's probe: {self.redact(str(exc))}. "
                "The storage may be down or overloaded; start again once it answers (a run that is already "
                "training waits for it)."
            ) from None
        except (StorageError, FileNotFoundError) as exc:
            raise ConfigError(
                f"RunConfig.storage={self.location!r} is not writable: {self.redact(str(exc))}. "
                "Check the path, permissions and RunConfig.storage_options."
            ) from None

    def bucket_exists(self) -> tuple[str, bool]:
        """For an s3:// URL: its bucket, and whether it exists. Raises ConfigError for a URL that
        names no bucket (or the checks of ``_open_checked``), StorageError when the endpoint does
        not answer. Why a listing asks too: s3fs lists a missing bucket as empty (NoSuchBucket is
        its FileNotFoundError), so ``elastic checkpoints`` on a misspelt bucket said "no
        checkpoints" and succeeded."""
        fs, root = self._open_checked()
        bucket = self._named_bucket(root)
        return bucket, self._bucket_found(fs, bucket)

    def _named_bucket(self, root: str) -> str:
        bucket = root.split("/", 1)[0]
        if not bucket:
            raise ConfigError(f"RunConfig.storage={self.location!r} names no bucket; use s3://BUCKET/prefix.")
        return bucket

    def _bucket_found(self, fs: Any, bucket: str) -> bool:
        """A HEAD of the bucket, with a check's quick retries (``_bucket_exists``)."""
        return self._call("check bucket", "", lambda: self._bucket_exists(fs, bucket), retry=self._quick_retry())

    def check_here(self) -> None:
        """Whether this process can write the storage, for a run about to train: raise
        ConfigError when the storage refuses it; an outage is only logged.

        Why beside ``validate``: that runs in the driver, with the driver's environment, and the
        ranks and node agents that write the checkpoints run on other nodes, with theirs. S3
        credentials from the driver's AWS_* variables or ``~/.aws`` (a laptop over ``ray://``,
        a head node's IAM role) are not there, nor may s3fs be installed; the writes then failed
        in the background for the whole run, with events but no error. Checked here: the scheme
        and its filesystem, S3 credentials as botocore finds them in this process, and a probe
        written, read back and deleted. An outage is not a refusal: storage down at a start
        leaves the writes to retry and report it, as they do mid-run."""
        self._open_checked(" here", patient=True)
        try:
            self._probe(self._quick_retry())
        except StorageUnavailable as exc:
            logger.warning("checkpoint storage %s did not answer a probe write: %s (checkpoints retry until it does)",
                           self.location, exc)
        except (StorageError, FileNotFoundError) as exc:
            raise ConfigError(
                f"RunConfig.storage={self.location!r} is not writable from here: {self.redact(str(exc))}. "
                "Check the permissions and RunConfig.storage_options."
            ) from None

    def _open_checked(self, here: str = "", patient: bool = False) -> tuple[Any, str]:
        """The checks ``validate`` and ``check_here`` share: the scheme, S3 credentials as botocore
        finds them in this process, and the filesystem opened (``_filesystem``), each failure a
        ConfigError. ``here``: said after "filesystem" for a check outside the driver.
        ``patient``: credentials not found are looked up again a few times first (``_CREDENTIALS_RETRY``)."""
        self._check_scheme()
        if self.protocol in _S3:
            self._check_s3_credentials(patient)
        try:
            return self._filesystem()
        except ConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 - a filesystem that connects when made (ftp://) or cannot be one (tar://x)
            raise ConfigError(
                f"RunConfig.storage={self.location!r} cannot be opened as a {self.protocol}:// filesystem{here}: "
                f"{type(exc).__name__}: {self.redact(str(exc))}. Check the URL and RunConfig.storage_options."
            ) from None

    def _quick_retry(self) -> RetryPolicy:
        """A check's retries: two tries, short waits (a start should not sit out an outage)."""
        return RetryPolicy(attempts=2, base_s=min(self.retry.base_s, 0.2), max_s=0.5)

    def _probe(self, retry: RetryPolicy, probe_dir: str = "") -> None:
        """Write a small probe file, read it back and delete it (the delete may fail: a stray
        probe is harmless). Raises the storage errors of the write and the read, and
        ConfigError when the bytes read back differ."""
        fs, _ = self._filesystem()
        probe = _join(probe_dir, f".elastic-probe-{uuid.uuid4().hex}")
        payload = b"elastic storage probe"
        try:
            self._call("probe write", probe, lambda: self._probe_write(probe, payload), retry=retry)
        except StorageUnavailable:
            # Storage that did not answer the write is not asked to delete: each try on an
            # endpoint that drops packets waits out s3fs's connect timeout, and with the delete
            # retried in full a start waited twice as long for it. A write that landed unanswered
            # leaves a stray probe, which is harmless.
            raise
        except BaseException:
            self._delete_probe(fs, probe, RetryPolicy(attempts=1))  # refused: most likely nothing to delete
            raise
        try:
            back = self._call("probe read", probe, lambda: fs.cat_file(self.full_path(probe)), retry=retry)
        finally:
            self._delete_probe(fs, probe, retry)
        if back != payload:
            raise ConfigError(f"RunConfig.storage={self.location!r} returned different bytes than were written.")

    def _delete_probe(self, fs: Any, probe: str, retry: RetryPolicy) -> None:
        try:
            self._call("probe delete", probe, lambda: fs.rm_file(self.full_path(probe)), retry=retry)
        except Exception:  # noqa: BLE001 - a stray probe file is harmless
            logger.debug("could not delete probe %s", self.describe(probe))

    @staticmethod
    def _bucket_exists(fs: Any, bucket: str) -> bool:
        """HEAD the bucket. ``fs.exists`` would answer False for an unreachable endpoint too, which
        would blame the bucket for a network problem."""
        call_s3 = getattr(fs, "call_s3", None)
        if call_s3 is None:
            return bool(fs.exists(bucket))
        try:
            call_s3("head_bucket", Bucket=bucket)
        except FileNotFoundError:
            return False
        except PermissionError:
            # S3 answers HEAD of a bucket with 403 to a policy that lists only under a prefix
            # (ListBucket with an s3:prefix condition: a shared bucket's usual grant), and with
            # 404 to anyone when it does not exist. So it exists; whether these credentials may
            # write under the run's prefix is the probe's to say, with its own message. Refused
            # here, fit() blamed the endpoint, region and credentials of a run that would train.
            return True
        return True

    def _probe_write(self, rel: str, data: bytes) -> None:
        fs, _ = self._filesystem()
        path = self.full_path(rel)
        if not self.is_object_store:
            fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        fs.pipe_file(path, data)

    def _check_s3_credentials(self, patient: bool = False) -> None:
        """Resolve credentials the way s3fs/botocore would, without a network round trip to S3.

        Without this, missing credentials surface as a slow retry loop or a vague 403 mid-training.
        ``patient``: none found is looked up again a few times (``_CREDENTIALS_RETRY``), all within
        about ``_CREDENTIALS_PATIENCE_S``, for a check on a node, where a lookup that timed out
        reads as none; the driver's stays strict: one process, and a laptop without credentials
        is told at once.
        """
        opts = self.storage_options
        if opts.get("anon"):
            return
        key = opts.get("key") or opts.get("username") or opts.get("aws_access_key_id")
        secret = opts.get("secret") or opts.get("password") or opts.get("aws_secret_access_key")
        client_kwargs = opts.get("client_kwargs") or {}
        key = key or client_kwargs.get("aws_access_key_id")
        secret = secret or client_kwargs.get("aws_secret_access_key")
        if key and secret:
            return
        if bool(key) != bool(secret):
            missing = "secret" if key else "key"
            raise ConfigError(
                f"RunConfig.storage_options for {self.location!r} has an S3 access key or secret but not both; "
                f"add storage_options[{missing!r}]."
            )
        try:
            import botocore.session
            from botocore.exceptions import BotoCoreError

            deadline = time.monotonic() + _CREDENTIALS_PATIENCE_S
            attempts = _CREDENTIALS_RETRY.attempts if patient else 1
            slowest = 0.0
            for attempt in range(attempts):
                if attempt:
                    delay = _CREDENTIALS_RETRY.delay_s(attempt - 1)
                    # Checked here, before the sleep and the lookup both: each lookup may wait on
                    # the metadata endpoint, so one let start near the deadline ends well past it.
                    if time.monotonic() + delay + slowest > deadline:
                        break
                    logger.info("no AWS credentials found for %s; looking again in %.1fs", self.location, delay)
                    time.sleep(delay)
                # A new session each time: a session reads ~/.aws once (a file mounted late).
                started = time.monotonic()
                creds = botocore.session.Session(profile=opts.get("profile")).get_credentials()
                slowest = max(slowest, time.monotonic() - started)
                if creds is not None:
                    break
        except BotoCoreError as exc:  # e.g. ProfileNotFound
            raise ConfigError(
                f"RunConfig.storage_options for {self.location!r}: cannot load AWS credentials "
                f"({type(exc).__name__}: {self.redact(str(exc))})."
            ) from None
        if creds is None:
            raise ConfigError(
                f"RunConfig.storage={self.location!r}: no AWS credentials found. Pass "
                "RunConfig.storage_options={'key': ..., 'secret': ...}, set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, configure an AWS profile (storage_options['profile']), "
                "or use storage_options={'anon': True} for a public bucket."
            )


def _url_secrets(url: str) -> tuple[str, ...]:
    """The user and password of a URL, if any, so they are redacted wherever they show up.

    A password with a '/' in it comes apart in messages: a URL parser (s3fs's included) takes
    ``user:first-piece`` for the host or bucket and the rest for the path, so each of those is a
    secret too."""
    m = USERINFO.match(url)
    if not m or not is_credential(m):
        return ()
    user, _, password = m.group("userinfo").partition(":")
    pieces = password.split("/")
    secrets = {user, password, unquote(password), f"{user}:{pieces[0]}" if user and pieces[0] else "", *pieces}
    return tuple(s for s in secrets if s)
