# The two commands users type: `make demo` and `make test`. Each installs what is missing first.
PYTHON ?= python3
STAMP := .cache/deps-installed

.PHONY: deps demo test test-fast test-triton test-torch gpu-check clean

# Torch is never replaced when one is importable (a GPU machine keeps its CUDA build); a machine
# without one gets the CPU build 2.13.0, never the multi-GB CUDA wheels. Triton is pinned to the
# GPU machine's 3.6 when absent so the interpreter tests see the same language.
$(STAMP): setup.py
	@mkdir -p .cache
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install -q torch==2.13.0
	@$(PYTHON) -c "import triton" 2>/dev/null || $(PYTHON) -m pip install -q triton==3.6.0 || echo "triton not installable here; kernels fall back to PyTorch"
	@$(PYTHON) -m pip install -q --no-build-isolation -e ".[dev]"
	@touch $(STAMP)

deps: $(STAMP)

demo: deps
	$(PYTHON) tools/demo.py

# Two pytest workers, each taking whole test files (a file's fixtures and rank pools are built once). About a
# third of the suite leaves a core idle when run alone (one-process tests, process starts, the Triton
# interpreter); two workers fill it. TEST_WORKERS=0 runs the suite in this process, one test at a time.
TEST_WORKERS ?= 2
PYTEST := $(PYTHON) -m pytest -q $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile)

test: deps
	$(PYTEST) tests

# Skips the cases marked slow; for quick iteration only (CI runs `make test`).
test-fast: deps
	$(PYTEST) -m "not slow" tests

# The kernels in Triton's interpreter under the oldest and the newest Triton setup.py allows (3.6 is torch 2.11's,
# 3.9 the newest); each wheel is fetched once into .cache and put first on the path.
TRITON_VERSIONS := 3.6.0 3.9.0
test-triton: deps
	@for v in $(TRITON_VERSIONS); do \
		[ -d .cache/triton-$$v ] || $(PYTHON) -m pip install -q --no-deps --target .cache/triton-$$v triton==$$v || exit 1; \
		echo "triton $$v:"; PYTHONPATH=.cache/triton-$$v:. $(PYTHON) -m pytest -q tests/test_kernels.py || exit 1; \
	done

# The whole suite under the oldest torch setup.py allows (2.11, the GPU machines' version) and the newest ones, each
# in a venv of its own made once under .cache (a CUDA build from PyPI: ~6 GB each; PIP_CONSTRAINT=/dev/null lifts a
# machine-wide cap on torch's version, where there is one). Not part of `make test`: run it when torch moves.
TORCH_VERSIONS := 2.11.0 2.14.1 2.15.0
test-torch:
	@for v in $(TORCH_VERSIONS); do \
		[ -x .cache/torch-$$v/bin/python ] || { $(PYTHON) -m venv .cache/torch-$$v && \
			PIP_CONSTRAINT=/dev/null .cache/torch-$$v/bin/pip install -q torch==$$v wheel && \
			PIP_CONSTRAINT=/dev/null .cache/torch-$$v/bin/pip install -q --no-build-isolation -e ".[dev]"; } || exit 1; \
		echo "torch $$v:"; .cache/torch-$$v/bin/python -m pytest -q -n 2 --dist loadfile tests || exit 1; \
	done

# The prepared GPU check (issue 31): installs nothing, since a lent GPU machine reaches no registry; needs torch
# (CUDA build), triton and transformers. GPU_CHECK_ARGS passes options, e.g. "--quick" or "--device cpu --dry-run".
gpu-check:
	PYTHONPATH=. $(PYTHON) -m benchmarks.gpu_check $(GPU_CHECK_ARGS)

clean:
	rm -rf .cache runs demo_out build *.egg-info
