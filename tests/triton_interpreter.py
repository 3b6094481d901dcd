"""vLLM's V2 model runner on this CPU, for tests: its input-preparation kernels are Triton
kernels, and this machine has no Triton CPU backend (PyPI has no `triton-cpu`), so they run in
Triton's own interpreter (`TRITON_INTERPRET=1`: the same kernels, executed in Python).

vLLM 0.32's CPU build turns Triton off unless Triton lists a backend named "cpu"
(`vllm/triton_utils/importing.py`); the interpreter needs no backend driver, so an entry
whose driver says it is not active (so torch's compiler still generates C++ for the
CPU, as without Triton) is listed. Call `enable()` before anything imports vLLM, in a process of its own.
With Triton on, vLLM 0.32 picks the V2 runner by default (`VllmConfig.use_v2_model_runner`);
`VLLM_USE_V2_MODEL_RUNNER=0` keeps V1."""

import os
import sys
import types


def enable() -> None:
    if "vllm" in sys.modules:
        raise RuntimeError("triton_interpreter.enable() must run before vLLM is imported")
    os.environ["TRITON_INTERPRET"] = "1"
    import triton.backends

    inactive = types.SimpleNamespace(is_active=lambda: False)
    triton.backends.backends.setdefault("cpu", types.SimpleNamespace(driver=inactive))
