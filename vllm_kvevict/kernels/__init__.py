"""Attention kernels of our own (Triton), standalone: `head_pages.py` is paged attention over
each (request, KV head)'s own page list, with full, streaming and compacted heads in one launch
(design: docs/kernels.md). Nothing here imports vLLM; Triton is imported on first use."""

__all__ = ["head_pages_attention"]


def __getattr__(name):
    if name == "head_pages_attention":
        from vllm_kvevict.kernels.head_pages import head_pages_attention
        return head_pages_attention
    raise AttributeError(name)
