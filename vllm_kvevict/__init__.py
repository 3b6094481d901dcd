"""vllm-kvevict: KV-cache eviction policies (PruLong, DuoAttention, SnapKV, PyramidKV,
StreamingLLM) served inside vLLM, with the KV footprint of "Cache Me If You Can"."""

from vllm_kvevict._version import __version__

__all__ = ["__version__", "register"]


def register() -> None:
    """vLLM general-plugin entry point (kept import-light: it runs in every vLLM process)."""
    # (in here: importing the package must not import vLLM; vLLM calls this in each process)
    from vllm_kvevict.integration.plugins.registration import register as _register

    _register()
