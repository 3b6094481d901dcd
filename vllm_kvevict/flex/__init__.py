# compilations of the compiled flex_attention a worker allows (vLLM's module sets 16; a head mask
# calls it with each layer's count of full and of streaming heads, each its own compilation)
FLEX_RECOMPILE_LIMIT = 64
