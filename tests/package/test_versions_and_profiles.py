"""Contracts of what is installed: the versions accel-train runs with are checked against the floors pyproject.toml
declares (make test-min proves the floors themselves), and the launch profiles are found by name wherever the
package is installed."""

import os
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

import accel_train
from support.commands import run_cli
from support.locations import PROFILES

DECLARED = [Requirement(line) for line in metadata.requires("accel-train")]
# Installed beside the floors from the developer's environment (older wheels are not installable everywhere).
NOT_AT_FLOOR = {"torch", "torchvision"}


def declared(name: str, extra: str | None = None) -> Requirement:
    """pyproject.toml's requirement on `name`: a core one, or the one of an extra."""
    return next(r for r in DECLARED if r.name == name and
                (r.marker.evaluate({"extra": extra}) if r.marker and extra else not r.marker))


def with_installed_version(tmp_path: Path, name: str, version: str) -> dict:
    """An environment in which the package metadata says `name` is at `version` (the module is still the real one):
    what the start-up check reads."""
    info = tmp_path / "site" / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return {"PYTHONPATH": str(tmp_path / "site")}


@pytest.mark.floors
def test_a_too_old_accelerate_stops_before_anything_runs_with_one_line_naming_the_version_needed(tmp_path):
    env = with_installed_version(tmp_path, "accelerate", "1.2.0")
    needed = f"accelerate{declared('accelerate').specifier}"
    line = f"accelerate 1.2.0 is too old for accel-train {accel_train.__version__}: need {needed}"
    out = tmp_path / "run"
    result = run_cli("train", "mnist_cnn", "data.synthetic=true", f"output_dir={out}", check=False, env=env)
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        f"accel-train: error: {line} (pip install -U '{needed}')"], result.stderr
    assert not out.exists(), "nothing is created before the check"
    # The same words where a user looks for versions: accel-train --version and doctor (a problem, exit 1).
    assert f"problem: {line}" in run_cli("--version", env=env).stdout
    doctor = run_cli("doctor", check=False, env=env)
    assert doctor.returncode == 1 and f"problem: {line}" in doctor.stdout, doctor.stdout


def test_a_too_old_tensorboard_is_refused_in_one_line_only_when_a_run_would_log_to_it(tmp_path):
    env = with_installed_version(tmp_path, "tensorboard", "2.12.0")
    needed = f"tensorboard{declared('tensorboard', extra='tensorboard').specifier}"
    result = run_cli("train", "mnist_cnn", "data.synthetic=true", f"output_dir={tmp_path / 'run'}", check=False,
                     env=env)
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        f"accel-train: error: train.log_with=tensorboard: tensorboard 2.12.0 is too old for accel-train "
        f"{accel_train.__version__}: need {needed} (pip install -U '{needed}'); or set train.log_with=none"]
    assert "problem:" not in run_cli("--version", env=env).stdout, "an optional package is not a problem"


@pytest.mark.floors
@pytest.mark.skipif(not os.environ.get("ACCEL_TRAIN_AT_FLOORS"), reason="only in make test-min's environment")
def test_make_test_min_runs_every_direct_dependency_at_its_declared_floor():
    at_floor = [r for r in DECLARED if r.name not in NOT_AT_FLOOR and (not r.marker or any(
        r.marker.evaluate({"extra": extra}) for extra in ("tensorboard", "sweep", "s3", "hub", "onnx")))]
    assert {r.name for r in at_floor} >= {"accelerate", "evaluate", "datasets", "pyyaml", "tqdm", "safetensors",
                                          "tensorboard", "optuna", "fsspec", "s3fs", "transformers", "timm",
                                          "huggingface_hub", "onnx", "onnxscript", "onnxruntime"}
    for requirement in at_floor:
        (floor,) = [spec.version for spec in requirement.specifier if spec.operator == ">="]
        assert Version(metadata.version(requirement.name)) == Version(floor), \
            f"{requirement.name} {metadata.version(requirement.name)} is installed; the declared floor is {floor}"


def test_profiles_lists_every_shipped_profile_with_what_it_is_for_and_profile_prints_its_file():
    listed = dict(line.split(maxsplit=1) for line in run_cli("profiles").stdout.splitlines())
    shipped = {path.stem: path for path in PROFILES.iterdir() if path.suffix in (".yaml", ".sbatch")}
    assert listed.keys() == shipped.keys()
    for name, path in shipped.items():
        first_comment = next(line for line in path.read_text().splitlines() if line.startswith("# "))
        assert listed[name] == first_comment[2:], name
        for asked in (name, path.name):
            assert Path(run_cli("profile", asked).stdout.strip()).read_text() == path.read_text()
    wrong = run_cli("profile", "multi-gpu", check=False)
    assert wrong.returncode == 2 and wrong.stderr.strip().splitlines() == [
        f"accel-train: error: profile 'multi-gpu': no such profile; choose one of: {', '.join(sorted(shipped))}"]


def test_version_names_accel_train_torch_torchvision_accelerate_and_the_devices():
    lines = dict(line.split(maxsplit=1) for line in run_cli("--version").stdout.splitlines())
    assert lines["accel-train"] == accel_train.__version__ == metadata.version("accel-train")
    for name in ("torch", "torchvision", "accelerate"):
        assert lines[name] == metadata.version(name)
    assert lines["devices"].startswith("no GPU visible; CPU with")  # commands run with any GPU hidden (command_env)
    assert "problem:" not in lines


def test_doctor_takes_a_profile_by_name_and_names_the_choices_for_neither_a_file_nor_a_profile():
    result = run_cli("doctor", "--config_file", "multi_gpu", check=False)
    assert f"{PROFILES / 'multi_gpu.yaml'}: distributed_type MULTI_GPU" in result.stdout, result.stdout
    wrong = run_cli("doctor", "--config_file", "multi-gpu", check=False)
    assert wrong.returncode == 2 and wrong.stderr.strip().splitlines() == [
        "accel-train: error: --config_file multi-gpu: no such file, and no shipped profile of that name "
        "(cpu, fsdp, multi_gpu, multi_node, pytorchjob_elastic, pytorchjob_store, single_gpu, slurm_multi_node)"]


def test_make_demo_installs_only_what_the_demo_uses_and_make_test_what_the_tests_use():
    """The demo trains on Fashion-MNIST: Debian's photographs (the tests' and bench --input's) are not its to install.
    `make -n` prints what each would run, running nothing."""
    import subprocess

    from support.locations import REPO

    def planned(target: str) -> str:
        return subprocess.run(["make", "-n", target], cwd=REPO, capture_output=True, text=True, check=True).stdout

    demo, test = planned("demo"), planned("test")
    assert "dataset-fashion-mnist" in demo and "mate-backgrounds" not in demo, demo
    assert "dataset-fashion-mnist" in test and "mate-backgrounds" in test, test
