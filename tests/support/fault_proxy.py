"""A proxy on 127.0.0.1 between an object-store client (s3fs) and its server (moto) that counts what each request
cost and, a bounded number of times, fails the way a store under load or a flaky network does: a 503 SlowDown, a
connection reset before any answer, a body cut short. It can also stop listening, so the store looks down, and
listen again on the same port.

It speaks plain HTTP/1.1 and forwards each request byte for byte (headers in their order and case, the body in its
own framing: Content-Length, `Transfer-Encoding: chunked`, aws-chunked inside either), so the client's S3 signature
and checksums stay valid. Each client connection is kept alive as long as the client keeps it, as S3 keeps them
(moto's server closes each after one answer), and has its own upstream connection."""

from __future__ import annotations

import http.client
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit

FAULTS = ("503", "reset", "truncate", "short", "hold")

# What S3 answers when a prefix is asked too fast; botocore reads the code, s3fs the code or the message.
SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
             b"<Message>Please reduce your request rate.</Message><RequestId>fault-proxy</RequestId></Error>")
# A request's own head is never this long; a longer line is a client speaking something else.
_MAX_LINE = 65536
_HOP_BY_HOP = {"connection", "keep-alive"}
# Joins wait at most this long for a thread that is mid-request upstream (moto answers in milliseconds).
_JOIN_S = 10


@dataclass(frozen=True)
class Request:
    """One request as the proxy saw it, and what it answered."""

    method: str
    path: str  # the URL's path, percent-decoded, without the query: "/bucket/key" (path-style addressing)
    query: str
    range: str | None  # the Range header as the client sent it
    status: int | None  # None where the connection was reset before any answer
    body_bytes: int  # response body bytes written to the client (a truncated body: the half that went)
    fault: str | None  # the injected fault, if any
    connection: int  # which client connection carried it: 1 for the first the proxy accepted, and so on
    headers: dict = field(repr=False)  # the request's headers, names in lower case

    @property
    def object_path(self) -> str | None:
        """"bucket/key" (fsspec's path) of a request on an object; None for one on a bucket or the service (a
        listing, a bucket's creation)."""
        bucket_and_key = self.path.lstrip("/")
        return bucket_and_key if "/" in bucket_and_key.rstrip("/") else None


@dataclass
class _Pending:
    kind: str
    left: int
    match: Callable[[str, str], bool] | None


def under(prefix: str) -> str:
    """"bucket/key..." from an s3:// URL, a "/bucket/key" path or "bucket/key" itself."""
    return prefix.removeprefix("s3://").lstrip("/")


