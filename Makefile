# make demo      - set up everything on a fresh machine and train Fashion-MNIST for one epoch
# make test      - set up everything (with dev extras and data), lint (ruff), run the test suite (its 15 slowest tests
#                  named), then test-min
# make test-fast - lint, then the tests that start no process and use no S3 store (about 45 s): after every edit
# make test-min  - the contract tests at the lowest versions pyproject.toml allows (accelerate, evaluate, datasets,
#                  numpy, pyyaml, tqdm, safetensors, matplotlib, psutil, packaging, tensorboard) beside this torch
# make mutations - break each contract in turn (tests/mutations/run.py) and show a test fails; not part of test
# make gpu-wheels - here, with the package index: .gpu-wheels/, the wheels a fresh GPU machine lacks (for gpu-check)
# make gpu-check - on a machine with one GPU and no network, from the repo root with .gpu-wheels/ beside it: what only
#                  a GPU shows, one table in at most 8 minutes (tools/gpu_check.py); DRY_RUN=1: every row on the CPU
# make gpu-data  - here: .gpu-data/, Fashion-MNIST's files and 512 photographs (about 50 MiB) for gpu-bench
# make gpu-bench - there, beside gpu-check: the speed questions only a GPU answers (small models, time to accuracy,
#                  FLOP/s, JPEG decoding, the Hub's ViT-B/16), one table in at most 8 minutes (tools/gpu_bench.py)
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
MIN_VENV := .venv-min
# uv installs (pip installs uv itself): it keeps one cache of unpacked wheels and links from it, so the second and
# third environments (test-min, the packaging test) take seconds instead of another torch download. Unlike pip it
# writes no .pyc unless told: without --compile-bytecode every process compiles torch again (4 s more per start).
UV := $(BIN)/uv
FASHION_MNIST := /usr/share/datasets/fashion-mnist
PHOTOS := /usr/share/backgrounds/mate/nature
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
# Test files run in parallel, one file per worker (its module fixtures are built once): as many workers as
# cores, at most 4, since one test may start several training processes.
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); [ $$n -gt 4 ] && n=4; echo $$n)
# The tests write bytecode (into __pycache__/, which git ignores) even where the shell sets PYTHONDONTWRITEBYTECODE:
# otherwise each of the hundreds of processes the suite starts compiles the package again, and each pytest worker
# rewrites the asserts of every test module again.
WRITE_BYTECODE := env -u PYTHONDONTWRITEBYTECODE
PYTEST := $(WRITE_BYTECODE) $(BIN)/python -m pytest

# The GPU machine's python3 (3.12, torch, accelerate, torchvision, pandas, pyarrow, xxhash, fsspec, huggingface-hub,
# pytest, pytest-xdist, ...) lacks these of accel-train's dependencies and theirs, nothing else: datasets and evaluate
# (and their dill and multiprocess, at datasets' bounds), plus webdataset and braceexpand, which two test files of
# the fast tier import, and simplejpeg (data.decode=scaled; without it JPEGs are decoded at full size). Pure-Python
# wheels but simplejpeg's (cp312 manylinux), about 2 MiB; the versions make test installs here.
GPU_WHEELS := .gpu-wheels
GPU_WHEEL_PINS := datasets==5.2.0 evaluate==0.4.6 dill==0.4.1 multiprocess==0.70.19 webdataset==1.0.2 braceexpand==0.1.7 simplejpeg==1.9.0

.PHONY: install data fashion-mnist photographs demo lint test test-fast test-min mutations gpu-wheels gpu-check \
	gpu-data gpu-bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check 'uv>=0.5'
	$(UV) pip install --quiet --compile-bytecode --python $(BIN)/python -e '.[dev]'
	touch $@

# The tests' data: Fashion-MNIST and photographs.
data: fashion-mnist photographs

