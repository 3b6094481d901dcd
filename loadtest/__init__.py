"""Load generator for OpenAI-compatible servers, tuned to the workloads where KV eviction matters.

`python -m loadtest.run` measures one server; `python -m loadtest.compare` starts vLLM once per
KV policy and runs the same workload against each. See loadtest/README.md.
"""
