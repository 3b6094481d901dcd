#!/usr/bin/env bash
# Every test environment `make test` needs, installed two at a time: .venv beside the chain of
# the extra ones (vLLM 0.33, vLLM 0.34, torch alone). pip spends most of an install unpacking
# on one core; two cores run two. Each script is idempotent (its stamp), so a second run is a
# second or so. The editable installs write vllm_kvevict.egg-info in the checkout: one at a
# time (scripts/pip_env.sh's lock).
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh & main=$!
( bash scripts/install_vllm_engine.sh 0.33.0 && bash scripts/install_vllm_engine.sh 0.34.0 \
  && bash scripts/install_torch_only.sh ) & extra=$!
wait $main; a=$?
wait $extra; b=$?
[ $a -eq 0 ] || echo "[install] .venv failed (exit $a)" >&2
[ $b -eq 0 ] || echo "[install] the vLLM 0.33 / 0.34 / torch-only environments failed (exit $b)" >&2
[ $a -eq 0 ] && [ $b -eq 0 ]
