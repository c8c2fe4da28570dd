"""`accel-train doctor`: what a launch on this node will use, and every problem that would make it fail.

Run it on each node before a long job, plainly (settings from flags and the accelerate config file) or
under the launcher you will use (`accelerate launch ... -m accel_train doctor`, `torchrun ... -m
accel_train doctor`): then the processes also join the process group, which proves the launch works.
Each problem is one line saying what to change; the exit code is 1 when there is any.
"""

from __future__ import annotations

import errno
import socket
import time
from pathlib import Path

from accel_train.distributed.devices import cpu_has_bf16, visible_devices
from accel_train.distributed.environment import launcher_environment
from accel_train.errors import UserError
from accel_train.launch.profiles import find_profile, list_profiles
from accel_train.launch.rendezvous import store_answers
from accel_train.launch.settings import Launch, Report, check_addressing, resolve_launch
from accel_train.versions import version_problems, versions

PROBLEM_EXIT_CODE = 1


def check_devices(launch: Launch, report: Report) -> str:
    """Report devices, backend and mixed precision; return the device type ("cuda", "xpu" or "cpu")."""
    import torch

    device, backend, names, summary = visible_devices()
    report.info("devices", summary)
    report.info("backend", backend + ("" if device != "cpu" or launch.num_processes == 1 else
                                      f" ({launch.num_processes} CPU processes form one gloo group)"))

    available = {"no"}
    if device == "cuda":
        available |= {"fp16"} | ({"bf16"} if torch.cuda.is_bf16_supported() else set())
        if torch.cuda.get_device_capability(0) >= (8, 9):
            available.add("fp8")
    else:
        available.add("bf16")  # CPU and XPU autocast support bf16
    wanted = launch.mixed_precision
    native_bf16 = device != "cpu" or cpu_has_bf16()
    if wanted == "bf16" and not native_bf16:
        report.info("mixed precision", "bf16 runs here, but this CPU has no native bf16 kernels (AVX512-BF16 or "
                                       "AMX): autocast emulates them, several times slower than fp32 (accel-train "
                                       "bench measures both); mixed_precision=no trains faster here")
    elif wanted in available:
        native = "" if device != "cpu" else f"; native bf16 kernels: {'yes' if native_bf16 else 'no'}"
        report.info("mixed precision", f"{wanted} (available here: {', '.join(sorted(available))}{native})")
    elif device == "cpu" and wanted == "fp16":
        report.info("mixed precision", "fp16 requested but unavailable on CPU: accel-train trains in fp32 "
                                       f"(available here: {', '.join(sorted(available))})")
    else:
        report.problem(f"mixed_precision={wanted} is not available on this node ({', '.join(sorted(available))} are); "
                       f"set mixed_precision to one of those in the accelerate config or with --mixed_precision")

    if launch.distributed_type == "FSDP" and device == "cpu":
        report.info("FSDP", "Accelerate runs FSDP on GPUs only: on this CPU the launch trains with DDP (each process "
                            "holds the whole model)")
    per_machine = launch.num_processes // max(1, launch.num_machines)
    if device in ("cuda", "xpu") and launch.distributed_type != "NO" and per_machine > len(names):
        report.problem(f"{per_machine} processes per machine but this node has {len(names)} GPU(s); set num_processes "
                       f"to {len(names)} x num_machines = {len(names) * launch.num_machines}")
    return device


def interface_addresses() -> dict[str, list[str]]:
    import psutil

    return {name: [a.address for a in addrs if a.family == socket.AF_INET]
            for name, addrs in psutil.net_if_addrs().items()}


