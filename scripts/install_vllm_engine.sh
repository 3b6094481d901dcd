#!/usr/bin/env bash
# An engine-side test environment: vLLM VERSION's Python with this package, in .venv-vllmXYZ
# (`bash scripts/install_vllm_engine.sh 0.33.0` -> .venv-vllm033; 0.34.0 -> .venv-vllm034).
# `make test` runs the tests that need no served model there: the engine side (KV-cache specs and
# managers, our scheduler, the ledger, stats) and the contract tests, against that release's real
# classes (VLLM_TARGET_DEVICE=cpu: its engine configs need a target device).
#
# Not vLLM's full dependency set: 0.33's CUDA wheel pins torch 2.14.0, a CUDA build that with
# its NVIDIA libraries and GPU kernels (flashinfer, CUTLASS DSL, tilelang, ...) made this
# environment 9.5 GB, and a CI machine ran out of disk installing it (stop 59). Here vLLM's wheel
# comes without its dependencies, then every dependency it declares except the GPU-only ones,
# with the CPU torch 2.13.0 that .venv runs (its file lies on this kind of machine's disk). The
# code under test is vLLM's Python; its compiled CUDA ops are never called here. About 3 GB.
set -euo pipefail
VERSION=${1:?usage: install_vllm_engine.sh VERSION (0.33.0, 0.34.0)}
cd "$(dirname "$0")/.."
NAME=".venv-vllm$(echo "$VERSION" | cut -d. -f1,2 | tr -d .)"  # 0.34.0 -> .venv-vllm034
VENV="$(pwd)/$NAME"
source scripts/pip_env.sh
env_is_current pyproject.toml scripts/install_vllm_engine.sh scripts/pip_env.sh && exit 0
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
echo "[install] vLLM $VERSION (engine-side test environment, CPU torch) into $NAME ..."
quiet_pip install -q "torch==2.13.0"
quiet_pip install -q --no-deps "vllm==$VERSION"
quiet_pip install -q packaging
# vLLM's declared dependencies minus the torch builds and GPU kernels (names as in its METADATA)
"$VENV/bin/python" - > "$VENV/.kvevict-deps.txt" <<'PY'
import re
from importlib.metadata import requires
from packaging.requirements import Requirement
gpu = re.compile(r"^(torch|torchaudio|torchvision|torchcodec|pynvvideocodec|flashinfer-python|"
                 r"apache-tvm-ffi|tilelang|nvidia-.*|nvtx|fastsafetensors|instanttensor|"
                 r"quack-kernels|tokenspeed-mla|humming-kernels)$")
for line in requires("vllm"):
    req = Requirement(line)
    name = re.sub(r"[-_.]+", "-", req.name).lower()
    if gpu.match(name) or (req.marker and not req.marker.evaluate({"extra": ""})):
        continue
    print(line.split(";")[0])
PY
quiet_pip install -q -r "$VENV/.kvevict-deps.txt" "torch==2.13.0"
echo "[install] (pip's 'vllm $VERSION requires ...' lines name the GPU dependencies left out on purpose)"
quiet_pip_editable -e ".[dev]"  # the project's dependencies beside vLLM's, without the cpu extra
VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" -c "import vllm; assert vllm.__version__.startswith('$VERSION'), vllm.__version__"
mark_current
echo "[install] vLLM $VERSION done"
