"""The launch profiles shipped with the package (accelerate configs and the SLURM script), by name."""

from __future__ import annotations

from pathlib import Path

from accel_train.errors import UserError

PROFILE_SUFFIXES = (".yaml", ".sbatch")


def profiles_dir() -> Path:
    """Installed from a wheel the profiles are accel_train/profiles/; in a clone they are the repo's
    accelerate_configs/, which the wheel is built from."""
    package = Path(__file__).resolve().parents[1]
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
