"""The `object_store` fixture and its FaultProxy (support/object_store.py, support/fault_proxy.py), through s3fs as
users reach it (fsspec): what goes in comes back, the proxy counts the bytes each read cost, each fault happens the
number of times asked and then requests pass, a stopped store fails a read in bounded time, and nothing of one test
is left in the next.

What s3fs (2026.9, aiobotocore on aiohttp) does with each fault, as these tests show it:
- 503 SlowDown: botocore retries it (the same invocation, attempt=2); past botocore's attempts s3fs's own loop
  retries it (a new invocation), and past those (5) s3fs raises OSError(EBUSY, "Please reduce your request rate.").
- a reset: aiohttp retries once on a fresh connection when the reset one was a kept-alive one, botocore retries
  it; s3fs does not, and raises botocore's EndpointConnectionError (not an OSError) once botocore gives up.
- a body cut short: botocore does not see it (the answer was a 200); s3fs's loop retries it (5 attempts), then
  raises aiohttp's ClientPayloadError (not an OSError).
- a store that is down (connection refused): botocore retries; s3fs does not; EndpointConnectionError. By default
  (legacy mode, 5 attempts) that takes up to 15 s (2 to 11 s measured); under support.object_store.FAIL_FAST
  (standard mode, 2 attempts), at most about 1 s.
PUTs and HEADs fare as GETs with a 503 or a reset; a cut short answer to either has no body to cut.
"""

import http.client
import http.server
import os
import socket
import threading
import time

import pytest

from support.commands import PYTHON, run_command
from support.fault_proxy import FaultProxy
from support.object_store import FAIL_FAST

MB = 2**20
# One attempt by botocore: what s3fs's own retry loop does, alone.
BOTOCORE_ONCE = {"config_kwargs": {"retries": {"mode": "standard", "total_max_attempts": 1}}}
S3FS_ATTEMPTS = 5  # s3fs.S3FileSystem.retries, a class attribute


def method_is(method: str):
    """A fault's `match`: the requests of `method`, whatever their path."""
    return lambda request_method, path: request_method == method


def attempt_of(request) -> tuple[str, str]:
    """(botocore's invocation id, "attempt=N"): a retry by botocore keeps the id, a new call by s3fs gets another."""
    return request.headers["amz-sdk-invocation-id"], request.headers["amz-sdk-request"].split(";")[0]


# Reading and writing


def test_an_object_written_is_read_back_whole_by_range_and_through_a_file(object_store):
    fs, data = object_store.fs(), os.urandom(1000)
    fs.pipe(object_store.url("a/b.bin"), data)

    assert fs.cat(object_store.url("a/b.bin")) == data
    assert fs.cat_file(object_store.url("a/b.bin"), start=100, end=300) == data[100:300]
    with fs.open(object_store.url("a/b.bin"), "rb") as file:
        file.seek(900)
        assert file.read() == data[900:]
    assert fs.ls(object_store.url("a"), detail=False) == [f"{object_store.bucket}/a/b.bin"]


def test_a_10_mb_object_goes_up_in_a_multipart_upload_and_comes_back(object_store, tmp_path):
    fs, data = object_store.fs(), os.urandom(10 * MB)
    (tmp_path / "big.bin").write_bytes(data)
    fs.put_file(str(tmp_path / "big.bin"), object_store.url("big.bin"), chunksize=5 * MB)  # S3's smallest part

    sent = [(request.method, request.query.split("=")[0]) for request in object_store.proxy.requests
            if request.method in ("POST", "PUT")]
    assert sent == [("POST", "uploads"), ("PUT", "partNumber"), ("PUT", "partNumber"), ("POST", "uploadId")]
    assert fs.cat(object_store.url("big.bin")) == data
    assert fs.cat_file(object_store.url("big.bin"), start=5 * MB - 10, end=5 * MB + 10) == \
        data[5 * MB - 10:5 * MB + 10]


# Counting


def test_the_bytes_of_a_ranged_and_a_whole_read_are_counted_exactly(object_store):
    fs, proxy, data = object_store.fs(), object_store.proxy, os.urandom(3 * MB + 7)
    fs.pipe(object_store.url("shards/0.tar"), data)
    fs.pipe(object_store.url("other/1.tar"), b"x" * 100)
    proxy.reset_counts()

    assert fs.cat_file(object_store.url("shards/0.tar"), start=1000, end=5000) == data[1000:5000]
    assert proxy.bytes_read(object_store.url("shards/")) == 4000
    assert [request.range for request in proxy.object_gets()] == ["bytes=1000-4999"]
    assert [request.status for request in proxy.object_gets()] == [206]

    proxy.reset_counts()
    assert fs.cat(object_store.url("shards/0.tar")) == data
    fs.ls(object_store.url("shards"))  # a listing is a GET on the bucket, not a read of an object
    assert proxy.bytes_read(object_store.url("shards/")) == len(data)
    assert proxy.bytes_read_by_object() == {f"{object_store.bucket}/shards/0.tar": len(data)}
    assert proxy.bytes_read(object_store.url("other/")) == 0
    methods = [request.method for request in proxy.requests]
    assert methods.count("HEAD") == 1 and methods.count("GET") == 2  # the size, the object, the listing


