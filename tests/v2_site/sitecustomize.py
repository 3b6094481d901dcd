"""Test harness only: put this directory on PYTHONPATH with KVEVICT_TRITON_INTERPRETER=1 and
every Python process started (a server, its engine cores and workers, spawned) runs vLLM's V2
model runner's Triton kernels in Triton's interpreter (`tests/triton_interpreter.py`)."""

import os
import sys

if os.environ.get("KVEVICT_TRITON_INTERPRETER") == "1":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import triton_interpreter

    triton_interpreter.enable()
