# Sourced by the install scripts of the extra test environments: a venv at $VENV, skipped when
# its stamp matches the install inputs (`env_is_current FILE...`), and pip without the noise of
# this machine's empty local indexes (`quiet_pip ARGS...`).
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
STAMP="$VENV/.kvevict-install-stamp"

env_is_current() {
  want=$(cat "$@" | sha256sum | cut -d' ' -f1)
  [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]
}

quiet_pip() {
  "$VENV/bin/pip" "$@" 2>&1 | grep -v -E "is ignored: it is neither a file nor a directory|^$" || true
  return "${PIPESTATUS[0]}"
}

# `pip install -e .` writes vllm_kvevict.egg-info in the checkout: one install at a time
# (scripts/install_all.sh runs two environments' installs at once)
quiet_pip_editable() {
  ( flock 9; quiet_pip install -q "$@" ) 9>"$(pwd)/.install.lock"
}

mark_current() {
  echo "$want" > "$STAMP"
}
