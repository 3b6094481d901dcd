"""Attention kernels of our own (Triton), standalone: `head_pages.py` is paged attention over
each (request, KV head)'s own page list, with full, streaming and compacted heads in one launch
(design: docs/kernels.md). Nothing here imports vLLM; Triton is imported by `head_pages`."""