def route_source(host: str, port: int) -> str | None:
    """This node's address on the route to host (a UDP connect sends nothing, it only picks the route)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((host, port))
            return sock.getsockname()[0]
        except OSError:
            return None


def check_multi_node(launch: Launch, device: str, timeout: float, report: Report) -> None:
    address = check_addressing(launch, report)
    if address is None:
        return
    rank, ip, port = launch.machine_rank, launch.main_process_ip, launch.main_process_port
    interfaces = interface_addresses()
    source = route_source(address, port)
    routing = next((name for name, addrs in interfaces.items() if source in addrs), None)
    for name, addrs in sorted(interfaces.items()):
        mark = "  <- routes to the main node" if name == routing else ""
        report.info("interface", f"{name:10s} {', '.join(addrs) or '(no IPv4 address)'}{mark}")
    # Every run has a gloo group beside NCCL's on GPUs: stop signals and the stuck-process watchdog agree over it.
    variables = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME") if device == "cuda" else ("GLOO_SOCKET_IFNAME",)
    if routing is None:
        report.problem(f"no interface of this node routes to main_process_ip={ip}; check the address and this node's "
                       "network configuration")
    else:
        exports = " ".join(f"{variable}={routing}" for variable in variables)
        report.info("suggest", f"export {exports}  (the interface that routes to {address})")
    for name in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        chosen = launch.socket_interfaces.get(name)
        if not chosen or chosen.startswith(("^", "=")):  # exclusion / exact-match syntax: leave to the user
            continue
        if not any(interface in interfaces for interface in chosen.split(",")):
            report.problem(f"{name}={chosen} names no interface of this node ({', '.join(sorted(interfaces))}); "
                           f"export {name}={routing or '<interface>'}")
        elif routing and routing not in chosen.split(","):
            report.problem(f"{name}={chosen} but the route to {address} goes through {routing}; "
                           f"export {name}={routing}")

    local = {a for addrs in interfaces.values() for a in addrs}
    if not launch.socket_interfaces.get("GLOO_SOCKET_IFNAME") and not address.startswith("127."):
        # Without GLOO_SOCKET_IFNAME, gloo advertises the address this node's hostname resolves to (on GPU nodes too:
        # the side group of stop signals and the watchdog is gloo's).
        hostname = socket.gethostname()
        try:
            advertised = socket.gethostbyname(hostname)
        except OSError:
            advertised = None
        if advertised is None or advertised.startswith("127.") or advertised not in local:
            side = " (the group over which stop signals and the stuck-process report travel beside NCCL's)" \
                if device == "cuda" else ""
            report.problem(f"this node's hostname {hostname} resolves to {advertised or 'nothing'}, which gloo{side} "
                           "would give the other nodes to connect to; export "
                           f"GLOO_SOCKET_IFNAME={routing or '<interface>'}")
    if rank == 0 and address not in local and not address.startswith("127."):
        report.problem(f"this is machine_rank 0 but main_process_ip={ip} is not one of its addresses "
                       f"({', '.join(sorted(local))}); run machine_rank 0 on {ip} or set main_process_ip to this node")
    elif rank == 0 and not launch.under_launcher:
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("" if address.startswith("127.") else address, port))
                report.info("main process", f"{ip}:{port} is this node and the port is free")
            except OSError as err:
                report.problem(f"main_process_port={port} cannot be opened on this node ({err.strerror}); "
                               "choose another free port with --main_process_port on every node")
    elif rank > 0:
        report.info("main process", connect(address, ip, port, timeout, report))


def connect(address: str, ip: str, port: int, timeout: float, report: Report) -> str:
    """Whether machine 0's rendezvous answers at ip:port: a TCP connection first, then a torch TCPStore request,
    each given up on after `timeout` seconds (something else may accept connections on that port)."""
    try:
        with socket.create_connection((address, port), timeout=timeout):
            pass
    except ConnectionRefusedError:
        return (f"{ip} reachable but nothing listens on port {port} yet (fine before machine 0 starts; "
                "afterwards, a firewall or a wrong main_process_port)")
    except OSError as err:
        why = "timed out" if isinstance(err, socket.timeout) else \
            (err.strerror or errno.errorcode.get(err.errno, str(err)))
        report.problem(f"cannot reach main_process_ip:port {ip}:{port} from this node ({why} after {timeout:g} s); "
                       "use machine 0's address on a network this node shares and open the port in its firewall")
        return f"{ip}:{port} unreachable"
    why = store_answers(address, port, timeout)
    if why is None:
        return f"{ip}:{port}: machine 0's rendezvous answers (a torch TCPStore)"
    # A problem: every launch doctor checks (accelerate launch, torchrun, accel-train launch) meets in a TCPStore there.
    report.problem(f"main_process_ip:port {ip}:{port} accepted a connection, but what answers is not a torch "
                   f"rendezvous ({why}): another program on that port, or a proxy or firewall accepting connections "
                   "for it; check main_process_ip, and use a main_process_port that is free on machine 0 on every node")
    return f"{ip}:{port} accepted a connection, but what answers is not a torch rendezvous"


def check_process_group(timeout: float, report: Report) -> None:
    """Under a launcher: form the group exactly as training does and sum one number across it."""
    import torch

    from accel_train.distributed.accelerator import make_accelerator

    started = time.perf_counter()
    try:
        accelerator = make_accelerator(seed=0, collective_timeout_s=timeout)
        joined = int(accelerator.reduce(torch.ones(1, device=accelerator.device), reduction="sum").item())
        accelerator.end_training()
    except Exception as err:  # any failure to form the group is the finding itself
        detail = str(err).splitlines()[0] if str(err) else ""
        report.problem(f"the process group did not form ({type(err).__name__}: {detail}); "
                       "see the interface and main process lines above")
        return
    expected = launcher_environment().world_size
    if joined != expected:
        report.problem(f"{joined} processes joined but the launcher asked for {expected}")
    else:
        backend = accelerator.state.backend or "none"
        report.info("process group",
                    f"{joined} processes joined over {backend} in {time.perf_counter() - started:.1f} s")


def run(args) -> int:
    report = Report()
    if args.config_file and not Path(args.config_file).exists():  # a shipped profile's name, or a mistake
        profile = None if "/" in args.config_file else find_profile(args.config_file)
        if profile is None:
            raise UserError(f"--config_file {args.config_file}: no such file, and no shipped profile of that name "
                            f"({', '.join(list_profiles())})")
        args.config_file = str(profile)
    launch = resolve_launch(args, report)
    launcher = launcher_environment()
    where = f"machine {launch.machine_rank} of {launch.num_machines}" if launch.num_machines > 1 else "single machine"
    report.info("node", f"{socket.gethostname()} ({where}{', under a launcher' if launch.under_launcher else ''})")
    if launch.under_launcher:  # the file the launcher read is not visible here; its settings are
        config = f"as launched: {launch.num_processes} process(es) on {launch.num_machines} machine(s)"
    elif launch.config_file:
        config = (f"{launch.config_file}: distributed_type {launch.distributed_type}, "
                  f"{launch.num_processes} process(es) on {launch.num_machines} machine(s)")
    else:
        config = "none found: accelerate launch will use its defaults; pass --config_file or run `accelerate config`"
    report.info("accelerate config", config)
    report.info("versions", ", ".join(f"{name} {version}" for name, version in versions().items()))
    for problem in version_problems():
        report.problem(problem)
    device = check_devices(launch, report)
    if launch.num_machines > 1:
        check_multi_node(launch, device, args.timeout, report)
    if launch.under_launcher:
        check_process_group(args.timeout, report)
    if launcher.local_rank == 0 or report.problems:  # one report per node; any process with a problem speaks
        prefix = f"[rank {launcher.rank}] " if launch.under_launcher else ""
        out = [f"{prefix}{topic:18s} {text}" for topic, text in report.lines]
        out += [f"{prefix}problem: {text}" for text in report.problems]
        out.append(f"{prefix}{len(report.problems)} problem(s): a launch with these settings would fail"
                   if report.problems
                   else f"{prefix}no problems found")
        print("\n".join(out), flush=True)
    return PROBLEM_EXIT_CODE if report.problems else 0

