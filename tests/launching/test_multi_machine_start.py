"""Contracts of a multi-machine start: machines may start in any order, and one that waits says so.

"Machines" are launches on 127.0.0.1 started seconds apart. Each run must train like one plain process
(support/launching.py's check_path). A machine whose main node never comes must say, within seconds and then
every few seconds, where it waits, how many machines joined and when it gives up; then give up then, in one
line pointing at doctor, instead of torch's silent 10 minutes.
"""

import re
import subprocess
import time

import pytest

from accel_train.errors import UserError
from accel_train.launch.command import JOIN_TIMEOUT_S, split_arguments
from accel_train.launch.settings import settings_of_command
from support.commands import PYTHON, accelerate, command_env, free_port, train_in_process
from support.launching import RUN, check_path
from support.locations import PROFILES, REPO

APART_S = 8  # well past the time a launch takes to start here


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    train_in_process(*RUN, f"output_dir={out}")
    return out


def multi_node(rank: int, port: int, *options) -> list:
    return ["--config_file", PROFILES / "multi_node.yaml", "--num_processes", 2, "--num_machines", 2,
            "--machine_rank", rank, "--main_process_ip", "127.0.0.1", "--main_process_port", port, *options]


@pytest.mark.parametrize("first", [0, 1], ids=["machine 0 first", "machine 1 first"])
def test_elastic_rendezvous_trains_like_one_process_whichever_machine_starts_first(first, reference, tmp_path):
    def nodes(tmp):
        port = free_port()
        # On one box both launches would offer to host the rendezvous store; on real machines only the one at
        # main_process_ip does, which is what is_host=false tells machine 1 here.
        launches = {rank: (accelerate(*multi_node(rank, port, "--rdzv_backend", "c10d",
                                                  *(["--rdzv_conf", "is_host=false"] if rank else []))), {})
                    for rank in (0, 1)}
        return [launches[first], launches[1 - first]]

    check_path(f"c10d rendezvous, machine {first} first", 2, nodes, reference, tmp_path, evaluate=False,
               apart_s=APART_S)


def accel_train_launch(rank: int, port: int, timeout_s: float) -> list[str]:
    return [PYTHON, "-m", "accel_train", "launch", "--join_timeout", str(timeout_s),
            *map(str, multi_node(rank, port)), "-m", "accel_train"]


def test_accel_train_launch_waits_for_a_late_main_machine_saying_so_then_trains_like_one_process(reference, tmp_path):
    port = free_port()
    nodes = lambda tmp: [(accel_train_launch(1, port, 120), {}), (accel_train_launch(0, port, 120), {})]  # noqa: E731
    late = check_path("accel-train launch, machine 0 late", 2, nodes, reference, tmp_path, evaluate=False,
                      apart_s=APART_S)
    waiting = [line for line in late.stderr.splitlines() if line.startswith("accel-train launch: ")]
    assert re.fullmatch(r"accel-train launch: machine 1 of 2: waiting for the other machines at 127\.0\.0\.1:\d+, "
                        r"giving up at \d\d:\d\d:\d\d \(120 s\)", waiting[0]), waiting
    assert any(f"0 of 2 machines joined: machine 0 not reached at 127.0.0.1:{port} (connection refused" in line
               for line in waiting), waiting
    assert re.fullmatch(r"accel-train launch: all 2 machines joined in [\d.]+ s; handing over to accelerate launch",
                        waiting[-1]), waiting


def test_a_machine_whose_main_node_never_comes_says_so_at_once_and_gives_up_at_its_timeout(tmp_path):
    timeout_s = 12
    started = time.monotonic()
    machine = subprocess.Popen([*accel_train_launch(1, free_port(), timeout_s), "train", *RUN,
                                f"output_dir={tmp_path}"], cwd=REPO, env=command_env(), stderr=subprocess.PIPE,
                               text=True)
    lines = []
    for line in machine.stderr:
        lines.append((time.monotonic() - started, line.rstrip("\n")))
    machine.wait(timeout=60)
    ended = time.monotonic() - started
    assert machine.returncode == 4, lines  # LaunchError (README exit codes)
    first_line_s, first = lines[0]
    assert first.startswith("accel-train launch: machine 1 of 2: waiting for the other machines at 127.0.0.1:")
    assert first_line_s < timeout_s / 2, lines  # before any wait, let alone torch's 600 s
    waiting = [text for _, text in lines[1:-1]]
    assert waiting and all("0 of 2 machines joined: machine 0 not reached" in text and "giving up at" in text
                           and "accel-train doctor" in text for text in waiting), lines
    assert lines[-1][1].startswith("accel-train: error: gave up: machine 0 never answered at 127.0.0.1:")
    assert "Traceback" not in "\n".join(text for _, text in lines)
    assert timeout_s <= ended < timeout_s + 30, ended
    assert not any(tmp_path.iterdir()), "nothing was started, so nothing is written"
    print(f"\nmain node absent: first line after {first_line_s:.1f} s, exit {machine.returncode} after {ended:.1f} s "
          f"(--join_timeout {timeout_s})")


def test_accel_train_launch_takes_its_timeout_in_either_spelling_and_passes_the_rest_on_untouched():
    rest = ["--config_file", "multi_node.yaml", "--machine_rank", "1", "-m", "accel_train", "train", "mnist_cnn"]
    assert split_arguments(["--join_timeout", "60", *rest]) == (60.0, rest)
    assert split_arguments(["--join_timeout=60", *rest]) == (60.0, rest)
    assert split_arguments(rest) == (JOIN_TIMEOUT_S, rest)
    for wrong in (["--join_timeout", "soon", *rest], ["--join_timeout=-1", *rest], ["--join_timeout"]):
        with pytest.raises(UserError, match="give the seconds to wait for the other machines") as refused:
            split_arguments(wrong)
        assert type(refused.value) is UserError, "a command-line mistake: exit 2, as README's table says"


def test_accel_train_launch_refuses_a_range_of_machines_in_one_line_naming_the_elastic_torchrun_command():
    head = ["--config_file", str(PROFILES / "multi_node.yaml"), "--machine_rank", "1"]
    for spelling in (["--num_machines", "1:2"], ["--num_machines=1:2"]):
        with pytest.raises(UserError) as refused:
            settings_of_command([*head, *spelling, "-m", "accel_train", "train", "mnist_cnn"])
        assert type(refused.value) is UserError, "a command-line mistake: exit 2"
        assert str(refused.value).startswith("--num_machines 1:2: accelerate launch takes a fixed number of machines")
        assert "torchrun --nnodes 1:2 --rdzv_backend c10d" in str(refused.value)
    # After the module, the words are the training command's: none of the launcher's business.
    command = [*head, "--num_machines", "2", "-m", "accel_train", "train", "--num_machines=1:2"]
    settings, _ = settings_of_command(command)
    assert settings.num_machines == 2
