"""Where the suite finds things: the repository, its launch profiles, the launched probe, the user-code fixtures and
Fashion-MNIST; the tests a page of docs/ names."""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
PROFILES = REPO / "accelerate_configs"
PROBE = "tests/launched_probe.py"  # the CLI with recorders and injected faults (see its docstring); cwd is REPO
USER_RECIPE = str(TESTS / "user_code" / "recipe.yaml")  # user_models.py beside it
FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")

needs_fashion_mnist = pytest.mark.skipif(
    not FASHION_MNIST.is_dir(),
    reason="Fashion-MNIST not installed (apt-get install dataset-fashion-mnist; make test does it)"
)

PHOTOS = (Path("/usr/share/backgrounds/mate/nature"), Path("/usr/share/backgrounds/ukui"))  # tools/photos.py's
needs_photos = pytest.mark.skipif(
    not any(folder.is_dir() for folder in PHOTOS),
    reason="no photographs (apt-get install mate-backgrounds; make test does it)"
)


def named_tests(text: str) -> list[tuple[str, str]]:
    """The tests a docs table names, as `file.py::test_name` (a bare `::test_name` is in the file named before it)."""
    named, file = [], None
    for file_name, test in re.findall(r"`((?:\w+/)*test_\w+\.py)?::(test_\w+)`", text):
        file = file_name or file
        named.append((file, test))
    return named


def is_defined(file: str, test: str) -> bool:
    """Whether tests/`file` defines `test` at its top level."""
    return re.search(rf"^def {test}\(", (TESTS / file).read_text(), re.M) is not None
