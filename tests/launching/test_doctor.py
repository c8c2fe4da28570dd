"""`accel-train doctor`: a node check a user runs before a long job; one line per problem, exit 1 if any."""

import socket
import subprocess
import time

import pytest

from support.commands import PYTHON, free_port
from support.locations import PROFILES
from support.nodes import run_nodes

MULTI_NODE = ["--config_file", str(PROFILES / "multi_node.yaml")]


@pytest.fixture
def doctor(monkeypatch, capsys):
    """`accel-train doctor ARGS` in this process (it reads flags, files and the environment, nothing a process
    boundary changes), with NCCL/GLOO_SOCKET_IFNAME unset unless `env` sets them, and any GPU hidden: these are a
    CPU node's checks (gloo, fp16 falling back), as on a machine without one; CUDA_VISIBLE_DEVICES cannot hide it
    from a process whose torch has already looked."""
    import torch

    from accel_train import cli

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def run(*args, env=None):
        for name, value in {"GLOO_SOCKET_IFNAME": "", "NCCL_SOCKET_IFNAME": "", **(env or {})}.items():
            monkeypatch.setenv(name, value)
        capsys.readouterr()
        try:
            cli.main(["doctor", *args])
            code = 0
        except SystemExit as stop:
            code = stop.code or 0
        out, err = capsys.readouterr()
        assert "Traceback" not in err, err
        return subprocess.CompletedProcess(["accel-train", "doctor", *args], code, out, err)

    return run


def problems(result) -> list[str]:
    return [line for line in result.stdout.splitlines() if line.startswith("problem:")]


def test_doctor_reports_devices_backend_mixed_precision_and_the_config_it_read(doctor):
    result = doctor("--config_file", str(PROFILES / "multi_gpu.yaml"))
    assert result.returncode == 0 and result.stdout.strip().endswith("no problems found")
    lines = dict(line.split(None, 1) for line in result.stdout.splitlines() if not line.startswith("mixed"))
    assert "multi_gpu.yaml" in result.stdout and "distributed_type MULTI_GPU" in result.stdout
    assert lines["backend"].startswith("gloo") and "no GPU visible" in lines["devices"]
    assert "fp16 requested but unavailable on CPU: accel-train trains in fp32" in result.stdout


@pytest.fixture
def listening_port():
    """A port a plain socket listens on: it accepts connections and answers nothing, as another program, a proxy or
    a firewall may where machine 0's rendezvous should be."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.fixture
def rendezvous_port():
    """A port machine 0's rendezvous answers on: torch's TCPStore, which accelerate launch, torchrun and accel-train
    launch hold on the main port."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield store.port


def test_doctor_on_a_worker_node_finds_the_main_node_and_the_interface_that_routes_to_it(doctor, rendezvous_port):
    result = doctor(*MULTI_NODE, "--machine_rank", "1", "--main_process_ip", "127.0.0.1",
                    "--main_process_port", str(rendezvous_port))
    assert result.returncode == 0, result.stdout
    assert f"main process       127.0.0.1:{rendezvous_port}: machine 0's rendezvous answers (a torch TCPStore)" \
        in result.stdout
    assert "lo         127.0.0.1  <- routes to the main node" in result.stdout
    assert "export GLOO_SOCKET_IFNAME=lo" in result.stdout


def test_doctor_on_a_worker_node_does_not_take_whatever_accepts_connections_for_the_main_nodes_rendezvous(
        doctor, listening_port):
    started = time.monotonic()
    result = doctor(*MULTI_NODE, "--machine_rank", "1", "--main_process_ip", "127.0.0.1",
                    "--main_process_port", str(listening_port), "--timeout", "0.5")
    assert time.monotonic() - started < 10  # torch's own client would wait for an answer forever
    assert result.returncode == 1, result.stdout
    assert f"main process       127.0.0.1:{listening_port} accepted a connection, but what answers is not a torch " \
           "rendezvous" in result.stdout
    assert "rendezvous answers" not in result.stdout
    (problem,) = problems(result)
    assert f"127.0.0.1:{listening_port} accepted a connection, but what answers is not a torch rendezvous " \
           "(no answer in 0.5 s): another program on that port, or a proxy or firewall" in problem


def test_doctor_names_each_problem_in_one_line_and_exits_nonzero(doctor):
    result = doctor(*MULTI_NODE, "--num_processes", "3", "--machine_rank", "2", "--main_process_ip", "127.0.0.1",
                    "--main_process_port", str(free_port()), "--mixed_precision", "fp8",
                    env={"GLOO_SOCKET_IFNAME": "nosuchif0"})
    assert result.returncode == 1, result.stdout
    found = problems(result)
    for says in ("num_processes=3 does not divide by num_machines=2", "machine_rank=2 must be 0..1",
                 "GLOO_SOCKET_IFNAME=nosuchif0 names no interface of this node",
                 "mixed_precision=fp8 is not available on this node"):
        assert sum(says in problem for problem in found) == 1, (says, result.stdout)
    assert len(found) == 4 and result.stdout.strip().endswith("4 problem(s): a launch with these settings would fail")


