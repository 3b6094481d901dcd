"""`python -m vllm_kvevict.gpu_check`: every policy's attention path against the reference and
timed against dense attention, torch and transformers only (no vLLM); see `__main__.py`."""
