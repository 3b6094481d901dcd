# The two commands a newcomer needs: `make serve` and `make test`. Each installs what it needs.
PY := .venv/bin/python
PORT ?= 8000
POLICY ?= prulong
SPARSITY ?= 0.7
CHUNK ?= 1024
KV_POOL_BYTES ?= 2147483648
SERVE_FLAGS ?= --served-model-name smollm2 --dtype float32 \
	--host 127.0.0.1 --port $(PORT) --max-num-batched-tokens $(CHUNK) \
	--kv-cache-memory-bytes $(KV_POOL_BYTES)

.PHONY: install model serve test test-fast test-all
install:
	@bash scripts/install.sh

model: install
	@$(PY) -m vllm_kvevict.model >/dev/null

# Runs: vllm serve ~/.cache/vllm-kvevict/models/SmolLM2-135M-Instruct --kv-policy prulong ...
serve: model
	.venv/bin/vllm serve "$$($(PY) -m vllm_kvevict.model)" --kv-policy $(POLICY) \
		--kv-sparsity $(SPARSITY) $(SERVE_FLAGS)

test: model
	$(PY) -m pytest -q --durations=40

# the developers' tier: no server, 2-3 minutes here (the full suite starts vllm serve ~35x)
test-fast: model
	$(PY) -m pytest -q -m "not server and not slow"

test-all: model
	$(PY) -m pytest -q -m ""
