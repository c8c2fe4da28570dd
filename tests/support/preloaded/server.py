"""The preloaded interpreter: torch, torchvision, Accelerate, evaluate and accel-train imported once, then one fork
for each command the suite starts (tests/support/commands.py starts one server per pytest worker).

Why by hand: each process the suite starts spent about 6 s of a core on imports before its first step (torch 2.7 s,
torch._dynamo 2 s, evaluate with datasets 1.2 s; docs/tests.md), nine tenths of the suite's time. A command started
with this server's socket in ACCEL_TRAIN_TESTS_PRELOADED and `sitecustomize.py` (beside this file) on PYTHONPATH
sends its arguments, environment, working folder and standard streams here; a fork of this process becomes that
command (its environment, sys.path, argv, streams, signal dispositions as a fresh interpreter has them), runs it as
`python` would, and its exit status goes back to the command, which exits with it. What a fork cannot be like a fresh
interpreter, it refuses, and the command starts as usual (`refusal` below names the cases).

    python server.py SOCKET
"""

from __future__ import annotations

import gc
import importlib.machinery
import json
import os
import selectors
import signal
import socket
import struct
import sys
import threading
import types

# What a training process, accel-train's other commands and the launchers import (not the launchers' own modules:
# `python -m` runs a module that is already imported with a warning a fresh interpreter does not print), and
# matplotlib for the curves a run draws at its end (0.5 s a fork). Not what sets up a logging handler on import (optuna
# binds the server's stderr) nor tensorboard (0.08 s).
PRELOAD = ["torch", "torch._dynamo", "torchvision", "accelerate", "accelerate.commands.config",
           "accelerate.commands.utils", "accelerate.utils.launch", "torch.distributed.argparse_util",
           "torch.distributed.launcher.api", "torch.distributed.elastic.multiprocessing.errors", "evaluate", "datasets",
           "fsspec", "s3fs", "safetensors.torch", "accel_train.cli", "accel_train.api", "accel_train.workloads.tasks",
           "accel_train.workloads.metrics", "accel_train.training.loop", "accel_train.training.setup",
           "accel_train.data.shards", "matplotlib.figure", "matplotlib.backends.backend_agg"]
# The modules a fork may run as `python -m NAME`: accel-train, the launchers and `accelerate config` (not pytest, pip,
# a compile worker).
MODULES = {"accel_train", "accelerate.commands.launch", "accelerate.commands.accelerate_cli", "torch.distributed.run"}
SCRIPT_NAMES = {"accelerate", "torchrun", "accel-train"}  # console scripts; any *.py script is taken too
# Variables a fork may see set otherwise than this process was: each is read when used, not when a module is
# imported (the launchers', the store's, the probe's faults, the suite's own, the shell's, what the launch scripts
# and the GPU check pass on). Any other difference (HF_HOME, TORCH_HOME, OMP_NUM_THREADS, PYTHONHASHSEED, ...) could
# have changed what an import did: refused.
CALL_TIME_PREFIXES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_", "ROLE_", "MASTER_",
                      "TORCHELASTIC_", "TORCH_NCCL_", "NCCL_", "GLOO_", "TORCH_DISABLE_SHARE_RDZV", "ACCELERATE_",
                      "FSDP_", "ACCEL_TRAIN_", "PROBE_", "AWS_", "SLURM_", "KUBERNETES_", "PET_", "PYTEST_",
                      "_TORCHINDUCTOR_", "MAIN_PROCESS_")
CALL_TIME_NAMES = {"PYTHONUNBUFFERED", "PYTHONPATH", "XDG_CACHE_HOME", "CUBLAS_WORKSPACE_CONFIG", "PATH", "_", "SHLVL",
                   "OLDPWD", "PWD", "LAUNCH_TARGET", "STOP_AFTER_STEP", "MIN_NODES", "PROCESSES_PER_NODE",
                   "GPU_CHECK_TOKEN", "OUT", "TMPDIR",  # TMPDIR: tempfile's choice, cached by the preload, made again
                   "TORCH_HOME", "https_proxy", "HTTPS_PROXY", "no_proxy", "NO_PROXY"}  # torch.hub's and urllib's
