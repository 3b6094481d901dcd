#!/usr/bin/env bash
# The second test environment: vLLM 0.33.0 (its CUDA wheel, which installs and imports on a
# CPU-only machine; engine configs need VLLM_TARGET_DEVICE=cpu) with this package, in
# .venv-vllm033. `make test` runs the tests that need no served model there: the engine side
# (KV-cache specs and managers, our scheduler, the ledger, stats) and the contract tests,
# against 0.33's real classes. About 4.5 minutes and 9.5 GB the first time; idempotent after.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="$(pwd)/.venv-vllm033"
source scripts/pip_env.sh
env_is_current pyproject.toml scripts/install_vllm033.sh scripts/pip_env.sh && exit 0
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
echo "[install] vLLM 0.33.0 (second test environment) into .venv-vllm033 ..."
quiet_pip install -q "vllm==0.33.0"
quiet_pip install -q -e ".[dev]"  # the project's dependencies beside vLLM's, without the cpu extra
VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" -c "import vllm; assert vllm.__version__.startswith('0.33.0'), vllm.__version__"
mark_current
echo "[install] vLLM 0.33.0 done"
