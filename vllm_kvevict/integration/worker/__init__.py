"""vLLM's worker (`vllm/v1/worker`): the Worker subclass and the per-process state it hands down,
views of either model runner, question rows, seeded sampling, head order under TP, the step
planners of streaming heads and token eviction, decode-time eviction.
"""
