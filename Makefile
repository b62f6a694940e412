# The README's commands. Everything lives in a local virtual environment (.venv).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PORT   ?= 8888
# torch: a GPU box (nvidia-smi works) gets PyPI's default CUDA build; a machine
# without a GPU gets TORCH_CPU (override e.g. TORCH_CPU="torch --index-url
# https://download.pytorch.org/whl/cpu" for a smaller CPU-only download).
TORCH_GPU ?= torch
TORCH_CPU ?= torch==2.13.0
# Jupyter refuses to run as root unless told (containers, cloud VMs often log in as root).
ALLOW_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root,)

.PHONY: course test test-gpu kernel-ir setup demo doctor exercises clean

# The version check stops before the download: on an older Python, torch and this package
# would fail later and less clearly (pyproject.toml: requires-python).
$(VENV)/.installed: pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(None if sys.version_info >= (3, 10) else "dpcourse needs Python >= 3.10, $(PYTHON) is " + sys.version.split()[0] + ": run make with PYTHON=python3.10 (or newer)")'
	$(PYTHON) -m venv $(VENV)
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		echo "GPU found: installing $(TORCH_GPU)"; $(PY) -m pip install -q $(TORCH_GPU); \
	else \
		echo "no GPU found: installing $(TORCH_CPU) (lessons run on 2 CPU ranks over gloo)"; \
		$(PY) -m pip install -q $(TORCH_CPU); \
	fi
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

setup: $(VENV)/.installed

course: setup  ## set up, then open JupyterLab on lesson 00 (loopback only)
	$(VENV)/bin/jupyter lab --ip=127.0.0.1 --port=$(PORT) $(ALLOW_ROOT) lessons/00_setup.ipynb

# Type-checked packages: the algorithms (dpcourse/comm/kernels included).
TYPED := dpcourse/comm dpcourse/ddp dpcourse/zero dpcourse/fsdp

test: setup  ## set up, type-check the algorithms, run every test and execute every notebook
	$(PY) -m mypy $(TYPED) && $(PY) -m pytest tests lessons solutions --nbval-lax --nbval-current-env

# On a GPU machine: the GPU tests, every lesson and solution notebook and the demo, each
# on its own, with pass/fail and wall time per item (the rows of docs/hardware.md).
test-gpu: setup  ## run the course item by item on this machine's GPUs; writes hardware.json
	$(PY) tests/hardware_matrix.py --out hardware.json

# Without a GPU: compile lesson 12's Triton kernels to Triton IR (tests/test_12_kernel_ir.py)
# with the Triton the GPU machines use, unpacked into .cache/ (the CPU build of torch has none).
TRITON ?= triton==3.6.0
TRITON_DIR := .cache/$(subst ==,-,$(TRITON))

$(TRITON_DIR)/triton/__init__.py:
	$(PY) -m pip download -q --no-deps --only-binary=:all: -d $(TRITON_DIR)/wheel '$(TRITON)'
	$(PY) -c 'import glob, sys, zipfile; zipfile.ZipFile(glob.glob(sys.argv[1] + "/wheel/*.whl")[0]).extractall(sys.argv[1])' $(TRITON_DIR)

kernel-ir: setup $(TRITON_DIR)/triton/__init__.py  ## compile the Triton kernels to IR, no GPU needed
	PYTHONPATH=$(TRITON_DIR) $(PY) -m pytest -p no:cacheprovider tests/test_12_kernel_ir.py

demo: setup
	$(VENV)/bin/dpcourse demo

doctor: setup
	$(VENV)/bin/dpcourse doctor

exercises: setup  ## regenerate exercises/ from solutions/ (after editing a solution)
	$(PY) -m dpcourse.grading.make_exercises

clean:
	rm -rf $(VENV) .pytest_cache .cache
