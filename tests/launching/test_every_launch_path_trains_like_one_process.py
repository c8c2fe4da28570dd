"""Every way a user launches accel-train trains and evaluates through it, with the numbers of one plain process.

Each path trains the same seed and global batch, and its run's own evaluation follows: the losses must match
a plain single process (relative 1e-5) and the eval metrics too (identical correct count). The multi-machine
paths also run `accel-train eval` of one shared checkpoint (metrics identical); multi_gpu.yaml does so at 2
and 3 processes in distributed/test_exact_eval_at_any_world_size_and_world_size_checks.py, torchrun in
workloads/test_user_code_python_api_and_predict.py. multi_gpu.yaml has no row here: every other launched test goes
through it, and contracts/test_same_training_at_any_world_size.py compares it at 2 and 3 processes with one
process. The reference run and the check are support/launching.py's. On a GPU-less machine the GPU profiles form
a gloo group on the CPU; "nodes" are launches on 127.0.0.1 started together.

Every comparison here is at fp32 on the CPU, one thread a process: the profiles that ask for fp16 train in fp32
there, and say so. At fp16 or bf16 on a GPU a path matches one process only within docs/contracts.md's
tolerances, which `make gpu-check` holds a GPU run to.
"""

from pathlib import Path

import pytest

from support.commands import PYTHON, accelerate, free_port, torchrun, train_in_process
from support.launching import RUN, check_path
from support.locations import PROFILES
from support.nodes import run_nodes, slurm_nodes

# What `accelerate config` writes for "multi-GPU, 1 machine, 2 GPUs, fp16" (the interactive wizard's answers).
WIZARD_MULTI_GPU = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: MULTI_GPU
downcast_bf16: 'no'
enable_cpu_affinity: false
gpu_ids: all
machine_rank: 0
main_training_function: main
mixed_precision: fp16
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""


def one_machine(*command) -> list:
    return [(list(command), {})]


def config_default(tmp: Path) -> Path:
    path = tmp / "default_config.yaml"
    if not path.exists():
        run_nodes([([PYTHON, "-m", "accelerate.commands.accelerate_cli", "config", "default", "--config_file",
                     str(path)],
                    {})])
    return path


def wizard_file(tmp: Path) -> Path:
    path = tmp / "wizard_multi_gpu.yaml"
    path.write_text(WIZARD_MULTI_GPU)
    return path