# Variables that change nothing on this machine whenever they are read, so a fork may see them set otherwise (found
# after the preload; `accelerate launch` sets both kinds for its workers): which GPUs CUDA may see, where no NVIDIA
# driver is (no /dev/nvidiactl: none to see); Intel OpenMP's KMP_*, where torch's OpenMP is not Intel's (no libiomp).
IGNORED_HERE: set[str] = set()
IGNORED_HERE_PREFIXES: list[str] = []
HEADER = struct.Struct("!I")
ENV_AT_START = dict(os.environ)  # before the preload: what a command's environment is compared with
SET_BY_IMPORTS: dict[str, str] = {}  # variables the preload's imports set, as they would in a fresh interpreter


def refusal(target: dict, request: dict, child_path: list[str]) -> str | None:
    """Why a fork of this process would not run the command as a fresh interpreter would, or None."""
    if request["executable"] != sys.executable:
        return f"another interpreter: {request['executable']}"
    for namespace in ("net", "mnt", "pid"):  # `ip netns exec` (two hosts on one machine) runs in another network
        if request["namespaces"].get(namespace) != os.readlink(f"/proc/self/ns/{namespace}"):
            return f"another {namespace} namespace"
    if request["uid"] != os.getuid():
        return "another user"
    env = request["env"]
    expected = {**ENV_AT_START, **SET_BY_IMPORTS}  # a variable the imports set is theirs to set: the same either way
    differing = sorted(key for key in set(env) | set(expected) if env.get(key, SET_BY_IMPORTS.get(key)) !=
                       expected.get(key) and not key.startswith((*CALL_TIME_PREFIXES, *IGNORED_HERE_PREFIXES)) and
                       key not in CALL_TIME_NAMES and key not in IGNORED_HERE)
    if differing:
        return f"variables read at import time differ: {differing}"
    found = package_origin("accel_train", child_path)
    if found != sys.modules["accel_train"].__file__:
        return f"accel_train would come from {found}, not {sys.modules['accel_train'].__file__}"
    return None


def package_origin(name: str, path: list[str]) -> str | None:
    """Where `import NAME` finds it with sys.path `path`: sys.meta_path's finders in turn, as the import system asks
    them (an editable install's finder among them)."""
    for finder in sys.meta_path:
        if finder is importlib.machinery.PathFinder:
            spec = finder.find_spec(name, path)
        elif hasattr(finder, "find_spec"):
            spec = finder.find_spec(name, None)
        else:
            continue
        if spec is not None:
            return spec.origin
    return None


def parse(argv: list[str], cwd: str) -> tuple[dict, list[str]] | None:
    """(what to run, its options) from `python [-u] (-m MODULE | SCRIPT) ARGS` started in `cwd`; None for anything
    else (a script that is not there among them: `python` says so itself)."""
    options, rest = [], argv[1:]
    while rest and rest[0].startswith("-") and rest[0] != "-m":
        if rest[0] != "-u":
            return None
        options.append(rest.pop(0))
    if rest[:1] == ["-m"] and len(rest) >= 2 and rest[1] in MODULES:
        return {"module": rest[1], "args": rest[2:]}, options
    if rest and (rest[0].endswith(".py") or os.path.basename(rest[0]) in SCRIPT_NAMES) and \
            os.path.isfile(os.path.join(cwd, rest[0])):
        return {"script": rest[0], "args": rest[1:]}, options
    return None


def base_path() -> list[str]:
    """sys.path without this script's folder and this process's PYTHONPATH: what every interpreter here has."""
    own = set(filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)))
    return [entry for entry in sys.path[1:] if entry not in own]


def child_path(target: dict, request: dict, base: list[str]) -> list[str]:
    first = request["cwd"] if "module" in target else os.path.dirname(os.path.realpath(
        os.path.join(request["cwd"], target["script"])))
    extra = [entry for entry in request["env"].get("PYTHONPATH", "").split(os.pathsep) if entry]
    return [first, *[os.path.join(request["cwd"], entry) for entry in extra], *base]