def test_a_clients_requests_share_a_kept_alive_connection_though_moto_closes_each(object_store):
    fs = object_store.fs()
    for index in range(5):  # one after the other: aiohttp needs no second connection
        fs.pipe(object_store.url(f"k{index}"), b"x")
        assert fs.cat(object_store.url(f"k{index}")) == b"x"

    requests = object_store.proxy.requests
    assert len(requests) == 15 and len({request.connection for request in requests}) == 1


def test_plain_s3_urls_in_this_process_reach_the_proxy_through_the_environment(object_store):
    import fsspec

    object_store.fs().pipe(object_store.url("plain.txt"), b"through the environment")
    object_store.proxy.reset_counts()

    with fsspec.open(object_store.url("plain.txt"), "rb") as file:  # no endpoint, no credentials given
        assert file.read() == b"through the environment"
    assert object_store.proxy.bytes_read(object_store.url("plain.txt")) == len(b"through the environment")


READ_TO_STDOUT = """
import sys, fsspec
with fsspec.open(sys.argv[1], "rb") as file:
    sys.stdout.write(file.read().decode())
"""


def test_a_process_started_with_the_environment_reads_through_the_proxy_and_is_counted(object_store):
    object_store.fs().pipe(object_store.url("for/another/process.txt"), b"read by another process")
    object_store.proxy.reset_counts()

    result = run_command([PYTHON, "-c", READ_TO_STDOUT, object_store.url("for/another/process.txt")], timeout=120,
                         check=True, env=object_store.env)

    assert result.stdout == "read by another process"
    assert object_store.proxy.bytes_read(object_store.url("for/")) == len(b"read by another process")


# Faults: each happens `times` times, then requests pass


def test_a_503_is_retried_by_botocore_within_one_call_transparently(object_store):
    fs, proxy = object_store.fs(), object_store.proxy
    fs.pipe(object_store.url("k"), b"data")
    proxy.reset_counts()
    proxy.inject("503", times=1, match=method_is("GET"))

    assert fs.cat_file(object_store.url("k")) == b"data"

    failed, passed = [request for request in proxy.requests if request.method == "GET"]
    assert (failed.status, failed.fault, passed.status, passed.fault) == (503, "503", 200, None)
    assert attempt_of(failed)[1] == "attempt=1" and attempt_of(passed) == (attempt_of(failed)[0], "attempt=2")
    assert proxy.pending_faults() == 0


def test_a_503_past_botocores_attempts_is_retried_by_s3fs_then_raises_oserror(object_store):
    fs, proxy = object_store.fs(**BOTOCORE_ONCE), object_store.proxy
    fs.pipe(object_store.url("k"), b"data")
    proxy.reset_counts()

    proxy.inject("503", times=2, match=method_is("GET"))
    assert fs.cat_file(object_store.url("k")) == b"data"
    calls = [attempt_of(request) for request in proxy.requests if request.method == "GET"]
    assert len(calls) == 3 and len({call for call, _ in calls}) == 3  # three calls by s3fs, one attempt each

    proxy.reset_counts()
    proxy.inject("503", times=S3FS_ATTEMPTS, match=method_is("GET"))
    with pytest.raises(OSError, match="reduce your request rate"):
        fs.cat_file(object_store.url("k"))
    assert proxy.faults_applied("503") == S3FS_ATTEMPTS
    assert fs.cat_file(object_store.url("k")) == b"data"  # the faults are spent


def test_a_reset_is_retried_transparently(object_store):
    fs, proxy = object_store.fs(), object_store.proxy
    fs.pipe(object_store.url("k"), b"data")
    proxy.reset_counts()
    proxy.inject("reset", times=3, match=method_is("GET"))

    assert fs.cat_file(object_store.url("k")) == b"data"

    assert [(request.status, request.fault) for request in proxy.requests if request.method == "GET"] == \
        [(None, "reset")] * 3 + [(200, None)]


