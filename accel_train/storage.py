"""Where bytes live: a local folder or any fsspec URL (s3://, gs://, az://, ...), read and written through one
`Store`, every remote call retried on transient errors for a bounded time.

Credentials and endpoints come from each storage's own environment (AWS_PROFILE, AWS_ENDPOINT_URL, ...), never
from a config; the storage libraries are extras (`pip install 'accel-train[s3]'`).
"""

from __future__ import annotations

import copy
import fcntl
import logging
import os
import re
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple, TypeVar

from accel_train.errors import DataNotFoundError, UnreadableFileError, UserError

logger = logging.getLogger(__name__)

T = TypeVar("T")

# The extra that brings each protocol's library (pyproject's optional-dependencies).
EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "az": "azure", "abfs": "azure", "abfss": "azure"}
# Inside the client: short timeouts and few retries of its own, so that our loop (Store.patience_s) bounds the
# time a store that stays down costs, and says so once, instead of the library's minutes of silent retries.
CLIENT_OPTIONS = {
    "s3": {"config_kwargs": {"connect_timeout": 5, "read_timeout": 30, "retries": {"max_attempts": 2,
                                                                                   "mode": "standard"}}},
}
CLIENT_ATTRIBUTES = {"s3": {"retries": 2}}  # s3fs's own retry count is a class attribute
PATIENCE_S = 60.0  # how long a store may stay unreachable before a read gives up (exit 3)
_warned = threading.Event()  # one retry warning per process


class Versioned(NamedTuple):
    """An object as read, with what a conditional write compares (`version`) and how long ago it was written."""

    data: bytes
    version: str  # the store's ETag; a local file's sha256
    age_s: float  # by the clock of the store: its LastModified against the Date of the answer (locally: the mtime)


class NoConditionalWrites(Exception):
    """This store, or the client library installed for it, cannot write an object only where it is absent or
    unchanged (the text says which)."""


class StoreUnavailable(DataNotFoundError):
    """The store stayed unreachable (or kept answering wrong bytes) for the whole patience; exit code 3. Each process
    that met it says so."""

    on_every_process = False


def is_remote(location: str | os.PathLike) -> bool:
    """A URL of a storage other than the local file system (`file://` and plain paths are local)."""
    text = str(location)
    return "://" in text and not text.startswith("file://")


def refuse_no_folder(path: Path, said: str) -> None:
    """One line where a folder is to be made or filled at `path` but cannot be: `path` is a file (or a link to one),
    a link to nothing, or below a file. `said`: how the line names the place (`photos: OUT`, `export: output=DIR`)."""
    if path.is_symlink() and not path.exists():
        raise UserError(f"{said} is a link to {os.readlink(path)}, which is not there; give a folder")
    above = next((folder for folder in (path, *path.parents) if folder.exists()), None)
    if above is not None and not above.is_dir():
        what = "a link to a file" if above.is_symlink() else "a file"
        if above == path:
            raise UserError(f"{said} is {what}, not a folder; give a new folder")
        raise UserError(f"{said}: {above} is {what}, so no folder can be made below it; give another folder")


def join(location: str, *names: str) -> str:
    """`location/name/...` for a URL or a local path alike."""
    return "/".join([str(location).rstrip("/"), *(name.strip("/") for name in names)])


def protocol_of(url: str) -> str:
    return url.split("://", 1)[0] if is_remote(url) else "file"


