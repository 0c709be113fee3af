# Two entry points, each bootstraps its own environment:
#   make run   [PROFILE=cpu|gpu|auto]  -> every notebook on PROFILE, graded, scoreboard printed
#   make test                          -> the whole test suite (what CI runs)
PYTHON ?= python3
VENV   ?= .venv
PROFILE ?= cpu
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: run test install clean-outputs

$(STAMP): pyproject.toml requirements-cpu.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c requirements-cpu.txt torch triton
	$(PY) -m pip install -q -c requirements-cpu.txt -e '.[kernels,notebooks,test]'
	$(PY) -m ipykernel install --sys-prefix --name python3 >/dev/null
	@touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	TQDM_DISABLE=$${TQDM_DISABLE:-0} $(VENV)/bin/lora-lab run --profile $(PROFILE)
	$(VENV)/bin/lora-lab grade --profile $(PROFILE)

test: $(STAMP)
	$(PY) -m pytest -q
