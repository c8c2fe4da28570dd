"""What is installed: the versions of the libraries accel-train needs, gathered once, and checked against the
floors pyproject.toml declares (read back from the installed package's metadata, so there is one list). No torch
import: the check runs before torch loads."""

from __future__ import annotations

import functools
import platform
from importlib import metadata

from accel_train import __version__
from accel_train.errors import UserError

DISTRIBUTION = "accel-train"


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
