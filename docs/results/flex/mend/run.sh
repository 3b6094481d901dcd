#!/bin/bash
# A/B of the flex hot-path mend: before (cff8fa5), after (the checkout: c729ffd and later), core 0
cd /work/main
export VLLM_CPU_OMP_THREADS_BIND=0
for side in before after before after; do
  if [ $side = before ]; then export PYTHONPATH=/work/abfix:/work/before; S=/work/before/scripts/flex_timing.py; else unset PYTHONPATH; S=scripts/flex_timing.py; fi
  echo "== $side $(date +%T)"
  taskset -c 0 .venv/bin/python $S --policies prulong snapkv --paths flex --prompt-tokens 2000 --repeats 3 --port 8731 --out /work/soaklogs/flex_ab_$side-$(date +%H%M%S).json
done
echo "== done $(date +%T)"