@pytest.mark.parametrize("args, says", [
    (["--machine_rank", "1", "--main_process_ip", "no-such-host.invalid"], "does not resolve on this node"),
    (["--machine_rank", "0", "--main_process_ip", "203.0.113.9"], "this is machine_rank 0 but main_process_ip"),
])
def test_doctor_says_when_the_main_node_address_cannot_work(doctor, args, says):
    result = doctor(*MULTI_NODE, "--main_process_port", str(free_port()), *args)
    assert result.returncode == 1 and any(says in problem for problem in problems(result)), result.stdout


def test_doctor_on_the_main_node_refuses_a_port_already_in_use(doctor, listening_port):
    result = doctor(*MULTI_NODE, "--machine_rank", "0", "--main_process_ip", "127.0.0.1",
                    "--main_process_port", str(listening_port))
    assert result.returncode == 1
    (problem,) = problems(result)
    assert f"main_process_port={listening_port} cannot be opened" in problem and "--main_process_port" in problem


def test_doctor_under_a_two_machine_launch_joins_the_process_group():
    port = free_port()
    nodes = [([PYTHON, "-m", "accelerate.commands.launch", *MULTI_NODE, "--num_processes", "2", "--num_machines", "2",
               "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1", "--main_process_port", str(port),
               "-m", "accel_train", "doctor"], {}) for rank in (0, 1)]
    results = run_nodes(nodes, timeout=120)
    for rank, result in enumerate(results):
        assert f"[rank {rank}] process group      2 processes joined over gloo" in result.stdout
        assert f"[rank {rank}] no problems found" in result.stdout
    assert f"[rank 1] main process       127.0.0.1:{port}: machine 0's rendezvous answers (a torch TCPStore)" \
        in results[1].stdout


def test_doctor_on_a_separate_host_names_the_interface_gloo_must_use(two_hosts):
    main, worker = two_hosts
    command = worker.run([PYTHON, "-m", "accel_train", "doctor", *MULTI_NODE, "--machine_rank", "1",
                          "--main_process_ip", main.address, "--timeout", "3"])
    (bare,) = run_nodes([(command, {"GLOO_SOCKET_IFNAME": "", "NCCL_SOCKET_IFNAME": ""})], check=False)
    assert bare.returncode == 1, bare.stdout
    assert any(f"export GLOO_SOCKET_IFNAME={worker.interface}" in problem for problem in problems(bare)), bare.stdout
    assert f"{worker.interface:10s} {worker.address}  <- routes to the main node" in bare.stdout

    (fixed,) = run_nodes([(command, {"GLOO_SOCKET_IFNAME": worker.interface, "NCCL_SOCKET_IFNAME": ""})])
    assert fixed.stdout.strip().endswith("no problems found")


def test_doctor_reports_an_unusable_accelerate_config_in_one_line(doctor, tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("num_processes: many\n")
    result = doctor("--config_file", str(broken))
    assert result.returncode == 1
    assert problems(result) == [
        f"problem: accelerate config {broken}: num_processes='many' must be a whole number; fix it"]


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_doctor_names_gloo_s_interface_on_gpu_nodes_too_where_the_hostname_resolves_to_loopback(device, monkeypatch):
    """Stop signals and the stuck-process report travel over a gloo group beside NCCL's: on a GPU node whose hostname
    resolves to 127.0.1.1 (Debian's default), gloo would give the other nodes an address they cannot reach."""
    from accel_train.launch import doctor
    from accel_train.launch.settings import Launch, Report

    monkeypatch.setattr(doctor, "interface_addresses", lambda: {"lo": ["127.0.0.1"], "ens5": ["10.9.0.2"]})
    monkeypatch.setattr(doctor, "route_source", lambda host, port: "10.9.0.2")
    monkeypatch.setattr(doctor.socket, "gethostbyname", lambda name: name if name[0].isdigit() else "127.0.1.1")
    monkeypatch.setattr(doctor, "connect", lambda *args: "10.9.0.1:29500: machine 0's rendezvous answers")
    report = Report()
    launch = Launch(distributed_type="MULTI_GPU", num_processes=2, num_machines=2, machine_rank=1,
                    main_process_ip="10.9.0.1")
    doctor.check_multi_node(launch, device, timeout=1.0, report=report)
    (problem,) = report.problems
    assert "resolves to 127.0.1.1" in problem and problem.endswith("export GLOO_SOCKET_IFNAME=ens5"), problem
    suggested = dict(report.lines)["suggest"]
    expected = "NCCL_SOCKET_IFNAME=ens5 GLOO_SOCKET_IFNAME=ens5" if device == "cuda" else "GLOO_SOCKET_IFNAME=ens5"
    assert suggested.startswith(f"export {expected}  ("), suggested
    report = Report()
    doctor.check_multi_node(Launch(**{**vars(launch), "socket_interfaces": {"GLOO_SOCKET_IFNAME": "ens5"}}), device,
                            timeout=1.0, report=report)
    assert report.problems == []