def test_a_reset_that_persists_past_botocores_attempts_raises_endpoint_connection_error(object_store):
    from botocore.exceptions import EndpointConnectionError

    fs, proxy = object_store.fs(**BOTOCORE_ONCE), object_store.proxy
    fs.pipe(object_store.url("k"), b"data")
    proxy.inject("reset", times=100, match=method_is("GET"))

    with pytest.raises(EndpointConnectionError):  # s3fs does not retry it; not an OSError
        fs.cat_file(object_store.url("k"))
    # aiohttp itself sends the request again once when the reset connection was one it kept alive
    assert 1 <= proxy.faults_applied("reset") <= 2

    proxy.clear_faults()
    assert fs.cat_file(object_store.url("k")) == b"data"


def test_a_truncated_body_is_retried_by_s3fs_then_raises_aiohttps_client_payload_error(object_store):
    from aiohttp import ClientPayloadError

    fs, proxy, data = object_store.fs(), object_store.proxy, os.urandom(1000)
    fs.pipe(object_store.url("k"), data)
    proxy.reset_counts()

    proxy.inject("truncate", times=2, match=method_is("GET"))
    assert fs.cat_file(object_store.url("k"), start=0, end=1000) == data
    gotten = [request for request in proxy.requests if request.method == "GET"]
    assert [(request.fault, request.body_bytes) for request in gotten] == [("truncate", 500)] * 2 + [(None, 1000)]
    assert len({attempt_of(request)[0] for request in gotten}) == 3  # not botocore's retries: s3fs's own calls
    assert proxy.bytes_read() == 2000  # the halves that went count too

    proxy.reset_counts()
    proxy.inject("truncate", times=S3FS_ATTEMPTS, match=method_is("GET"))
    with pytest.raises(ClientPayloadError):  # not an OSError
        fs.cat_file(object_store.url("k"), start=0, end=1000)
    assert proxy.faults_applied("truncate") == S3FS_ATTEMPTS
    assert fs.cat_file(object_store.url("k"), start=0, end=1000) == data


def test_a_short_body_whose_length_says_it_is_whole_passes_the_client_unnoticed(object_store):
    # Why readers of the store check the bytes themselves (the shards' blocks against their sha256): a body cut
    # short by a server or a middlebox that also cut its Content-Length reaches the caller as if it were whole.
    # (A whole object's answer carries its checksum, which botocore checks; a range of it, what shards read, not.)
    fs, proxy, data = object_store.fs(), object_store.proxy, os.urandom(2000)
    fs.pipe(object_store.url("k"), data)
    proxy.inject("short", times=1, match=method_is("GET"))
    assert fs.cat_file(object_store.url("k"), start=0, end=1000) == data[:500]
    assert proxy.faults_applied("short") == 1
    assert fs.cat_file(object_store.url("k"), start=0, end=1000) == data[:1000]


def test_a_fault_hits_only_the_requests_it_matches(object_store):
    fs, proxy = object_store.fs(), object_store.proxy
    fs.pipe(object_store.url("a"), b"a")
    fs.pipe(object_store.url("b"), b"b")
    proxy.reset_counts()
    proxy.inject("reset", times=1, match=lambda method, path: path.endswith("/b"))

    assert fs.cat_file(object_store.url("a")) == b"a"
    assert proxy.faults_applied() == 0 and proxy.pending_faults() == 1
    assert fs.cat_file(object_store.url("b")) == b"b"
    assert [(request.method, request.path) for request in proxy.requests if request.fault] == \
        [("HEAD", f"/{object_store.bucket}/b")]


# A store that is down


def test_a_stopped_store_refuses_connections_and_fails_a_read_within_a_second_under_fail_fast(object_store):
    from botocore.exceptions import EndpointConnectionError

    fs = object_store.fs(**FAIL_FAST)
    fs.pipe(object_store.url("k"), b"data")
    port = object_store.proxy.port

    with object_store.down():
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        start = time.monotonic()
        with pytest.raises(EndpointConnectionError, match="Could not connect to the endpoint URL"):
            fs.cat_file(object_store.url("k"))
        took = time.monotonic() - start
    # Refused at once, one backoff of at most 1 s, one more refusal; the default settings take 7 to 11 s.
    assert took < 3, f"a read from a stopped store took {took:.1f} s"

    assert object_store.proxy.port == port
    assert fs.cat_file(object_store.url("k")) == b"data"  # the same client, the same address: up again


# Nothing of one test in the next (these two run in this order)


def test_state_1_a_test_leaves_an_object_a_fault_and_a_stopped_proxy_behind(object_store):
    object_store.fs().pipe(object_store.url("left-behind"), b"x")
    object_store.proxy.inject("503", times=5)
    object_store.proxy.stop()


