# The virtual environment lives at .venv; every target reuses it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
# A CPU machine gets the CPU build of torch, a machine with an NVIDIA driver the CUDA one.
# Torch is installed before the project so pip never resolves a multi-GB CUDA build on a CPU box.
# Set TORCH_INDEX to a PyTorch wheel index if the CPU wheel is not on your default indexes.
TORCH_SPEC ?= $(shell if command -v nvidia-smi >/dev/null 2>&1; then echo "torch==$(TORCH_VERSION)"; else echo "torch==$(TORCH_VERSION)+cpu"; fi)
TORCH_INDEX ?=
PIP := $(PY) -m pip install --disable-pip-version-check -q

.PHONY: setup test test-fast demo demo-regenerate bench clean

setup: $(VENV)/.installed

# The loader's batch filler (dspark_cache/loader/csrc) and the shard writer's hot loop
# (dspark_cache/format/tar/csrc) are C, built by pip with the system's C compiler; without one the
# install still works and both fall back to slower Python paths.
NATIVE_SOURCES := $(wildcard dspark_cache/loader/csrc/*.c dspark_cache/format/csrc/*.h dspark_cache/format/tar/csrc/*.c)
$(VENV)/.installed: pyproject.toml setup.py $(NATIVE_SOURCES)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) "$(TORCH_SPEC)"
	$(PIP) -e ".[test,s3]"
	$(PY) -c "from dspark_cache.loader.fill import native_available; native_available()"
	$(PY) -c "from dspark_cache.format.tar.append import native_available; native_available()"
	touch $@

# Three workers on two cores: the suite waits on the processes and servers it starts (producers, torchrun
# jobs, an S3 server, transformers serve) for about a quarter of its time, which a third worker fills
# (BENCHMARKS.md, "The suite"). A file's tests share a worker, so the caches a module builds once are built once.
PYTEST_WORKERS ?= 3
PYTEST := $(PY) -m pytest -q --dist loadfile

test: setup
	$(PYTEST) -n $(PYTEST_WORKERS)

# The inner loop: everything but the tests marked slow (the longest end-to-end runs). Two workers: with
# the waiting runs left out, a third worker's own start-up costs more than it fills.
test-fast: setup
	$(PYTEST) -n 2 -m "not slow"

demo: setup
	$(PY) -m dspark_cache.demo

# The step before: transformers serve (CPU) regenerates the sample answers, then dspark-produce.
demo-regenerate: setup
	$(PY) -m dspark_cache.regenerate.demo

bench: setup
	$(PY) bench/producer.py

clean:
	rm -rf .demo .bench .pytest_cache

# Opt-in parity check against NVIDIA's real nemo-automodel (unedited), in its own venv: NeMo pins
# transformers==5.18, so it never shares .venv. First run creates .venv-nemo (a few minutes, ~3 GB).
NEMO_VENV := .venv-nemo
NEMO_AUTOMODEL_VERSION ?= 0.7.0
NEMO_PARITY_ARGS ?=

.PHONY: test-nemo
test-nemo: setup
	PYTHON="$(PYTHON)" TORCH_SPEC="$(TORCH_SPEC)" TORCH_INDEX="$(TORCH_INDEX)" NEMO_AUTOMODEL_VERSION="$(NEMO_AUTOMODEL_VERSION)" \
		bash tests/nemo/parity/setup_venv.sh $(NEMO_VENV)
	$(PY) tests/nemo/parity/run.py --nemo-python $(NEMO_VENV)/bin/python $(NEMO_PARITY_ARGS)
