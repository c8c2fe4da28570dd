"""Where the suite finds things: the repository, its launch profiles, the launched probe, the user-code fixtures and
Fashion-MNIST."""

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
