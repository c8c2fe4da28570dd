"""pytest's hooks and fixtures for the suite; the helpers are in support/, one module a concern.

Every process a test starts ends with the test, and the tests that start processes are marked `processes`
(support/processes.py: make test-fast leaves them out)."""

import atexit
import gc
import os
import shutil
import tempfile

import pytest

# On a machine with a GPU the suite hides it, before torch looks: its contracts compare runs with references computed on
# the CPU and inject faults into CPU tensors; what a GPU changes is make gpu-check's (tools/gpu_check.py).
# ACCEL_TRAIN_TESTS_SEE_GPU=1 leaves it visible, to see which contracts a GPU's kernels keep bit for bit.
if os.environ.get("ACCEL_TRAIN_TESTS_SEE_GPU") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
# The Hub offline in the tests' own processes too, as in every command they start (support.commands): a model or
# dataset by Hub name comes from a cache a test made, and huggingface_hub reads this once, when it is imported.
os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
# The user's caches (accel-train's record of the code they trusted, the shard blocks) in a folder of this process's,
# for it and the commands it starts: nothing a test records reaches the developer's own, nor another run of the suite.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="accel-train-tests-cache-")

from support import commands, processes
from support.disks import tmpfs_mounts
from support.nodes import two_network_namespaces
from support.object_store import object_store_for_module, object_store_for_test

atexit.register(shutil.rmtree, os.environ["XDG_CACHE_HOME"], ignore_errors=True)


def pytest_configure(config):
    if config.getoption("dist", "no") != "no" and not hasattr(config, "workerinput"):
        return  # pytest-xdist's controller runs no test: its workers (each a process) do, and each comes here
    # torch's import asks ldconfig once for system libraries (cuda.pathfinder): done here, before any test, so that
    # the test that happens to import torch first is not taken for one that starts a process.
    import torch

    # One CPU thread in each process that runs tests, as in every command a test starts (OMP_NUM_THREADS=1, in
    # support.commands): make test runs one worker a core, and two threads each on two cores made the in-process
    # runs 1.1 to 5 times slower.
    torch.set_num_threads(1)
    # matplotlib's first import on a machine builds its font cache by running fc-list (twice): done here too, so that
    # the first test that draws (a run's curves, a sweep's parameters.png) on a fresh machine is not taken for one that
    # starts processes.
    import matplotlib.font_manager  # noqa: F401


@pytest.fixture(scope="session")
def two_hosts():
    """Two network namespaces joined by a veth pair (support.nodes.Host each); skips where they cannot be made."""
    with two_network_namespaces() as hosts:
        yield hosts


@pytest.fixture
def small_disk(tmp_path):
    """mount(size, readonly) -> a folder on a tmpfs of that size (support.disks); skips where mounting is not
    allowed."""
    with tmpfs_mounts(tmp_path) as mount:
        yield mount


@pytest.fixture
def object_store(monkeypatch, request):
    """An empty S3 store on 127.0.0.1 with one bucket, reached through a counting, fault-injecting proxy, and
    os.environ pointing there for the test (support.object_store.ObjectStore). Starts no process."""
    if not request.node.get_closest_marker("store"):  # taken by request.getfixturevalue: no mark from its name
        pytest.fail("this test takes the S3 store by name without the `store` mark, so make test-fast would run it: "
                    "give the case that takes it marks=pytest.mark.store", pytrace=False)
    with object_store_for_test(monkeypatch) as store:
        yield store


@pytest.fixture(scope="module")
def module_object_store():
    """The same store for every test of a module (support.object_store.object_store_for_module): emptied once, so
    data a module fixture writes there once serves all its tests; a test of that module cannot also take
    `object_store`. Starts no process."""
    with object_store_for_module() as store:
        yield store


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_setup(item):
    processes.track()
    commands.preloading = not item.get_closest_marker("fresh_interpreters")
    return (yield)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_teardown(item, nextitem):
    try:
        return (yield)
    finally:
        processes.untrack()
        processes.end_started()


def pytest_sessionfinish(session):
    processes.end_started()  # a test cut short (Ctrl-C) never reached its teardown
    if not hasattr(session.config, "workerinput"):  # a worker ends without freeing anything (pytest_unconfigure)
        gc.unfreeze()  # as before the freeze at exit (frozen, CI's workers printed triton's nanobind leak report)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    # A pytest-xdist worker has sent its results (workerfinished, at the session's end): it ends here, after what an
    # interpreter's end runs for this suite (threads that are not daemons, then atexit: the preloaded interpreter's
    # end), and without the rest of the end, freeing torch's and a thousand modules' objects one by one, which took
    # 1.5 to 3.5 s a worker on 2 cores while the controller waited for it (make test-fast's last seconds).
    if hasattr(config, "workerinput"):
        import atexit
        import sys
        import threading

        threading._shutdown()
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


STORE_FIXTURES = {"object_store", "module_object_store"}


@pytest.hookimpl(tryfirst=True)  # before -m selects by it
def pytest_collection_modifyitems(items):
    for item in items:
        if isinstance(item, pytest.Function) and not item.get_closest_marker("processes") and \
                processes.starts_processes(item):
            item.add_marker("processes")
        if isinstance(item, pytest.Function) and STORE_FIXTURES & set(item.fixturenames):
            item.add_marker("store")


def pytest_collection_finish(session):
    # What the imports and the collection made lives as long as this process: out of the garbage collector's sight,
    # so that each collection (accelerate's release_memory after an out-of-memory runs one) walks only what the tests
    # made since: 0.3 s a collection in a worker before.
    gc.freeze()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    result = yield
    commands = processes.started_commands()
    if commands and not item.get_closest_marker("processes"):
        pytest.fail(f"{item.nodeid} started {len(commands)} process(es) without the mark `processes`, so it runs in "
                    f"make test-fast: {commands}. support/processes.py derives the mark from the code of tests/ a "
                    "test runs; where a library starts the processes, mark the test @pytest.mark.processes.",
                    pytrace=False)
    return result
