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
import re
import sys
import types


def enable() -> None:
    if "vllm" in sys.modules:
        raise RuntimeError("triton_interpreter.enable() must run before vLLM is imported")
    os.environ["TRITON_INTERPRET"] = "1"
    import importlib.metadata

    import triton.backends

    inactive = types.SimpleNamespace(is_active=lambda: False)
    triton.backends.backends.setdefault("cpu", types.SimpleNamespace(driver=inactive))
    if "+cpu" not in importlib.metadata.version("vllm"):
        # A CUDA wheel (vLLM 0.34's engine side, tested here): its CPU platform refuses an x86
        # CPU without Triton, which it finds by exactly one active non-"cpu" driver; the
        # interpreter is that one (it runs the kernels, no driver is ever asked to).
        active = types.SimpleNamespace(is_active=lambda: True)
        triton.backends.backends.setdefault("interpreter", types.SimpleNamespace(driver=active))


# A server on the V2 runner: every process it starts (engine cores, tensor-parallel workers,
# data-parallel replicas: spawned, each importing vLLM afresh) enables the interpreter first,
# through `v2_site/sitecustomize.py`.
SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "v2_site")


def server_env() -> dict[str, str]:
    return {"VLLM_USE_V2_MODEL_RUNNER": "1", "KVEVICT_TRITON_INTERPRETER": "1",
            "PYTHONPATH": os.pathsep.join(p for p in (SITE, os.environ.get("PYTHONPATH"))
                                          if p)}


def runners_in(log: str) -> tuple[int, int]:
    """(V2, V1) model runners that logged loading the model in a server's log: V2's load line,
    V1's CPU runner's "Starting to load model" (vLLM logs it from a tensor-parallel group's
    first rank only: one per engine core)."""
    return (len(re.findall(r"\[model_runner\.py:\d+\] Loading model from scratch", log)),
            len(re.findall(r"\[cpu_model_runner\.py:\d+\] Starting to load model", log)))


def import_interpreted_triton():
    """Triton for a test module of our kernel: imported in its interpreter when nothing in this
    process imported Triton yet (TRITON_INTERPRET is restored after); a module that found
    Triton imported without it reruns its tests in a fresh process. Skips without Triton."""
    import importlib

    import pytest

    if "triton" not in sys.modules:
        saved = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1"
        try:
            importlib.import_module("triton.language")
        except ImportError:
            pytest.skip("no Triton", allow_module_level=True)
        finally:
            if saved is None:
                del os.environ["TRITON_INTERPRET"]
            else:
                os.environ["TRITON_INTERPRET"] = saved
    return pytest.importorskip("triton")
