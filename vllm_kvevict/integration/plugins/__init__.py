"""How vLLM loads the plugin (`vllm/plugins`): the entry point that applies our wraps, the contract
(every vLLM name we wrap, rely on or touch) and its report, the classes installed into the
engine config, where the plugin serves (releases, platforms).
"""