def become(target: dict, options: list[str], request: dict, streams: list[int], path: list[str]) -> int:
    """In the fork: be the command, as `python` would start it; its exit code."""
    import atexit
    import io
    import runpy
    import tempfile

    os.setsid()  # a group of its own: signals meant for the server's group are not its
    for number in range(1, signal.NSIG):
        try:
            signal.signal(number, signal.SIG_DFL)
        except (OSError, ValueError):
            pass
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for number in (signal.SIGPIPE, signal.SIGXFSZ):  # ignored by every Python at start
        signal.signal(number, signal.SIG_IGN)
    for fd, stream in enumerate(streams):
        os.dup2(stream, fd)
        os.close(stream)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update({**SET_BY_IMPORTS, **request["env"]})
    tempfile.tempdir = None  # chosen again from this environment (TMPDIR) at the next use, as in a fresh interpreter
    unbuffered = "-u" in options or bool(os.environ.get("PYTHONUNBUFFERED"))

    def text(fd: int, mode: str, stderr: bool = False):
        raw = io.FileIO(fd, mode, closefd=False)
        if mode == "r":
            binary = io.BufferedReader(raw)
        else:
            binary = raw if unbuffered else io.BufferedWriter(raw)
        return io.TextIOWrapper(binary, encoding="utf-8", errors="backslashreplace" if stderr else "strict",
                                line_buffering=stderr or (mode == "w" and os.isatty(fd)), write_through=unbuffered)

    sys.stdin, sys.stdout, sys.stderr = text(0, "r"), text(1, "w"), text(2, "w", stderr=True)
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
    sys.path[:] = path
    importlib.invalidate_caches()  # files written since the preload (a user's module) are found
    code = 0
    try:
        if "module" in target:
            sys.argv = ["-m", *target["args"]]
            sys.modules["__main__"] = types.ModuleType("__main__")  # a namespace of its own, not this server's
            runpy._run_module_as_main(target["module"])  # what `python -m` runs
        else:
            sys.argv = [target["script"], *target["args"]]  # as typed; __file__ absolute, as `python` sets them
            path_name = os.path.abspath(target["script"])
            main = sys.modules["__main__"] = types.ModuleType("__main__")
            main.__file__, main.__cached__ = path_name, None
            main.__loader__ = importlib.machinery.SourceFileLoader("__main__", path_name)
            with open(path_name, "rb") as source:
                compiled = compile(source.read(), path_name, "exec")
            exec(compiled, main.__dict__)
    except SystemExit as end:
        code = end.code if isinstance(end.code, int) else (0 if end.code is None else 1)
        if not isinstance(end.code, int) and end.code is not None:
            print(end.code, file=sys.stderr)
    except BaseException as error:
        trace = error.__traceback__  # from the command's first frame, as `python` prints it (`-m` shows runpy's)
        while trace is not None and trace.tb_frame.f_code.co_filename == __file__:
            trace = trace.tb_next
        sys.excepthook(type(error), error.with_traceback(trace), trace)
        code = -signal.SIGINT if isinstance(error, KeyboardInterrupt) else 1
    threading._shutdown()  # as the interpreter's end: wait for threads that are not daemons, then atexit
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            code = code or 120
    return code


