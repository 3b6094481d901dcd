"""vLLM's worker (`vllm/v1/worker`): the Worker subclass and the per-process state it builds and
sets as the attention context, views of either model runner, question rows, seeded sampling,
head order under TP, the step planners and token eviction's per-request ledgers.
"""
