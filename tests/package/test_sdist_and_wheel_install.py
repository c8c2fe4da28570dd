"""What a user who pip-installs accel-train gets: the sdist and the wheel built by `python -m build` (the wheel from
the sdist), installed (not editable) into a fresh environment, work from a folder outside the repo, with the
recipes and launch profiles that travel inside the package."""

import os
import subprocess
import sys
import tarfile
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
import yaml

from support.commands import free_port
from support.locations import PROFILES, REPO
from support.runs import read_metrics

BIN = Path(sys.executable).parent


def run(command: list, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TQDM_DISABLE="1", PYTHONUNBUFFERED="1")
    result = subprocess.run([str(part) for part in command], cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, f"{' '.join(map(str, command))} exited {result.returncode}\n" \
                                   f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return result


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, str]:
    """The sdist and the wheel `python -m build` makes, in one folder; and what the build said."""
    tmp = tmp_path_factory.mktemp("packaging")
    dist = tmp / "dist"
    result = run([sys.executable, "-m", "build", "--installer", "uv", "--outdir", dist, REPO], cwd=tmp)
    return dist, result.stdout + result.stderr


def test_the_build_warns_of_nothing_and_the_wheel_names_its_license_as_pep_639_does(built):
    dist, said = built
    assert "Warning" not in said and "deprecat" not in said.lower(), said[-5000:]
    (wheel,) = dist.glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        (metadata_file,) = [name for name in archive.namelist() if name.endswith(".dist-info/METADATA")]
        assert "License-Expression: Apache-2.0" in archive.read(metadata_file).decode().splitlines()


@pytest.fixture(scope="module")
def installed(built, tmp_path_factory) -> Path:
    """A fresh environment holding the built wheel; torch and torchvision pinned to this environment's, so the
    install links uv's cached copies instead of fetching newer ones."""
    dist, _ = built
    tmp = dist.parent
    (sdist,), (wheel,) = dist.glob("*.tar.gz"), dist.glob("*.whl")
    with tarfile.open(sdist) as archive:
        in_sdist = {Path(name).name for name in archive.getnames() if "/accelerate_configs/" in name}
    with zipfile.ZipFile(wheel) as archive:
        in_wheel = set(archive.namelist())
    shipped = {path.name for path in PROFILES.iterdir() if path.suffix in (".yaml", ".sbatch")}
    assert in_sdist == shipped
    assert {f"accel_train/profiles/{name}" for name in shipped} <= in_wheel
    assert {f"accel_train/recipes/{path.name}" for path in (REPO / "accel_train" / "recipes").glob("*.yaml")} \
        <= in_wheel
    venv = tmp / "venv"
    run([BIN / "uv", "venv", "--quiet", "--python", sys.executable, venv], cwd=tmp)
    run([BIN / "uv", "pip", "install", "--quiet", "--python", venv / "bin" / "python", wheel,
         f"torch=={metadata.version('torch')}", f"torchvision=={metadata.version('torchvision')}"], cwd=tmp)
    return venv / "bin"


def test_the_installed_wheel_lists_recipes_and_names_its_versions_from_any_folder(installed, tmp_path):
    recipes = run([installed / "accel-train", "recipes"], cwd=tmp_path).stdout
    assert all(path.stem in recipes for path in (REPO / "accel_train" / "recipes").glob("*.yaml"))
    versions = dict(line.split(maxsplit=1) for line in run([installed / "accel-train", "--version"],
                                                           cwd=tmp_path).stdout.splitlines())
    assert versions["accel-train"] == metadata.version("accel-train") and "devices" in versions
    assert "problem:" not in versions


def test_the_installed_wheel_trains_two_steps_at_2_processes_through_its_own_multi_gpu_profile(installed, tmp_path):
    profile = Path(run([installed / "accel-train", "profile", "multi_gpu"], cwd=tmp_path).stdout.strip())
    assert profile.is_relative_to(installed.parent) and profile.read_text() == (PROFILES / "multi_gpu.yaml").read_text()
    out = tmp_path / "run"
    result = run([installed / "accelerate", "launch", "--config_file", profile, "--num_processes", 2,
                  "--main_process_port", free_port(), "-m", "accel_train", "train", "mnist_cnn", "data.synthetic=true",
                  "data.train_subset=96", "data.eval_subset=64", "train.batch_size=32", "train.max_steps=2",
                  "train.log_every_steps=1", f"output_dir={out}"], cwd=tmp_path)
    assert yaml.safe_load((out / "config.yaml").read_text())["run"]["world_size"] == 2, result.stdout[-2000:]
    assert [line["step"] for line in read_metrics(out, "train")] == [1, 2]
    assert read_metrics(out, "test")[-1]["num_samples"] == 64
    assert (out / "curves.png").is_file()  # the installed matplotlib draws it under a 2-process launch
    where = run([installed / "python", "-c", "import accel_train; print(accel_train.__file__)"], cwd=tmp_path).stdout
    assert "site-packages/accel_train" in where, "the run used the installed package, not the checkout"
