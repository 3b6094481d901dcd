"""Streaming heads (duo, prulong, streaming): sink + window KV-cache spec and manager in vLLM's pool, the plan of KV-cache groups, each step's read-back plan."""