# name -> (world size, tmp -> [(command up to the accel-train arguments, extra env) for each node])
PATHS = {
    "single_gpu.yaml": (1, lambda tmp: one_machine(*accelerate("--config_file", PROFILES / "single_gpu.yaml"))),
    "cpu.yaml": (1, lambda tmp: one_machine(*accelerate("--config_file", PROFILES / "cpu.yaml"))),
    "multi_node.yaml, 2 machines": (2, lambda tmp: [
        (accelerate("--config_file", PROFILES / "multi_node.yaml", "--num_processes", 2, "--num_machines", 2,
                    "--machine_rank", rank, "--main_process_ip", "127.0.0.1", "--main_process_port", port), {})
        for port in [free_port()] for rank in (0, 1)]),
    "accelerate config default": (1, lambda tmp: one_machine(*accelerate("--config_file", config_default(tmp)))),
    "wizard multi-GPU file": (2, lambda tmp: one_machine(*accelerate(
        "--config_file", wizard_file(tmp), "--main_process_port", free_port()))),
    "torchrun --nproc_per_node 2": (2, lambda tmp: one_machine(*torchrun(
        "--nproc_per_node", 2, "--master_port", free_port()))),
    "torchrun --nnodes 2": (2, lambda tmp: [
        (torchrun("--nnodes", 2, "--node_rank", rank, "--nproc_per_node", 1, "--rdzv_backend", "static",
                  "--master_addr", "127.0.0.1", "--master_port", port), {})
        for port in [free_port()] for rank in (0, 1)]),
    "SLURM sbatch, 2 nodes": (2, lambda tmp: slurm_nodes(tmp)),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One plain process (`accel-train train`, no launcher): the losses and model every path must reproduce."""
    out = tmp_path_factory.mktemp("reference")
    train_in_process(*RUN, f"output_dir={out}")
    return out


# Paths that also evaluate the shared checkpoint with `accel-train eval`.
# (torchrun --nproc_per_node 2 evaluates in workloads/test_user_code_python_api_and_predict.py's regression example.)
EVAL_THROUGH = {"multi_node.yaml, 2 machines", "torchrun --nnodes 2", "SLURM sbatch, 2 nodes"}
# Profiles that ask for fp16, which a CPU cannot do: training says so in one line and runs in fp32.
FP16_PROFILES = {"multi_node.yaml, 2 machines", "wizard multi-GPU file", "SLURM sbatch, 2 nodes"}


# The launch path make test-min also runs at the dependency floors (its other launched tests use multi_gpu.yaml).
AT_FLOORS = {"torchrun --nproc_per_node 2"}


@pytest.mark.parametrize("path", [pytest.param(path, marks=pytest.mark.floors) if path in AT_FLOORS else path
                                  for path in PATHS])
def test_launch_path_trains_like_one_process_and_evaluates_a_checkpoint_identically(path, reference, tmp_path):
    world_size, nodes = PATHS[path]
    first_node = check_path(path, world_size, nodes, reference, tmp_path, evaluate=path in EVAL_THROUGH)
    warned = "fp16 mixed precision is unavailable on CPU; training in fp32" in first_node.stderr
    assert warned == (path in FP16_PROFILES), first_node.stderr[-2000:]
    if path.endswith(".yaml") or path.startswith(("multi_node.yaml", "SLURM")):  # a shipped profile: complete
        assert "had defaults used instead" not in first_node.stderr, first_node.stderr[-2000:]


def test_two_hosts_in_network_namespaces_train_like_one_process_over_the_interface_doctor_names(
        two_hosts, reference, tmp_path):
    # Separate namespaces: each "node" has only its veth address, and gloo must be told to use it.
    def nodes(tmp):
        port = free_port()
        return [(host.run(accelerate("--config_file", PROFILES / "multi_node.yaml", "--num_processes", 2,
                                     "--num_machines", 2, "--machine_rank", rank, "--main_process_ip",
                                     two_hosts[0].address, "--main_process_port", port)),
                 {"GLOO_SOCKET_IFNAME": host.interface}) for rank, host in enumerate(two_hosts)]

    # The eval through this launcher is the 127.0.0.1 multi_node path's; here the network is the point.
    check_path("multi_node.yaml, 2 network namespaces", 2, nodes, reference, tmp_path, evaluate=False)


def test_slurm_script_derives_rank_main_node_and_port_from_slurm_variables(tmp_path):
    nodes = slurm_nodes(tmp_path, nodes=2, dry_run=True, SLURM_JOB_ID="1234567", SLURM_GPUS_ON_NODE="a100:4")
    printed = [result.stdout.split() for result in run_nodes([(command + ["train", "mnist_cnn"], env)
                                                              for command, env in nodes])]

    def option(words, name):
        return words[words.index(name) + 1]

    for rank, words in enumerate(printed):
        assert words[:2] == ["accel-train", "launch"] and words[-3:] == ["accel_train", "train", "mnist_cnn"]
        assert option(words, "--join_timeout") == "300" and option(words, "--rdzv_conf") == "timeout=300"
        assert option(words, "--max_restarts") == "3"
        assert option(words, "--machine_rank") == str(rank)
        assert option(words, "--main_process_ip") == "127.0.0.1"  # first host of SLURM_JOB_NODELIST
        assert option(words, "--main_process_port") == str(20000 + 1234567 % 20000)
        assert (option(words, "--num_machines"), option(words, "--num_processes")) == ("2", "8")
        assert option(words, "--config_file") == str(PROFILES / "multi_node.yaml")  # found by accel-train profile


def test_slurm_script_takes_main_node_port_and_processes_per_node_from_the_environment_when_set(tmp_path):
    overrides = {"MAIN_PROCESS_IP": "10.1.2.3", "MAIN_PROCESS_PORT": "29123", "PROCESSES_PER_NODE": "3"}
    nodes = slurm_nodes(tmp_path, nodes=2, dry_run=True, SLURM_JOB_ID="1234567", SLURM_GPUS_ON_NODE="4", **overrides)
    for rank, result in enumerate(run_nodes([(command + ["train", "mnist_cnn"], env) for command, env in nodes])):
        words = result.stdout.split()
        assert words[words.index("--main_process_ip") + 1] == "10.1.2.3", words
        assert words[words.index("--main_process_port") + 1] == "29123"
        assert words[words.index("--num_processes") + 1] == "6"  # 2 nodes x 3
        assert words[words.index("--machine_rank") + 1] == str(rank)


def test_slurm_batch_step_starts_one_task_per_node_running_the_submitted_file(tmp_path):
    (_, env), _ = slurm_nodes(tmp_path, dry_run=True)
    srun = tmp_path / "fake_slurm_bin" / "srun"  # runs the task once per node, as srun --ntasks-per-node=1 does
    srun.write_text('#!/bin/bash\necho "$@" > "$0.args"\nwhile [[ "$1" == --* ]]; do shift; done\n'
                    'for node in 0 1; do SLURM_NODEID=$node "$@" > "$0.$node"; done\n')
    srun.chmod(0o755)
    submitted = tmp_path / "edited.sbatch"  # a user's edited copy: sbatch runs it from its spool folder
    submitted.write_text((PROFILES / "slurm_multi_node.sbatch").read_text().replace("main_process_port=${MAIN",
                                                                                   "MAIN_PROCESS_PORT=29999\nmain_process_port=${MAIN"))
    # The batch step, submitted from inside a node task: it inherits that task's environment, and still starts all.
    run_nodes([(["bash", str(submitted), "train", "mnist_cnn", "two words"], env)])
    srun_options = (tmp_path / "fake_slurm_bin/srun.args").read_text().split(" bash -c ")[0].split()
    assert srun_options == ["--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    for node in (0, 1):
        words = (tmp_path / f"fake_slurm_bin/srun.{node}").read_text()
        assert f"--machine_rank {node} " in words and "--main_process_port 29999 " in words, words
        assert words.strip().endswith("-m accel_train train mnist_cnn two\\ words"), words


def test_slurm_script_outside_an_allocation_says_what_is_missing(tmp_path):
    (command, env), _ = slurm_nodes(tmp_path)
    del env["SLURM_NODEID"]
    (result,) = run_nodes([(command + ["train", "mnist_cnn"], env)], check=False)
    assert result.returncode != 0 and "SLURM_NODEID unset" in result.stderr
