"""What is installed: the launch profiles shipped with the package, the versions of the libraries accel-train
needs (gathered here once, and checked against the floors pyproject.toml declares, read back from the installed
package's metadata, so there is one list), and the devices torch sees. No torch import at module level: the
check runs before torch loads."""

from __future__ import annotations

import functools
import os
import platform
from importlib import metadata
from pathlib import Path

from accel_train import __version__
from accel_train.errors import UserError

DISTRIBUTION = "accel-train"
PROFILE_SUFFIXES = (".yaml", ".sbatch")


def profiles_dir() -> Path:
    """Installed from a wheel the profiles are accel_train/profiles/; in a clone they are the repo's
    accelerate_configs/, which the wheel is built from."""
    package = Path(__file__).resolve().parent
    installed = package / "profiles"
    return installed if installed.is_dir() else package.parent / "accelerate_configs"


def list_profiles() -> dict[str, Path]:
    folder = profiles_dir()
    return {path.stem: path for path in sorted(folder.iterdir()) if path.suffix in PROFILE_SUFFIXES}


def find_profile(name: str) -> Path | None:
    """The installed file of a profile, by name (multi_gpu) or file name (multi_gpu.yaml); None if none is."""
    return list_profiles().get(Path(name).stem if Path(name).suffix in PROFILE_SUFFIXES else name)


def profile_path(name: str) -> Path:
    found = find_profile(name)
    if found is None:
        raise UserError(f"profile {name!r}: no such profile; choose one of: {', '.join(list_profiles())}")
    return found


def profile_summary(path: Path) -> str:
    """The first comment line after any #! line: what the profile is for."""
    for line in path.read_text().splitlines():
        if line.startswith("#") and not line.startswith("#!"):
            return line.lstrip("#").strip()
    return ""


@functools.cache  # the installed versions do not change while a process runs: checked once
def version_problems(extras: tuple[str, ...] = ()) -> tuple[str, ...]:
    """One line per declared dependency whose installed version is missing or outside its range; the requirements
    of `extras` are checked only where installed (they are optional)."""
    from packaging.requirements import Requirement

    try:
        declared = metadata.requires(DISTRIBUTION) or []
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed: nothing declared
        return ()
    problems = []
    for line in declared:
        requirement = Requirement(line)
        extra = next((name for name in extras if requirement.marker and requirement.marker.evaluate({"extra": name})),
                     None)
        if requirement.marker and extra is None:
            continue
        try:
            have = metadata.version(requirement.name)
        except metadata.PackageNotFoundError:
            if extra is None:
                problems.append(f"{requirement.name} is not installed; need {requirement.name}{requirement.specifier} "
                                f"(pip install '{requirement.name}{requirement.specifier}')")
            continue
        if not requirement.specifier.contains(have, prereleases=True):
            problems.append(f"{requirement.name} {have} is {_how_far(requirement, have)} for accel-train "
                            f"{__version__}: need {requirement.name}{requirement.specifier} "
                            f"(pip install -U '{requirement.name}{requirement.specifier}')")
    return tuple(problems)


def _how_far(requirement, have: str) -> str:
    from packaging.version import Version

    floors = [spec.version for spec in requirement.specifier if spec.operator in (">=", ">", "~=")]
    return "too old" if any(Version(have) < Version(floor) for floor in floors) else "not supported"


def check_versions(extras: tuple[str, ...] = ()) -> None:
    """Stop in one line, before anything runs, when a library is older than the declared floor: an old library
    otherwise fails later with an error that blames something else (e.g. every checkpoint looking damaged)."""
    problems = version_problems(extras)
    if problems:
        more = f" (and {len(problems) - 1} more: accel-train --version lists them)" if len(problems) > 1 else ""
        raise UserError(problems[0] + more)


@functools.cache
def versions() -> dict[str, str]:
    """accel-train's version and those of the libraries a run depends on, and Python's: what --version, doctor,
    bench and every run's config.yaml record (gathered once a process)."""
    found = {}
    for name in (DISTRIBUTION, "torch", "torchvision", "accelerate"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = __version__ if name == DISTRIBUTION else "not installed"
    return {**found, "python": platform.python_version()}


def cpu_has_bf16() -> bool:
    """Whether oneDNN has native bf16 kernels here (AVX512-BF16 / AMX); without them autocast only emulates."""
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def visible_devices() -> tuple[str, str, list[str], str]:
    """The device type ("cuda", "xpu" or "cpu"), its process-group backend, the device names, and one line
    saying what is visible."""
    import torch

    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        return "cuda", "nccl", names, f"{len(names)} CUDA GPU(s): {', '.join(names)}"
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        names = [f"xpu:{i}" for i in range(torch.xpu.device_count())]
        return "xpu", "xccl", names, f"{len(names)} Intel XPU(s)"
    return "cpu", "gloo", [], f"no GPU visible; CPU with {os.cpu_count()} cores"
