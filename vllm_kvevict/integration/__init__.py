"""Everything that touches vLLM internals lives in this package (and only here)."""
