# Two entry points, each bootstraps its own environment:
#   make run   [PROFILE=cpu|gpu|auto]  -> every notebook on PROFILE, graded, scoreboard printed
#   make test                          -> the whole test suite (what CI runs)
PYTHON ?= python3
PROFILE ?= cpu
# The cpu route pins the CPU build of torch (seconds to install, no CUDA download). The gpu route
# uses its own venv that sees the machine's own (CUDA) torch/triton through --system-site-packages,
# and installs only what is missing, within pyproject.toml's ranges.
ifeq ($(PROFILE),gpu)
VENV   ?= .venv-gpu
VENV_FLAGS := --system-site-packages
PINS   :=
else
VENV   ?= .venv
VENV_FLAGS :=
PINS   := -c requirements-cpu.txt
endif
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: run test install

$(STAMP): pyproject.toml requirements-cpu.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(if $(PINS),$(PY) -m pip install -q $(PINS) torch triton)
	$(PY) -m pip install -q $(PINS) -e '.[kernels,notebooks,test]'
	$(PY) -m ipykernel install --sys-prefix --name python3 >/dev/null
	@touch $(STAMP)

install: $(STAMP)

TEST_OUT := $(CURDIR)/build/test-outputs

# make run: execute every notebook on PROFILE into outputs/<profile>/, then grade (grading happens
# even when a notebook failed; the exit code still reports the failure).
run: $(STAMP)
	TQDM_DISABLE=$${TQDM_DISABLE:-0} $(VENV)/bin/lora-lab run --profile $(PROFILE); run_status=$$?; \
	$(VENV)/bin/lora-lab grade --profile $(PROFILE) && exit $$run_status

# make test: unit tests, the papermill cpu run of every notebook (into build/, leaving the committed
# outputs alone), grading, the pre-registration history check, and nbval over notebooks/.
test: $(STAMP)
	$(PY) -m pytest -q
	TQDM_DISABLE=1 $(VENV)/bin/lora-lab run --profile cpu --outputs-dir $(TEST_OUT); run_status=$$?; \
	$(VENV)/bin/lora-lab grade --profile cpu --outputs-dir $(TEST_OUT) && exit $$run_status
	$(VENV)/bin/lora-lab verify
	@if ls notebooks/*.ipynb >/dev/null 2>&1; then \
	  LORA_LAB_OUTPUT_DIR=$(CURDIR)/build/nbval-outputs TRITON_INTERPRET=1 TQDM_DISABLE=1 \
	  $(PY) -m pytest --nbval-lax --nbval-current-env -p no:cacheprovider notebooks/; \
	else echo "nbval: no notebooks yet"; fi
