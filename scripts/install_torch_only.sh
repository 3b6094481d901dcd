#!/usr/bin/env bash
# The third test environment: torch and transformers only, no vLLM (.venv-torch), where the
# self-check's kernel part (`python -m vllm_kvevict.flex.kernel_check`) must run: a GPU box
# with torch but no vLLM can check the portable attention path. About a minute.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="$(pwd)/.venv-torch"
source scripts/pip_env.sh
env_is_current pyproject.toml scripts/install_torch_only.sh scripts/pip_env.sh && exit 0
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
echo "[install] torch + transformers (no vLLM) into .venv-torch ..."
quiet_pip install -q "torch==2.13.0" "transformers>=5.0,<6"
quiet_pip_editable --no-deps -e .
"$VENV/bin/python" -c "import importlib.util as u; assert u.find_spec('vllm') is None, 'vLLM is installed'"
mark_current
echo "[install] torch-only environment done"