class FaultProxy:
    """An HTTP/1.1 proxy on 127.0.0.1 (`port` 0: a free one) in front of `upstream_host:upstream_port`, listening from
    construction. See the module's docstring; `requests` lists every request, `inject` queues faults.

    Its counts and faults may be read and set from any thread; start(), stop() and close() are the test's own
    calls. close() (or leaving a `with` block) ends every thread it started."""

    def __init__(self, upstream_host: str, upstream_port: int, port: int = 0, upstream_timeout_s: float = 60) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.upstream_timeout_s = upstream_timeout_s
        self._port = port
        self._lock = threading.RLock()  # a `match` may read the counts
        self._records: list[Request] = []
        self._pending: list[_Pending] = []
        self.holding = threading.Event()  # a request is held ("hold"), not yet forwarded
        self._released = threading.Event()
        self._clients: set[socket.socket] = set()
        self._accepted = 0
        self._threads: set[threading.Thread] = set()
        self._listener: socket.socket | None = None
        self._acceptor: threading.Thread | None = None
        self.start()

    # Listening

    @property
    def port(self) -> int:
        return self._port

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self._port}"

    @property
    def running(self) -> bool:
        return self._listener is not None

    def start(self) -> None:
        """Listen (again) on this proxy's port: the first start takes a free one, later ones the same, so URLs and
        clients made before a stop() reach it again. Raises OSError if another socket took the port meanwhile."""
        if self.running:
            return
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        # The connections of the last run linger in TIME_WAIT on this port; they must not stop a new listener.
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self._port))
        listener.listen(64)
        self._port = listener.getsockname()[1]
        self._listener = listener
        self._acceptor = threading.Thread(target=self._accept, args=(listener,), name=f"fault-proxy-{self._port}",
                                          daemon=True)
        self._acceptor.start()

    def stop(self) -> None:
        """Stop listening and close every client connection: the store looks down (connection refused) until
        start(). A request being forwarded at that moment gets no answer."""
        listener, self._listener = self._listener, None
        if listener is not None:
            try:
                listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() blocked in the acceptor thread
            except OSError:
                pass
            listener.close()
            self._acceptor.join(_JOIN_S)
        self.disconnect_clients()

    def disconnect_clients(self) -> None:
        """Close every client connection, still listening (as a server that closes idle keep-alive connections);
        returns once their threads have ended."""
        with self._lock:
            clients, threads = list(self._clients), list(self._threads)
        for client in clients:
            try:
                # Only shut down here: the connection's own thread closes the socket (closing another thread's file
                # descriptor could close a new socket given the same number).
                client.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for thread in threads:
            thread.join(_JOIN_S)

    def close(self) -> None:
        self.stop()

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # Faults

    def inject(self, kind: str, times: int = 1, match: Callable[[str, str], bool] | None = None) -> None:
        """The next `times` requests for which `match(method, path)` holds (every request if None) get `kind`:
        "503": an S3 SlowDown error, status 503, not forwarded; "reset": the connection is reset (RST) once the
        request is read, before any answer, not forwarded; "truncate": forwarded, and the answer's head goes out
        whole (its Content-Length too) but only the first half of its body, then the connection is closed;
        "short": forwarded, and the answer says it is half as long as it is and is that half (a body cut short
        that no client can tell from a whole one: only a check of the bytes finds it); "hold": not answered (nor
        forwarded) until release() (`holding` is set meanwhile), then forwarded: an upload that takes as long as a
        test needs, to kill its client in the middle.
        Faults injected earlier are taken first."""
        if kind not in FAULTS:
            raise ValueError(f"unknown fault {kind!r}: one of {FAULTS}")
        if times < 1:
            raise ValueError(f"times={times}: a fault applies to at least one request")
        with self._lock:
            self._pending.append(_Pending(kind, times, match))

    def clear_faults(self) -> None:
        """Forget the faults not applied yet."""
        with self._lock:
            self._pending.clear()

    def release(self) -> None:
        """Forward the held requests (and those held from now on at once)."""
        self._released.set()

    def pending_faults(self) -> int:
        """How many requests the faults injected and not applied yet would still hit."""
        with self._lock:
            return sum(pending.left for pending in self._pending)

    def _take_fault(self, method: str, path: str) -> str | None:
        with self._lock:
            for pending in self._pending:
                if pending.match is None or pending.match(method, path):
                    pending.left -= 1
                    if not pending.left:
                        self._pending.remove(pending)
                    return pending.kind
        return None

    # Counts

    @property
    def requests(self) -> list[Request]:
        """Every request since the last reset_counts(), in the order they were answered (a copy)."""
        with self._lock:
            return list(self._records)

    def reset_counts(self) -> None:
        with self._lock:
            self._records.clear()

    def reset(self) -> None:
        """reset_counts() and clear_faults(): as new."""
        with self._lock:
            self._records.clear()
            self._pending.clear()
        self._released.set()  # a request still held from the last test goes on
        self._released, self.holding = threading.Event(), threading.Event()

    def object_gets(self, prefix: str = "") -> list[Request]:
        """The GETs of objects under `prefix` (an s3:// URL, "bucket/key..." or "/bucket/key...") that the store
        answered with their data (200 or 206, truncated ones included); listings are not objects."""
        start = under(prefix)
        return [request for request in self.requests if request.method == "GET" and request.status in (200, 206)
                and request.object_path is not None and request.object_path.startswith(start)]

    def bytes_read(self, prefix: str = "") -> int:
        """Object data sent to clients: the body bytes of object_gets(prefix)."""
        return sum(request.body_bytes for request in self.object_gets(prefix))

    def bytes_read_by_object(self, prefix: str = "") -> dict[str, int]:
        """bytes_read(prefix) per object ("bucket/key"): an object read whole once has its size here."""
        read: dict[str, int] = {}
        for request in self.object_gets(prefix):
            read[request.object_path] = read.get(request.object_path, 0) + request.body_bytes
        return read

    def faults_applied(self, kind: str | None = None) -> int:
        """How many requests got an injected fault (of `kind`, or any)."""
        return sum(1 for request in self.requests if request.fault is not None and kind in (None, request.fault))

    def _record(self, request: Request) -> None:
        with self._lock:
            self._records.append(request)

    # Serving

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:  # stop() shut the listener down
                return
            with self._lock:
                self._accepted += 1
                thread = threading.Thread(target=self._serve, args=(client, self._accepted), daemon=True,
                                          name=f"fault-proxy-{self._port}-client-{self._accepted}")
                if self._listener is not listener:  # stopped between accept() and here
                    client.close()
                    return
                self._clients.add(client)
                self._threads.add(thread)
            thread.start()

    def _serve(self, client: socket.socket, number: int) -> None:
        """One client connection, request after request, until the client or the proxy closes it."""
        reader = client.makefile("rb")
        upstream = _Upstream(*self.upstream, self.upstream_timeout_s)
        try:
            while self._serve_one(client, number, reader, upstream):
                pass
        except (OSError, ValueError, http.client.HTTPException):
            pass  # the client went away, the proxy was stopped, or upstream failed: the client sees a closed socket
        finally:
            upstream.close()
            reader.close()
            client.close()
            with self._lock:
                self._clients.discard(client)
                self._threads.discard(threading.current_thread())

    def _serve_one(self, client: socket.socket, number: int, reader, upstream: _Upstream) -> bool:
        """Read one request, answer it; whether the connection stays open for another."""
        head = _read_head(reader)
        if head is None:
            return False
        method, target, headers = head
        fields = {name.lower(): value for name, value in headers}
        if fields.get("expect", "").lower() == "100-continue":  # a client that waits for it before its body
            client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
        body = _read_body(reader, fields)
        url = urlsplit(target)
        seen = dict(method=method, path=unquote(url.path), query=url.query, range=fields.get("range"),
                    connection=number, headers=fields)
        keep_alive = "close" not in fields.get("connection", "").lower()
        fault = self._take_fault(method, seen["path"])
        # Each answer is recorded before its last byte goes out: a client that has its answer finds it counted.
        if fault == "reset":
            self._record(Request(**seen, status=None, body_bytes=0, fault=fault))
            _reset(client, reader)
            return False
        if fault == "503":
            error = SLOW_DOWN if method != "HEAD" else b""
            reply = [("Content-Type", "application/xml"), ("Content-Length", str(len(SLOW_DOWN))),
                     ("x-amz-request-id", "fault-proxy")]
            self._record(Request(**seen, status=503, body_bytes=len(error), fault=fault))
            client.sendall(_head(503, "Slow Down", reply) + error)
            return keep_alive
        if fault == "hold":
            self.holding.set()
            self._released.wait(timeout=300)
        response = upstream.forward(method, target, headers, body)
        data = response.read()  # the whole body: http.client undoes a chunked encoding, which is re-done below
        chunked = "chunked" in (response.getheader("Transfer-Encoding") or "").lower()
        framed = chunked or response.getheader("Content-Length") is not None or method == "HEAD" or \
            response.status in (204, 304)
        keep_alive = keep_alive and framed
        # Connection and Keep-Alive are about one hop (RFC 9110, 7.6.1): moto's server closes every connection
        # (werkzeug answers "Connection: close"), S3 keeps them; the client's connection stays open as S3's would.
        reply = [(name, value) for name, value in response.getheaders() if name.lower() not in _HOP_BY_HOP]
        head = _head(response.status, response.reason, reply + ([] if keep_alive else [("Connection", "close")]))
        if fault in ("truncate", "short"):
            data = data[:len(data) // 2]
        if fault == "short":
            head = _head(response.status, response.reason,
                         [(name, str(len(data)) if name.lower() == "content-length" else value)
                          for name, value in reply + ([] if keep_alive else [("Connection", "close")])])
        self._record(Request(**seen, status=response.status, body_bytes=len(data), fault=fault))
        client.sendall(head + _framed(data, chunked, end=fault in (None, "hold")))
        if fault == "truncate":
            client.shutdown(socket.SHUT_RDWR)  # a close, not a reset: the client reads a body that ends early
            return False
        return keep_alive


class _Upstream:
    """The upstream connection of one client connection: opened at a request when none is open (moto's server
    closes it after each answer), kept while upstream keeps it, and opened again once when a kept one turns out
    closed."""

    def __init__(self, host: str, port: int, timeout_s: float) -> None:
        self.host, self.port, self.timeout_s = host, port, timeout_s
        self.connection: http.client.HTTPConnection | None = None

    def forward(self, method: str, target: str, headers: list[tuple[str, str]],
                body: bytes) -> http.client.HTTPResponse:
        reused = self.connection is not None and self.connection.sock is not None
        try:
            return self._send(method, target, headers, body)
        except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
            if not reused:
                raise
            self.close()  # upstream closed the idle connection before this request reached it: nothing was done
            return self._send(method, target, headers, body)

    def _send(self, method, target, headers, body) -> http.client.HTTPResponse:
        if self.connection is None:
            self.connection = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
        connection = self.connection
        # The client's own Host (it is signed) and no header of http.client's: the request goes as it came.
        connection.putrequest(method, target, skip_host=True, skip_accept_encoding=True)
        for name, value in headers:
            connection.putheader(name, value)
        connection.endheaders()
        if body:
            connection.send(body)
        return connection.getresponse()

    def close(self) -> None:
        if self.connection is not None:
            self.connection.close()
            self.connection = None


def _read_head(reader) -> tuple[str, str, list[tuple[str, str]]] | None:
    """(method, target, headers in order) of the next request; None when the client closed the connection."""
    line = reader.readline(_MAX_LINE + 1)
    while line in (b"\r\n", b"\n"):  # blank lines before a request are allowed (RFC 9112, 2.2)
        line = reader.readline(_MAX_LINE + 1)
    if not line:
        return None
    method, target, _version = line.decode("latin-1").split()
    message = http.client.parse_headers(reader)
    return method, target, list(message.items())


def _read_body(reader, fields: dict) -> bytes:
    """The request's body in its own framing: a chunked body with its chunk lines and trailers, as it came."""
    if "chunked" in fields.get("transfer-encoding", "").lower():
        raw = bytearray()
        while True:
            line = reader.readline(_MAX_LINE + 1)
            if not line.endswith(b"\n"):
                raise ValueError("chunked request body cut short")
            raw += line
            size = int(line.split(b";")[0], 16)
            if size == 0:
                break
            raw += _read_exactly(reader, size + 2)  # the chunk and its CRLF
        while True:  # trailers (aws-chunked checksums may come as trailers), then an empty line
            line = reader.readline(_MAX_LINE + 1)
            if not line.endswith(b"\n"):
                raise ValueError("chunked request body cut short")
            raw += line
            if line in (b"\r\n", b"\n"):
                return bytes(raw)
    return _read_exactly(reader, int(fields.get("content-length", 0)))


def _read_exactly(reader, size: int) -> bytes:
    data = reader.read(size)
    if len(data) != size:
        raise ValueError(f"request body cut short: {len(data)} of {size} bytes")
    return data


def _head(status: int, reason: str, headers: list[tuple[str, str]]) -> bytes:
    lines = [f"HTTP/1.1 {status} {reason}"] + [f"{name}: {value}" for name, value in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _framed(data: bytes, chunked: bool, end: bool) -> bytes:
    """`data` as a response body: as it is, or as one chunk and (with `end`) the last chunk."""
    if not chunked:
        return data
    return (b"%x\r\n%s\r\n" % (len(data), data) if data else b"") + (b"0\r\n\r\n" if end else b"")


def _reset(client: socket.socket, reader) -> None:
    """Close with a RST instead of a FIN: linger on, timeout 0, as a crashed peer or a middlebox would."""
    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    reader.close()  # the file made by makefile() holds the socket open until it is closed too
    client.close()
