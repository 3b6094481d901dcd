#!/usr/bin/env bash
# The 1,000-request soaks (docs/results/soak/) on this checkout's commit: the single-core
# mechanisms two at a time (one per core), then data-parallel alone (both cores) with
# SOAK_DP=1. Run it in a clone frozen at the commit (the servers load this tree's code).
# Resumable: a mechanism whose JSON already names this commit is skipped.
#   SOAK_MECHANISMS="head-mask token-prefix" bash scripts/soak_all.sh
set -u
cd "$(dirname "$0")/.."
commit=$(git rev-parse --short HEAD)
todo=()
for m in ${SOAK_MECHANISMS:-head-mask token-eviction hybrid token-prefix decode-eviction preemption flex}; do
  grep -q "\"commit\": \"$commit\"" "docs/results/soak/$m.json" 2>/dev/null || todo+=("$m")
done
echo "[soak] $(date +%T) $commit todo: ${todo[*]:-nothing}"
if [ ${#todo[@]} -gt 0 ]; then
  k=$(printf ' or %s' "${todo[@]}" | sed 's/^ or //')
  KVEVICT_WRITE_SOAK=1 .venv/bin/python -m pytest -n 2 --maxschedchunk 1 -m slow -q \
    -p no:cacheprovider tests/test_reliability.py -k "test_long_soak and ($k)"
fi
if [ "${SOAK_DP:-0}" = 1 ] && ! grep -q "\"commit\": \"$commit\"" docs/results/soak/data-parallel.json; then
  KVEVICT_WRITE_SOAK=1 .venv/bin/python -m pytest -m slow -q -p no:cacheprovider \
    tests/test_reliability.py -k "test_long_soak and data-parallel"
fi
.venv/bin/python -m loadtest.soak --report docs/results/soak > docs/results/soak/table.md
echo "[soak] $(date +%T) done"
