"""An S3 endpoint on 127.0.0.1 for tests: moto's server in a thread of this process (ThreadedMotoServer, as s3fs
tests itself), behind a FaultProxy (support.fault_proxy) that counts and breaks the traffic. One of each per pytest
process, started by the first test that asks; each test gets them reset, with one empty bucket and the environment
that points s3fs (through fsspec) at the proxy, in this process and in the processes the test starts.

No process is started here (the server and the proxy are threads), so a test that uses the store stays in the fast
tier unless it starts processes itself. moto (about 1 s to import) is imported by the first such test only; it and
s3fs must be installed (moto's `server` extra brings werkzeug and flask)."""

from __future__ import annotations

import functools
import http.client
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest

from support.fault_proxy import FaultProxy

BUCKET = "accel-train-test"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
REGION = "us-east-1"

# S3FileSystem options under which a read from a store that is down fails within about a second: botocore makes 2
# attempts (standard mode: one backoff of at most 1 s between them), each connect gives up after 1 s where the port
# is silent rather than refused, and s3fs's own retry loop (5 attempts, a class attribute, not an option) does not
# retry a failed connect. By default botocore makes 5 attempts (legacy mode, up to 1 + 2 + 4 + 8 s of backoff: 2 to
# 11 s measured against a refused port). Transient faults (503, a reset, a cut body) are still retried under these.
FAIL_FAST = {"config_kwargs": {"connect_timeout": 1, "read_timeout": 5,
                               "retries": {"mode": "standard", "total_max_attempts": 2}}}


@dataclass
class Served:
    """moto's server and the proxy in front of it: the pair a pytest process shares among its tests."""

    moto: object  # moto.server.ThreadedMotoServer
    moto_address: tuple[str, int]
    proxy: FaultProxy


@functools.cache
def served() -> Served:
    """This process's moto server and proxy, started at the first call; they live as long as the process (their
    threads are daemons) and keep their ports, so a client made in one test (fsspec caches filesystems by their
    arguments) reaches the same store in the next."""
    from moto.server import ThreadedMotoServer

    # werkzeug logs a line per request at INFO; kept for warnings and errors.
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    moto.start()
    address = moto._server.server_address[:2]  # moto.get_host_and_port() is newer than moto 5.0, the floor
    return Served(moto, address, FaultProxy(*address))


@dataclass
class ObjectStore:
    """What a test gets from the `object_store` fixture: an empty store with `bucket` in it, reached through `proxy`.

    `env` points AWS clients at the proxy with test credentials; the fixture has put it in os.environ (and taken
    every other AWS_* variable out) for the test, so the commands of support.commands, which copy os.environ,
    reach the store too."""

    endpoint_url: str
    env: dict
    bucket: str
    proxy: FaultProxy

    def url(self, path: str = "") -> str:
        """"s3://BUCKET/path"."""
        return f"s3://{self.bucket}/{path.lstrip('/')}"

    def fs(self, **options):
        """A new s3fs filesystem on the proxy, as fsspec.filesystem("s3") gives users, with no instance or listings
        cache (it sees every write made since); `options` go to S3FileSystem (FAIL_FAST, for one)."""
        import fsspec

        return fsspec.filesystem("s3", endpoint_url=self.endpoint_url, key=CREDENTIALS["AWS_ACCESS_KEY_ID"],
                                 secret=CREDENTIALS["AWS_SECRET_ACCESS_KEY"], skip_instance_cache=True,
                                 use_listings_cache=False, **options)

    @contextmanager
    def down(self) -> Iterator[None]:
        """The store is down (connection refused) inside the block, up again after it, at the same address."""
        self.proxy.stop()
        try:
            yield
        finally:
            self.proxy.start()


def store_env(endpoint_url: str) -> dict:
    """The variables that point botocore (so s3fs) at `endpoint_url`, with test credentials and no file of the
    user's AWS set-up read: no ~/.aws/config or credentials, no instance metadata."""
    return {"AWS_ENDPOINT_URL": endpoint_url, **CREDENTIALS, "AWS_DEFAULT_REGION": REGION,
            "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
            "AWS_EC2_METADATA_DISABLED": "true"}


_module_store: ObjectStore | None = None  # the store a whole module shares, while it does


@contextmanager
def object_store_for_module() -> Iterator[ObjectStore]:
    """object_store_for_test for a whole test module: emptied once, at its start, so that what a module fixture
    writes there (shards written once, read by every test of the module) stays. The tests of such a module share
    its contents, counts and faults: each resets the counts it reads and clears the faults it leaves; none can ask
    for a store of its own (that would empty this one), and asking is refused."""
    global _module_store
    with pytest.MonkeyPatch.context() as monkeypatch, object_store_for_test(monkeypatch) as store:
        _module_store = store
        try:
            yield store
        finally:
            _module_store = None


@contextmanager
def object_store_for_test(monkeypatch: pytest.MonkeyPatch) -> Iterator[ObjectStore]:
    """The shared store emptied, the proxy's counts and faults cleared, `BUCKET` created, and os.environ pointing at
    the proxy (restored by `monkeypatch` after the test). After the test the proxy listens again if the test
    stopped it, forgets faults the test left, and closes the connections clients keep alive, so no thread of one
    test's clients waits into the next."""
    if _module_store is not None:
        raise RuntimeError("this module shares one store (object_store_for_module: the module_object_store fixture); "
                           "a test of it asking for an empty one of its own would empty the module's")
    shared = served()
    _request(shared.moto_address, "POST", "/moto-api/reset")
    shared.proxy.start()
    shared.proxy.reset()
    env = store_env(shared.proxy.endpoint_url)
    for name in list(os.environ):
        # A developer's AWS_PROFILE, AWS_ENDPOINT_URL_S3 (it wins over AWS_ENDPOINT_URL), session token or checksum
        # settings would change what the test talks to or how.
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    store = ObjectStore(shared.proxy.endpoint_url, env, BUCKET, shared.proxy)
    _create_bucket(BUCKET, shared.moto_address)
    try:
        yield store
    finally:
        shared.proxy.clear_faults()
        shared.proxy.disconnect_clients()
        shared.proxy.start()


def _request(address: tuple[str, int], method: str, path: str, headers: dict | None = None) -> None:
    """A request to moto itself, not through the proxy (http.client: no HTTP_PROXY of the environment applies)."""
    connection = http.client.HTTPConnection(*address, timeout=30)
    try:
        connection.request(method, path, headers=headers or {})
        response = connection.getresponse()
        body = response.read()
        assert response.status == 200, f"moto: {method} {path} answered {response.status}: {body[:500]!r}"
    finally:
        connection.close()


def _create_bucket(bucket: str, moto_address: tuple[str, int]) -> None:
    """Made on moto directly, so the test's counts start at zero, its faults hit only its own requests, and no
    client is built for it (10 ms, not 100). moto checks no signature: an Authorization header naming the s3 service
    routes the request; the credentials and date in it are never verified."""
    scope = f"{CREDENTIALS['AWS_ACCESS_KEY_ID']}/20260101/{REGION}/s3/aws4_request"
    authorization = f"AWS4-HMAC-SHA256 Credential={scope}, SignedHeaders=host, Signature=0"
    _request(moto_address, "PUT", f"/{bucket}", {"Authorization": authorization, "Content-Length": "0"})
