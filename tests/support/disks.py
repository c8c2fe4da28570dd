"""Small and read-only disks: a tmpfs mounted in a test's folder, for what a full or read-only disk does."""

from __future__ import annotations

import subprocess
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def tmpfs_mounts(folder: Path):
    """mount(size, readonly) -> a folder under `folder` on a tmpfs of that size; every one unmounted at the end.
    Skips the test where mounting is not allowed."""
    mounted = []

    def mount(size: str, readonly: bool = False) -> Path:
        place = folder / f"disk{len(mounted)}"
        place.mkdir()
        options = f"size={size}" + (",ro" if readonly else "")
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(place)], capture_output=True,
                                text=True)
        if result.returncode:
            pytest.skip(f"cannot mount a tmpfs ({result.stderr.strip()}); needs root or CAP_SYS_ADMIN")
        mounted.append(place)
        return place

    try:
        yield mount
    finally:
        for place in mounted:
            subprocess.run(["umount", "-l", str(place)], capture_output=True)