# Fashion-MNIST offline from Debian's dataset-fashion-mnist where apt is available; otherwise torchvision downloads it
# on first use. The demo needs nothing else.
fashion-mnist:
	@if [ -d $(FASHION_MNIST) ]; then echo "Fashion-MNIST found in $(FASHION_MNIST)"; \
	elif command -v apt-get >/dev/null 2>&1; then \
		$(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq dataset-fashion-mnist >/dev/null \
		|| echo "warning: could not install dataset-fashion-mnist; torchvision will download Fashion-MNIST"; \
	else echo "no apt-get: torchvision will download Fashion-MNIST on first use"; fi

# Photographs from Debian's mate-backgrounds, of which `accel-train photos`, bench --input and the tests make an
# ImageNet-shaped folder of JPEGs (accel_train/tools/photos.py).
photographs:
	@if [ -d $(PHOTOS) ]; then echo "photographs found in $(PHOTOS)"; \
	elif command -v apt-get >/dev/null 2>&1; then \
		$(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq mate-backgrounds >/dev/null \
		|| echo "warning: could not install mate-backgrounds; bench --input needs data.root=FOLDER"; \
	else echo "no apt-get: bench --input needs data.root=FOLDER (a folder of images)"; fi

demo: install fashion-mnist
	@rm -rf runs/demo; start=$$(date +%s); \
	$(BIN)/accel-train train fashion_mnist_cnn train.epochs=1 output_dir=runs/demo && \
	echo "demo wall time: $$(( $$(date +%s) - start )) s (setup excluded); results in runs/demo"

lint: install
	$(BIN)/ruff check .

test: install data lint
	$(PYTEST) -q -n $(TEST_WORKERS) --dist loadfile --durations=15
	$(MAKE) --no-print-directory test-min

# The tests that start no process (tests/support/processes.py marks the others `processes`, from the code they run).
test-fast: install data lint
	$(PYTEST) -q -n $(TEST_WORKERS) --dist loadfile -m 'not processes and not store'

# Every direct dependency at its declared floor (uv's lowest-direct resolution), the test tools (the dev extra)
# at theirs too, beside the torch and torchvision of $(VENV) (older wheels are not installable everywhere: their
# floors are stated in README); then the tests marked `floors` (README "Install" lists them), their commands forks of
# a preloaded interpreter at the floors as in make test (72 s; 199 s each a fresh interpreter, which
# ACCEL_TRAIN_TESTS_FRESH_INTERPRETERS=1 make test-min still runs: docs/tests.md "The preloaded interpreter").
test-min: install data
	rm -rf $(MIN_VENV)
	$(UV) venv --quiet --python $(BIN)/python $(MIN_VENV)
	$(UV) pip install --quiet --compile-bytecode --python $(MIN_VENV)/bin/python --resolution lowest-direct -e '.[tensorboard,dev]' \
		$$($(UV) pip freeze --python $(BIN)/python | grep -E '^torch(vision)?==')
	$(WRITE_BYTECODE) ACCEL_TRAIN_AT_FLOORS=1 $(MIN_VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m floors -p no:cacheprovider

# One-off, not in CI: about 10 minutes, and it edits the working tree while it runs (restoring every file).
mutations: install
	$(BIN)/python tests/mutations/run.py $(MUTATIONS)

gpu-wheels:
	rm -rf $(GPU_WHEELS) && mkdir -p $(GPU_WHEELS)
	$(PYTHON) -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 -d $(GPU_WHEELS) $(GPU_WHEEL_PINS)
	@ls -1 $(GPU_WHEELS); echo "$(GPU_WHEELS): $$(du -ch $(GPU_WHEELS)/*.whl | tail -1 | cut -f1) in all"

# No install: the GPU machine has no network. Its python3 runs the check, which installs .gpu-wheels/ itself.
gpu-check:
	$(PYTHON) tools/gpu_check.py $(if $(DRY_RUN),--dry-run)

GPU_DATA := .gpu-data
gpu-data: install fashion-mnist photographs
	mkdir -p $(GPU_DATA)/fashion-mnist && cp $(FASHION_MNIST)/*-ubyte.gz $(GPU_DATA)/fashion-mnist/
	$(BIN)/accel-train photos $(GPU_DATA)/photos --train 512 --test 64
	@echo "$(GPU_DATA): $$(du -sh $(GPU_DATA) | cut -f1)"

gpu-bench:
	$(PYTHON) tools/gpu_bench.py $(if $(DRY_RUN),--dry-run)

clean:
	rm -rf $(VENV) $(MIN_VENV) runs data .pytest_cache
