"""The self-check a user runs first on their own vLLM, device and dtype:

    python -m vllm_kvevict.selfcheck                      # tiny random model, every policy
    python -m vllm_kvevict.selfcheck --real-model         # the model itself (--model)

It serves the policy matrix through vLLM's offline `LLM` class (one engine per policy cell, in
its own process), runs the independent plain-PyTorch reference on the same device and dtype,
prints the comparison, and, when every cell is exact, records a pass for (plugin version, vLLM
version, platform, device, dtype) under `records.record_dir()`. On a platform or vLLM release
outside the supported list, the plugin activates only where such a pass exists
(`integration/plugins/registration.py`); the refusal names this command.

`kernels` (`vllm_kvevict.flex.kernel_check`) is the part that needs no vLLM at all.
"""