# scheme:/..., scheme:..., scheme://, scheme:///...: a scheme of two letters or more (C:/ is a drive)
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):(/*)(.*)$", re.DOTALL)


def check_url_form(location: str | os.PathLike | None, key: str) -> None:
    """A location that looks like a mistyped URL is refused in one line, before anything is made: as a path,
    `s3:/bucket/x` or `s3://` would become a local folder named `s3:`. A scheme that no storage library knows, with
    one slash or none (`exp:1`), stays a local name."""
    if location is None:
        return
    text = str(location)
    match = _SCHEME.match(text)
    if not match:
        return
    scheme, slashes, rest = match.groups()
    if scheme.lower() == "file":
        if len(slashes) < 2:
            raise UserError(f"{key}={text}: a local path goes without file: ({key}={text[5:] or '.'})")
        return
    if slashes == "//" and rest:
        return  # a URL: its protocol and bucket are checked where it is opened
    if slashes == "//" or slashes == "///" and not rest.strip("/"):
        raise UserError(f"{key}={text}: the URL names no bucket or container; write {scheme}://BUCKET/FOLDER")
    if slashes == "///":
        raise UserError(f"{key}={text}: a URL has two slashes after its scheme, not three; write "
                        f"{scheme}://{rest}")
    if not _known_protocol(scheme.lower()):
        return
    raise UserError(f"{key}={text}: not a URL (a URL has two slashes after its scheme), and not taken for a local "
                    f"folder named {scheme}:; write {scheme}://{rest.lstrip('/')}, or ./{text} for such a local folder")


def _known_protocol(scheme: str) -> bool:
    """A protocol some fsspec library serves (installed or not)."""
    from fsspec.registry import known_implementations

    return scheme in EXTRAS or scheme in known_implementations


def check_location(location: str, key: str) -> None:
    """Before anything is read or made: no mistyped URL; a URL with a library for its protocol, and no credentials
    inside it."""
    check_url_form(location, key)
    if not is_remote(location):
        return
    from urllib.parse import urlsplit

    parts = urlsplit(location)
    if parts.username or parts.password:
        raise UserError(f"{key}: credentials inside the URL would be recorded in config.yaml; give them through the "
                        f"storage's own environment (for s3://, AWS_PROFILE or AWS_ACCESS_KEY_ID and "
                        f"AWS_SECRET_ACCESS_KEY) and write {parts.scheme}://{parts.hostname}{parts.path}")
    _filesystem(location, key)


def _filesystem(url: str, key: str):
    import fsspec

    protocol = protocol_of(url)
    try:
        cls = fsspec.get_filesystem_class(protocol)
    except ValueError:
        raise UserError(f"{key}={url}: no storage library knows {protocol}://; use a local path or a URL such as "
                        "s3://bucket/folder, gs://bucket/folder or az://container/folder") from None
    except ImportError:
        extra = EXTRAS.get(protocol)
        install = f"pip install 'accel-train[{extra}]'" if extra else f"install the fsspec library for {protocol}://"
        raise UserError(f"{key}={url}: reading {protocol}:// needs its storage library: {install}") from None
    fs = cls(**CLIENT_OPTIONS.get(protocol, {}), skip_instance_cache=True)
    for name, value in CLIENT_ATTRIBUTES.get(protocol, {}).items():
        setattr(fs, name, value)
    return fs


def _is_transient(err: BaseException) -> bool:
    """An error that another attempt may not meet: the network, the store's own 5xx or SlowDown, a body cut short.
    Not: a missing object, a refused permission, missing credentials, or a bug."""
    if isinstance(err, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError)):
        return False
    module = type(err).__module__.split(".")[0]
    if type(err).__name__ in ("NoCredentialsError", "PartialCredentialsError", "NoRegionError"):
        return False
    return isinstance(err, (OSError, TimeoutError, EOFError)) or module in ("aiohttp", "botocore", "http", "urllib3",
                                                                             "requests", "fsspec")


def _unknown_bucket(err: BaseException) -> bool:
    """A missing bucket, not a missing object: the store's own NoSuchBucket (s3fs keeps it as the cause), or its
    message. Not the word "bucket" anywhere: a missing object's error is its path, which may hold it."""
    return isinstance(err, FileNotFoundError) and (type(err.__cause__).__name__ == "NoSuchBucket"
                                                   or "specified bucket does not exist" in str(err).lower())


def _access_problem(err: BaseException, url: str) -> UserError | None:
    """The one line for what no retry fixes: credentials, permission, an unknown bucket."""
    name = type(err).__name__
    if name in ("NoCredentialsError", "PartialCredentialsError"):
        return UserError(f"no credentials to read {url}: set the storage's own environment (for s3://, AWS_PROFILE, "
                         "or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY; AWS_ENDPOINT_URL for a store other than "
                         "AWS)")
    if isinstance(err, PermissionError):
        return UserError(f"{url}: access denied ({err}); check the credentials in the storage's environment "
                         "(AWS_PROFILE, AWS_ACCESS_KEY_ID, ...) and the bucket's permissions")
    if _unknown_bucket(err):
        return UserError(f"{url}: {err}; check the bucket's name (and AWS_ENDPOINT_URL for a store other than AWS)")
    return None


class Store:
    """A folder at a local path or URL. Remote reads and writes are retried on transient errors, with backoff, for at
    most `patience_s`; the first retry in a process prints one line."""

    def __init__(self, location: str, key: str = "data.root", patience_s: float = PATIENCE_S,
                 call_bound_s: float | None = None) -> None:
        self.location, self.key, self.patience_s = str(location).rstrip("/"), key, patience_s
        self.call_bound_s = call_bound_s  # a conditional write's S3 call cut off after this long (the client's own
        # timeouts and retries allow a silent store a minute), then retried within patience_s
        self.remote = is_remote(self.location)
        self._fs, self._pid = None, None  # the client, made in each process that uses it

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_fs": None}

    def sharing(self, location: str | None = None, *, patience_s: float | None = None,
                call_bound_s: float | None = None) -> Store:
        """A Store of this one's client (made once: 0.3 to 0.7 s for S3) at `location`, or here, with other bounds."""
        other = copy.copy(self)
        other._fs, other._pid = self.fs, self._pid  # made here if not yet; copy.copy (__getstate__) drops it
        other.location = self.location if location is None else str(location).rstrip("/")
        other.patience_s = self.patience_s if patience_s is None else patience_s
        other.call_bound_s = call_bound_s
        return other

    @property
    def fs(self):
        # fsspec's async clients are not fork-safe: a DataLoader worker forked with the parent's makes its own
        if self._fs is None or self._pid != os.getpid():
            self._fs, self._pid = (_filesystem(self.location, self.key) if self.remote else None), os.getpid()
        return self._fs

    def url(self, name: str = "") -> str:
        return join(self.location, name) if name else self.location

    def _path(self, name: str) -> str:
        """The object's path as its file system names it (the URL without its protocol)."""
        from fsspec.core import strip_protocol

        return strip_protocol(self.url(name))

    def read(self, name: str, start: int | None = None, end: int | None = None,
             check: Callable[[bytes], str | None] | None = None, size: int | None = None) -> bytes:
        """The object's bytes [start, end). `check(data)` names what is wrong with bytes that arrived (a body cut
        short, a hash that differs): such a read is retried like a transient error, and reported if it persists.
        `size`: the object's size as recorded (a shard's, in its index); a read that fails or falls short from an
        object of another size is one line at once (the object was cut short or written again), not retried."""
        def attempt() -> bytes:
            try:
                if self.remote:
                    data = self.fs.cat_file(self._path(name), start=start, end=end)
                else:
                    with open(self.url(name), "rb") as file:
                        file.seek(start or 0)
                        data = file.read(-1 if end is None else end - (start or 0))
            except Exception:
                self._refuse_another_size(name, size)
                raise
            problem = check(data) if check else None
            if problem:
                self._refuse_another_size(name, size)
                raise _WrongBytes(problem)
            return data
        return self.retrying(attempt, self.url(name))

    def _refuse_another_size(self, name: str, recorded: int | None) -> None:
        """One line (exit 3) where the object is no longer of the size recorded for it; nothing where it is, or where
        its size cannot be asked (the read's own error then goes on to say what is wrong)."""
        if recorded is None:
            return
        try:
            found = self.fs.size(self._path(name)) if self.remote else os.path.getsize(self.url(name))
        except Exception:  # the failed read is what gets reported
            return
        if found != recorded:
            raise UnreadableFileError(f"cannot read {self.url(name)}: it has {found:,} bytes, {recorded:,} when its "
                                      "index was written: cut short or written again since (a damaged shard); put "
                                      "it back, or write the shards again with accel-train shard, then run again "
                                      "with resume=auto")

    def size(self, name: str) -> int:
        if not self.remote:
            return os.path.getsize(self.url(name))
        return self.retrying(lambda: self.fs.size(self._path(name)), self.url(name))

    def exists(self, name: str) -> bool:
        if not self.remote:
            return os.path.exists(self.url(name))
        return self.retrying(lambda: self.fs.exists(self._path(name)), self.url(name))

    def names(self, folder: str = "") -> list[str]:
        """The names of the objects directly under `folder` (empty if there is none)."""
        if not self.remote:
            path = Path(self.url(folder))
            return sorted(entry.name for entry in path.iterdir() if entry.is_file()) if path.is_dir() else []

        def listing() -> list[str]:
            try:
                return sorted(entry.rsplit("/", 1)[-1] for entry in self.fs.ls(self._path(folder), detail=False,
                                                                               refresh=True))
            except FileNotFoundError as err:
                if _unknown_bucket(err):
                    raise
                return []
        return self.retrying(listing, self.url(folder))

    def write(self, name: str, data: bytes) -> None:
        """The whole object at once: a reader never sees part of it (a local file is renamed into place; an object
        store publishes an object only when its upload completes)."""
        if not self.remote:
            path = Path(self.url(name))
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.partial")
            partial.write_bytes(data)
            partial.replace(path)
            return
        self.retrying(lambda: self.fs.pipe_file(self._path(name), data), self.url(name), "write")

    def files(self, folder: str = "") -> dict[str, int]:
        """Every object under `folder`, at any depth: {name relative to `folder`: size}."""
        root = self.url(folder)
        if not self.remote:
            path = Path(root)
            return {entry.relative_to(path).as_posix(): entry.stat().st_size for entry in sorted(path.rglob("*"))
                    if entry.is_file()} if path.is_dir() else {}

        def listing() -> dict[str, int]:
            base = self._path(folder).rstrip("/") + "/"
            try:
                found = self.fs.find(base, detail=True, withdirs=False)
            except FileNotFoundError as err:
                if _unknown_bucket(err):
                    raise
                return {}
            return {path[len(base):]: entry["size"] for path, entry in sorted(found.items())
                    if path.startswith(base) and entry.get("type") != "directory"}
        self.fs.invalidate_cache()  # s3fs caches listings: another process may have written since
        return self.retrying(listing, root)

    def put(self, source: Path, name: str) -> None:
        """A local file as the object `name`, published whole (as `write`)."""
        if not self.remote:
            path = Path(self.url(name))
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.partial")
            shutil.copyfile(source, partial)
            partial.replace(path)
            return
        self.retrying(lambda: self.fs.put_file(str(source), self._path(name)), self.url(name), "write")

    def get(self, name: str, destination: Path) -> None:
        """The object `name` into a local file, which appears only once whole."""
        destination.parent.mkdir(parents=True, exist_ok=True)
        partial = destination.with_name(f".{destination.name}.{uuid.uuid4().hex[:8]}.partial")
        try:
            if self.remote:
                self.retrying(lambda: self.fs.get_file(self._path(name), str(partial)), self.url(name))
            else:
                shutil.copyfile(self.url(name), partial)
            partial.replace(destination)
        finally:
            partial.unlink(missing_ok=True)

    def remove(self, name: str) -> None:
        if not self.remote:
            path = Path(self.url(name))
            path.unlink(missing_ok=True)
            if path.parent != Path(self.location) and not any(path.parent.iterdir()):
                path.parent.rmdir()  # object stores have no empty folders; a local store keeps none either
            return
        self.retrying(lambda: self.fs.rm_file(self._path(name)) if self.fs.exists(self._path(name)) else None,
                      self.url(name), "remove")

    # Conditional writes, for an object that one writer at a time owns (a run folder's lease): S3's If-None-Match and
    # If-Match (fsspec has none at pyproject's floors, so S3's own calls go through s3fs's client); a local folder's
    # file created by link() (which fails where the name exists) and replaced under an flock of the file, where the
    # content read first must still be there.

    def read_versioned(self, name: str) -> Versioned | None:
        """The object with its version and age; None where there is none."""
        if not self.remote:
            path = Path(self.url(name))
            try:
                with open(path, "rb") as file:
                    data, written = file.read(), os.fstat(file.fileno()).st_mtime
            except FileNotFoundError:
                return None
            return Versioned(data, _digest(data), time.time() - written)

        def attempt() -> Versioned | None:
            try:
                answer = self._s3("get_object", name)
            except _S3Refused as refused:
                if refused.status == 404:
                    return None
                raise refused.error from None
            age = (_answered_at(answer) - answer["LastModified"]).total_seconds()
            return Versioned(answer["Body"], answer["ETag"], age)
        return self.retrying(attempt, self.url(name))

    def create(self, name: str, data: bytes) -> str | None:
        """The object written only where there is none: its version, or None where one is there."""
        if not self.remote:
            path = Path(self.url(name))
            partial = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.partial")
            partial.write_bytes(data)
            try:
                os.link(partial, path)  # atomic, and refused where the name exists (NFS too)
            except FileExistsError:
                return None
            except OSError:  # a file system without hard links (a FUSE mount): created exclusively, then written
                try:
                    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
                except FileExistsError:
                    return None
                with open(fd, "wb") as file:
                    file.write(data)
            finally:
                partial.unlink()
            return _digest(data)
        return self.retrying(lambda: self._put_if(name, data, IfNoneMatch="*"), self.url(name), "write")

    def replace(self, name: str, data: bytes, version: str) -> str | None:
        """The object written only where it is still the one of `version`: its new version, or None where it has
        changed or is gone."""
        if not self.remote:
            path = Path(self.url(name))
            with _locked(path) as current:
                if current is None or _digest(current) != version:
                    return None
                partial = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.partial")
                partial.write_bytes(data)
                partial.replace(path)
            return _digest(data)
        return self.retrying(lambda: self._put_if(name, data, IfMatch=version), self.url(name), "write")

    def remove_version(self, name: str, version: str) -> bool:
        """The object removed where it is still the one of `version`; whether it was. In a store, its version is
        read first and it is removed if that is still `version`: S3 stores need not honour a conditional delete."""
        if not self.remote:
            path = Path(self.url(name))
            with _locked(path) as current:
                if current is None or _digest(current) != version:
                    return False
                path.unlink()
            return True
        found = self.read_versioned(name)
        if found is None or found.version != version:
            return False
        self.remove(name)
        return True

    def _put_if(self, name: str, data: bytes, **condition: str) -> str | None:
        try:
            return self._s3("put_object", name, Body=data, **condition)["ETag"]
        except _S3Refused as refused:
            if refused.status in (404, 412):  # gone, or another version (or there, for If-None-Match)
                return None
            raise refused.error from None

    def _s3(self, method: str, name: str, **arguments):
        """One call of the S3 API on the object `name`, through s3fs's own client (so with its credentials and
        endpoint); a refusal of the store (4xx) raised as _S3Refused, the rest as the client raised it."""
        if protocol_of(self.location) not in ("s3", "s3a"):
            raise NoConditionalWrites(f"{protocol_of(self.location)}:// (accel-train makes conditional writes on s3:// "
                                      "only)")
        from botocore.exceptions import ClientError
        from fsspec.asyn import sync

        fs = self.fs
        bucket, _, key = self._path(name).partition("/")
        client = sync(fs.loop, fs.set_session)  # made once (credentials, endpoint): not within call_bound_s
        known = client.meta.service_model.operation_model("PutObject").input_shape.members
        if not {"IfNoneMatch", "IfMatch"} <= set(known):  # s3fs would drop them silently: an unconditional write
            import botocore

            raise NoConditionalWrites(f"botocore {botocore.__version__} has no conditional writes for S3 "
                                      "(If-None-Match, If-Match: late 2024); pip install -U s3fs")

        async def call():
            try:
                answer = await getattr(client, method)(Bucket=bucket, Key=key, **arguments)
            except ClientError as err:
                status = err.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
                # 409: a conditional write that met another under way, to be tried again
                if 400 <= status < 500 and status not in (408, 409, 429) and \
                        err.response.get("Error", {}).get("Code") != "NoSuchBucket":
                    raise _S3Refused(status, err) from None
                from s3fs.errors import translate_boto_error

                raise translate_boto_error(err) from err  # s3fs's errors, as every other call of the store raises
            if "Body" in answer:
                answer["Body"] = await answer["Body"].read()
            return answer
        return sync(fs.loop, call, timeout=self.call_bound_s)

    def retrying(self, action: Callable[[], T], url: str, doing: str = "read") -> T:
        """`action()`, again after each transient error (backoff from 0.2 s, doubling up to 5 s) until it succeeds or
        `patience_s` has passed since the first failure: then one StoreUnavailable line naming `url`."""
        started, delay, attempts = None, 0.2, 0
        while True:
            attempts += 1
            try:
                return action()
            except Exception as err:  # classified below: what another attempt cannot fix is raised at once
                problem = _access_problem(err, url)
                if problem is not None:
                    raise problem from None
                if not (isinstance(err, _WrongBytes) or _is_transient(err)):
                    raise
                now = time.monotonic()
                started = started or now
                reason = str(err) if isinstance(err, _WrongBytes) else f"{type(err).__name__}: {err}"
                if now - started + delay > self.patience_s:
                    what = ("check that the data at that URL is the one its index describes (rewrite it with "
                            "accel-train shard)" if isinstance(err, _WrongBytes) else
                            "check that the store is reachable from this machine (and AWS_ENDPOINT_URL or the "
                            "storage's own settings)")
                    raise StoreUnavailable(f"cannot {doing} {url}: {reason.splitlines()[0][:300]} ({attempts} attempts "
                                           f"in {now - started:.0f} s); {what}, then run again with resume=auto"
                                           ) from None
                if not _warned.is_set():
                    _warned.set()
                    logger.warning(f"{url}: {reason.splitlines()[0][:200]}; retrying for up to {self.patience_s:.0f} s")
                time.sleep(delay)
                delay = min(delay * 2, 5.0)


class _WrongBytes(Exception):
    """Bytes that arrived but are not the ones asked for (a body cut short, another hash)."""


class _S3Refused(Exception):
    """The store refused an S3 call (4xx): its status, and the client's error translated as s3fs translates it
    (a missing object, a refused permission), for the caller to raise where the status is not an answer."""

    def __init__(self, status: int, error: Exception) -> None:
        from s3fs.errors import translate_boto_error

        super().__init__(str(error))
        self.status, self.error = status, translate_boto_error(error)


def _digest(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


def _answered_at(answer: dict):
    """When the store answered, by its own clock (the Date header)."""
    from datetime import datetime, timezone
    from email.utils import parsedate_to_datetime

    date = answer.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    return parsedate_to_datetime(date) if date else datetime.now(timezone.utc)


LOCKED_FOR_S = 10.0  # a local conditional write waits this long for another's to end (each takes milliseconds)


@contextmanager
def _locked(path: Path):
    """The content of the local file at `path` (None where there is none), read while this process holds an exclusive
    flock of it; a file replaced or removed while the lock was awaited is opened again (the lock would be of a file
    no longer there). Unlocked explicitly: a process forked meanwhile (a DataLoader worker) shares the descriptor,
    and closing ours alone would leave the lock held by its copy."""
    deadline = time.monotonic() + LOCKED_FOR_S
    while True:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            yield None
            return
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:  # polled, not waited for: a stopped holder must not stop this one for good
                    if time.monotonic() > deadline:
                        raise OSError(f"{path} stayed locked by another process for {LOCKED_FOR_S:.0f} s") from None
                    time.sleep(0.005)
            try:
                if os.stat(path).st_ino != os.fstat(fd).st_ino:
                    continue
            except FileNotFoundError:
                continue
            with open(fd, "rb", closefd=False) as file:
                yield file.read()
            return
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
