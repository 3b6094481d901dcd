"""vLLM's attention backends (`vllm/v1/attention/backends`): the CPU path and the FlexAttention
path with the policies inside them, each with its token-eviction part, the paged-cache layout
and fp8; the step's data they read (the attention context the worker sets, the streaming step
plan, token eviction's step and decode jobs and their compression).
"""
