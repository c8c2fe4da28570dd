"""What `accelerate launch` will use: its flags over the launcher's environment over its config file, read and
checked the same way for doctor and `accel-train launch`."""

from __future__ import annotations

import argparse
import socket
from dataclasses import dataclass, field
from pathlib import Path

from accel_train.distributed.environment import launcher_environment
from accel_train.errors import LaunchError, UserError

CONFIG_KEYS = {"distributed_type": str, "num_processes": int, "num_machines": int, "machine_rank": int,
               "main_process_ip": str, "main_process_port": int, "mixed_precision": str}


@dataclass
class Launch:
    """The launch settings doctor checks, from flags > launcher environment > accelerate config file."""

    config_file: str | None = None
    distributed_type: str = "NO"
    num_processes: int = 1
    num_machines: int = 1
    machine_rank: int = 0
    main_process_ip: str | None = None
    main_process_port: int = 29500
    mixed_precision: str = "no"
    under_launcher: bool = False
    socket_interfaces: dict[str, str] = field(default_factory=dict)  # NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME


@dataclass
class Report:
    lines: list[tuple[str, str]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def info(self, topic: str, text: str) -> None:
        self.lines.append((topic, text))

    def problem(self, text: str) -> None:
        self.problems.append(text)


def find_config_file(given: str | None) -> Path | None:
    """The file `accelerate launch` would read: --config_file, else Accelerate's default config, if present."""
    if given:
        return Path(given)
    from accelerate.commands.config.config_args import default_config_file

    return Path(default_config_file) if Path(default_config_file).is_file() else None


def resolve_launch(args, report: Report) -> Launch:
    import yaml

    launch = Launch()
    path = find_config_file(args.config_file)
    if path is not None:
        launch.config_file = str(path)
        try:
            config = yaml.safe_load(path.read_text()) or {}  # JSON (accelerate config default) is YAML too
        except (OSError, yaml.YAMLError) as err:
            report.problem(f"accelerate config {path} cannot be read ({str(err).splitlines()[0]}); "
                           "fix the file or pass --config_file to a valid one (accelerate config default writes one)")
            config = {}
        if not isinstance(config, dict):
            report.problem(f"accelerate config {path} is not a mapping of settings; regenerate it with "
                           "accelerate config")
            config = {}
        for key, kind in CONFIG_KEYS.items():
            if config.get(key) is not None:
                try:
                    setattr(launch, key, kind(config[key]))
                except ValueError:
                    report.problem(f"accelerate config {path}: {key}={config[key]!r} must be a whole number; fix it")
    launcher = launcher_environment()
    if launcher.world_size:  # under accelerate launch / torchrun: what the launcher actually passed
        launch.under_launcher = True
        launch.num_processes = launcher.world_size
        local = launcher.local_world_size or launch.num_processes
        launch.num_machines = max(1, launch.num_processes // max(1, local))
        launch.machine_rank = launcher.node_rank if launcher.node_rank is not None else launch.machine_rank
        launch.main_process_ip = launcher.main_address or launch.main_process_ip
        launch.main_process_port = launcher.main_port or launch.main_process_port
    if launcher.mixed_precision:
        launch.mixed_precision = launcher.mixed_precision
    launch.socket_interfaces = launcher.socket_interfaces
    for key in ("num_processes", "num_machines", "machine_rank", "main_process_ip", "main_process_port"):
        if getattr(args, key) is not None:
            setattr(launch, key, getattr(args, key))
    if args.mixed_precision is not None:
        launch.mixed_precision = args.mixed_precision
    return launch


def check_addressing(launch: Launch, report: Report) -> str | None:
    """Process count, machine rank and main address of a multi-machine launch; machine 0's IP address, or None
    when there is none to use."""
    n, machines, rank = launch.num_processes, launch.num_machines, launch.machine_rank
    if n % machines:
        report.problem(f"num_processes={n} does not divide by num_machines={machines}: num_processes is the total over "
                       f"all machines; set it to processes per machine x {machines}, "
                       f"e.g. {max(1, n // machines) * machines}")
    if not 0 <= rank < machines:
        report.problem(f"machine_rank={rank} must be 0..{machines - 1}: give each node its own --machine_rank, 0 on "
                       "the node at main_process_ip")
    ip = launch.main_process_ip
    if not ip:
        report.problem("main_process_ip is not set: set it (or pass --main_process_ip) to machine 0's address that "
                       "every node can reach")
        return None
    try:
        return socket.gethostbyname(ip)
    except OSError:
        report.problem(f"main_process_ip={ip} does not resolve on this node; use machine 0's IP address instead")
        return None


def add_arguments(parser) -> None:
    """The `accelerate launch` flags that decide whether a launch works, so doctor checks the same command."""
    parser.add_argument("--config_file", help="accelerate config file, or the name of a shipped profile (accel-train "
                        "profiles); default: Accelerate's default config if present")
    parser.add_argument("--num_processes", type=int, help="total processes over all machines")
    parser.add_argument("--num_machines", type=machine_count)
    parser.add_argument("--machine_rank", type=int, help="this node's rank, 0 on the main node")
    parser.add_argument("--main_process_ip", help="machine 0's address")
    parser.add_argument("--main_process_port", type=int)
    parser.add_argument("--mixed_precision", choices=["no", "fp16", "bf16", "fp8"])
    parser.add_argument("--timeout", type=float, default=10.0,
                        help="seconds to wait for the main node and the process group")


def machine_count(value: str) -> int:
    """--num_machines: a number. A range (torchrun's --nnodes 1:2) asks for elastic membership, which accelerate launch
    cannot give (it takes one number): say which command does, instead of argparse's usage and "invalid int value"."""
    if ":" in value:
        raise UserError(f"--num_machines {value}: accelerate launch takes a fixed number of machines; a job that "
                        f"goes on when a machine is lost runs under torchrun --nnodes {value} --rdzv_backend c10d "
                        "(the command: accel-train launch --help; docs/multi-machine.md)")
    if not value.isdigit() or int(value) < 1:
        raise UserError(f"--num_machines {value}: the number of machines, 1 or more")
    return int(value)


def settings_of_command(arguments: list[str]) -> tuple[Launch, str | None]:
    """The settings accelerate launch will use (flags over its config file), read and checked the way doctor reads
    and checks them."""
    # What follows the module or script is the training command's, not the launcher's.
    target = next((i for i, arg in enumerate(arguments) if arg in ("-m", "--module") or arg.endswith(".py")),
                  len(arguments))
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add_arguments(parser)
    flags, _ = parser.parse_known_args(arguments[:target])
    report = Report()
    settings = resolve_launch(flags, report)
    if settings.num_machines > 1:
        check_addressing(settings, report)
    if report.problems:
        raise LaunchError("; ".join(report.problems))
    return settings, flags.config_file
