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

.PHONY: install install-all install-vllm033 install-vllm034 install-torch-only model serve test test-fast \
	test-vllm033 test-vllm034 test-kernels test-all
install:
	@bash scripts/install.sh

# all four environments, two installs at a time (scripts/install_all.sh)
install-all:
	@bash scripts/install_all.sh

# the engine-side test environments: vLLM 0.33.0's and 0.34.0's Python, CPU torch
# (scripts/install_vllm_engine.sh)
install-vllm033:
	@bash scripts/install_vllm_engine.sh 0.33.0

install-vllm034:
	@bash scripts/install_vllm_engine.sh 0.34.0

# the third: torch and transformers only (scripts/install_torch_only.sh)
install-torch-only:
	@bash scripts/install_torch_only.sh

model: install
	@$(PY) -m vllm_kvevict.model >/dev/null

# Runs: vllm serve ~/.cache/vllm-kvevict/models/SmolLM2-135M-Instruct --kv-policy prulong ...
serve: model
	.venv/bin/vllm serve "$$($(PY) -m vllm_kvevict.model)" --kv-policy $(POLICY) \
		--kv-sparsity $(SPARSITY) $(SERVE_FLAGS)

# Two pytest-xdist workers, each pinned with its servers to one core (tests/conftest.py), then
# the tests marked `serial` (tensor parallelism: a rank per core) alone. Both parts must pass.
WORKERS ?= 2
PARALLEL := -n $(WORKERS) --dist loadfile --no-loadscope-reorder

# Then the tests that need no served model again, in the vLLM 0.33 and 0.34 environments
# (test-vllm033, test-vllm034), and the kernel check in an environment without vLLM.
test: install-all model
	$(PY) -m pytest -q $(PARALLEL) -m "not slow and not serial" --durations=40; a=$$?; \
	$(PY) -m pytest -q -m "serial and not slow" --durations=10; b=$$?; \
	$(MAKE) --no-print-directory test-vllm033; c=$$?; \
	$(MAKE) --no-print-directory test-vllm034; e=$$?; \
	$(MAKE) --no-print-directory test-kernels; d=$$?; \
	echo "[test] parallel part exited $$a, serial part $$b, vLLM 0.33 part $$c, vLLM 0.34 part $$e, no-vLLM kernel part $$d"; \
	[ $$a -eq 0 ] && [ $$b -eq 0 ] && [ $$c -eq 0 ] && [ $$e -eq 0 ] && [ $$d -eq 0 ]

# vLLM 0.33 and 0.34: KV-cache specs and managers, scheduler side, ledger, stats, contract tests
# (tests marked served_release or server need 0.32's CPU ops or a served model: skipped there)
# (the files that import vLLM; the rest is plain Python, the same under either release)
PY033 := .venv-vllm033/bin/python
VLLM033_TESTS := $(addprefix tests/test_,vllm_contract.py sink_window.py selfcheck.py \
	eviction_bookkeeping.py token_prefix_cache.py kv_stats_unit.py scheduler_class.py config_cli.py features.py \
	fp8.py hybrid.py install.py layout.py speculative.py tensor_parallel.py contract_report.py)
test-vllm033: model install-vllm033
	VLLM_TARGET_DEVICE=cpu $(PY033) -m pytest -q $(PARALLEL) \
		-m "not slow and not serial and not server and not served_release" $(VLLM033_TESTS)

# vLLM 0.34's CPU platform wants Triton on x86 (PyPI has no triton-cpu): every process of the
# run executes Triton in its interpreter (tests/triton_interpreter.py, through tests/v2_site)
test-vllm034: model install-vllm034
	VLLM_TARGET_DEVICE=cpu KVEVICT_TRITON_INTERPRETER=1 PYTHONPATH=tests/v2_site \
		.venv-vllm034/bin/python -m pytest -q $(PARALLEL) \
		-m "not slow and not serial and not server and not served_release" $(VLLM033_TESTS)

# The self-check's kernel part where vLLM is not installed (eager: the compiled kernels are
# checked in .venv by tests/test_flex_kernel.py), then the GPU check at CPU sizes: every
# policy's attention against the reference, the trainer's bounded run, the timing table
# (~25 s here; `--device cuda` on a GPU box, docs/gpu_check.md)
test-kernels: install-torch-only
	.venv-torch/bin/python -m vllm_kvevict.flex.kernel_check --eager
	.venv-torch/bin/python -W ignore::UserWarning -m vllm_kvevict.gpu_check --device cpu

# the developers' tier: no server, ~3.5 minutes here on two workers (the full suite starts vllm serve ~34x)
test-fast: model
	$(PY) -m pytest -q $(PARALLEL) -m "not server and not slow"

test-all: model
	$(PY) -m pytest -q $(PARALLEL) -m "not serial"; a=$$?; \
	$(PY) -m pytest -q -m "serial"; b=$$?; [ $$a -eq 0 ] && [ $$b -eq 0 ]