def test_state_2_the_next_test_finds_an_empty_bucket_no_fault_no_count_and_the_proxy_up(object_store):
    assert object_store.proxy.requests == []
    assert object_store.proxy.pending_faults() == 0
    fs = object_store.fs()
    assert not fs.exists(object_store.url("left-behind"))
    assert fs.ls(object_store.url(), detail=False) == []
    assert os.environ["AWS_ENDPOINT_URL"] == object_store.endpoint_url == object_store.proxy.endpoint_url


# The proxy itself, before an upstream that echoes what it receives


class Echo(http.server.BaseHTTPRequestHandler):
    """Answers every request with its method, its path and its body as it came (a chunked one with its framing),
    over kept-alive connections."""

    protocol_version = "HTTP/1.1"

    def do_GET(self):
        self.answer(b"")

    def do_HEAD(self):
        self.send_response(200)
        self.send_header("Content-Length", "1234")
        self.end_headers()

    def do_PUT(self):
        if "chunked" in self.headers.get("Transfer-Encoding", ""):
            raw = b""
            while True:
                line = self.rfile.readline()
                raw += line
                if int(line.split(b";")[0], 16) == 0:
                    break
                raw += self.rfile.readline()  # this test's chunks hold no line end
            while (line := self.rfile.readline()) not in (b"\r\n", b"\n"):  # the trailers
                raw += line
            self.answer(raw + line)
        else:
            self.answer(self.rfile.read(int(self.headers.get("Content-Length", 0))))

    def answer(self, body):
        reply = f"{self.command} {self.path}|".encode() + body
        self.send_response(200)
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args):
        pass


@pytest.fixture
def echo_proxy():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Echo)
    serving = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)  # shutdown() polls
    serving.start()
    try:
        with FaultProxy(*server.server_address) as proxy:
            yield proxy
    finally:
        server.shutdown()
        server.server_close()
        serving.join()


# As aws-chunked uploads send it over https (botocore sends it over http, as here, only with Content-Length): a chunk
# extension and a checksum in a trailer.
CHUNKED = b"6;chunk-signature=ab\r\nhello \r\n8\r\nchunked \r\n5\r\nworld\r\n0\r\nx-amz-checksum-crc32: AAAA\r\n\r\n"


def test_the_proxy_forwards_chunked_bodies_head_and_many_requests_on_one_kept_connection(echo_proxy):
    connection = http.client.HTTPConnection("127.0.0.1", echo_proxy.port, timeout=10)
    connection.request("PUT", "/b/chunked", body=CHUNKED, headers={"Transfer-Encoding": "chunked"})
    assert connection.getresponse().read() == b"PUT /b/chunked|" + CHUNKED  # byte for byte
    kept = connection.sock  # http.client drops it at an answer that closes the connection
    connection.request("PUT", "/b/sized", body=b"12345")
    assert connection.getresponse().read() == b"PUT /b/sized|12345"
    connection.request("HEAD", "/b/sized")
    head = connection.getresponse()
    assert head.getheader("Content-Length") == "1234" and head.read() == b""
    connection.request("GET", "/b/key%20with%20space?x=1", headers={"Range": "bytes=0-1"})
    assert connection.getresponse().read() == b"GET /b/key%20with%20space?x=1|"
    assert connection.sock is kept
    connection.close()

    assert [(r.method, r.path, r.query, r.range, r.status, r.connection) for r in echo_proxy.requests] == [
        ("PUT", "/b/chunked", "", None, 200, 1), ("PUT", "/b/sized", "", None, 200, 1),
        ("HEAD", "/b/sized", "", None, 200, 1), ("GET", "/b/key with space", "x=1", "bytes=0-1", 200, 1)]


def test_the_proxy_ends_every_thread_it_started_when_closed():
    def proxy_threads():
        return [thread for thread in threading.enumerate() if thread.name.startswith(f"fault-proxy-{port}")]

    with socket.socket() as silent:  # an upstream never reached: the requests below get faults or nothing
        silent.bind(("127.0.0.1", 0))
        proxy = FaultProxy(*silent.getsockname())
        port = proxy.port
        kept = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]  # idle, kept-alive clients
        deadline = time.monotonic() + 5
        while len(proxy_threads()) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(proxy_threads()) == 4  # the acceptor, one per client

        proxy.close()
        assert proxy_threads() == []
        assert all(client.recv(1) == b"" for client in kept)  # closed under them
        for client in kept:
            client.close()
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5)


def test_the_proxy_listens_again_on_its_port_after_a_stop(echo_proxy):
    port = echo_proxy.port
    echo_proxy.stop()
    echo_proxy.start()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    connection.request("GET", "/again")
    assert connection.getresponse().read() == b"GET /again|"
    connection.close()


def test_an_unknown_fault_is_refused_naming_the_known_ones(echo_proxy):
    with pytest.raises(ValueError, match="'503', 'reset', 'truncate'"):
        echo_proxy.inject("timeout")