def serve(address: str) -> None:
    base = base_path()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(64)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "listener")
    children: dict[int, tuple[socket.socket, int]] = {}  # pid -> (its command's connection, its pidfd)
    parent = os.getppid()

    def end(why: str):
        print(f"ending: {why}; {len(children)} fork(s) killed", file=sys.stderr, flush=True)
        for pid in children:
            kill_group(pid)
        os._exit(0)

    signal.signal(signal.SIGTERM, lambda *_: end("SIGTERM"))
    while True:
        if os.getppid() != parent:
            end("the pytest worker is gone")
        for key, _ in selector.select(timeout=1.0):
            if key.data == "listener":
                connection, _ = listener.accept()
                started = start(connection, base, listener, selector, children)
                if started is None:
                    connection.close()
                    continue
                pid, pidfd = started
                children[pid] = (connection, pidfd)
                selector.register(pidfd, selectors.EVENT_READ, ("exited", pid))
                selector.register(connection, selectors.EVENT_READ, ("command", pid))
            elif key.data[0] == "exited":  # the fork ended: its status to its command
                pid = key.data[1]
                connection, pidfd = children.pop(pid)
                _, status = os.waitpid(pid, 0)
                selector.unregister(pidfd)
                if connection.fileno() in selector.get_map():
                    selector.unregister(connection)
                os.close(pidfd)
                try:
                    connection.sendall(f"status {status}\n".encode())
                except OSError:
                    pass
                connection.close()
            else:  # the command went away (killed, SIGKILL included) while its fork runs: the fork goes too, with
                pid = key.data[1]  # what it started in its group (DataLoader workers)
                if pid in children:
                    kill_group(pid)
                    selector.unregister(children[pid][0])


def kill_group(pid: int) -> None:
    """SIGKILL to a fork and the processes of its group (it leads one once it has begun: setsid)."""
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def start(connection, base, listener, selector, children) -> tuple[int, int] | None:
    """Read a command's request; fork it, or answer `refused WHY` (the command then starts as usual)."""
    connection.settimeout(10)
    try:
        data, streams, _, _ = socket.recv_fds(connection, 1 << 20, 3)
        while len(data) < HEADER.size or len(data) < HEADER.size + HEADER.unpack_from(data)[0]:
            more = connection.recv(1 << 20)
            if not more:
                raise OSError("the command went away")
            data += more
    except OSError:
        return None
    request = json.loads(data[HEADER.size:])
    parsed = parse(request["argv"], request["cwd"])
    path = child_path(parsed[0], request, base) if parsed else []
    why = "not a command a fork runs" if parsed is None else refusal(parsed[0], request, path)
    if why is not None or len(streams) != 3:
        print(f"refused {request['argv'][:4]}: {why}", file=sys.stderr, flush=True)
        for stream in streams:
            os.close(stream)
        connection.sendall(f"refused {why}\n".encode())
        return None
    pid = os.fork()
    if pid == 0:
        code = 70
        try:
            listener.close()
            selector.close()
            for other, pidfd in children.values():
                other.close()
                os.close(pidfd)
            connection.close()
            code = become(parsed[0], parsed[1], request, streams, path)
        finally:
            if code < 0:
                signal.signal(-code, signal.SIG_DFL)
                os.kill(os.getpid(), -code)
            os._exit(code & 0xFF)
    for stream in streams:
        os.close(stream)
    connection.settimeout(None)
    connection.sendall(f"pid {pid}\n".encode())
    return pid, os.pidfd_open(pid)


def main() -> None:
    address = sys.argv[1]
    out = os.dup(1)
    preload_output = os.open(address + ".preload", os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    os.dup2(preload_output, 1)
    os.dup2(preload_output, 2)
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    SET_BY_IMPORTS.update({key: value for key, value in os.environ.items() if key not in ENV_AT_START})
    if not os.path.exists("/dev/nvidiactl"):
        IGNORED_HERE.add("CUDA_VISIBLE_DEVICES")
    with open("/proc/self/maps") as maps:
        if "libiomp" not in maps.read():
            IGNORED_HERE_PREFIXES.append("KMP_")
    said = os.pread(preload_output, 4000, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    if said:  # a fresh interpreter would print it into the command's output: forks could not be like one
        sys.exit(f"the preload printed {said[:2000]!r}: no preloaded interpreters")
    if threading.active_count() != 1:
        sys.exit(f"the preload left threads running ({threading.enumerate()}): no preloaded interpreters")
    # The preload's objects out of the garbage collector's sight, as Python's gc docs advise before fork() without
    # exec(): a fork's collections neither walk them nor write to their pages (copies of each page it touches).
    gc.freeze()
    serve(address)


if __name__ == "__main__":
    main()
