"""Compile the head-pages kernels for a CUDA target without a GPU (Triton's front end, LLVM and
its bundled ptxas), to catch what the interpreter does not check: types, shapes, `tl.dot`
operands, shared memory. Prints one line a variant; exit 1 if one fails.

    python -m vllm_kvevict.kernels.compile_check [--arch 90] [--quick]

Run it in a process where TRITON_INTERPRET is unset before Triton is first imported (Triton's
library is jitted for the interpreter otherwise, and nothing then compiles).
"""

from __future__ import annotations

import argparse
import os
import sys

from vllm_kvevict.kernels import head_pages

# (q dtype, kv dtype, group, BLOCK_Q, splits): decode (split) and prefill tiles, each dtype
VARIANTS = [("bf16", "bf16", 4, 4, 16), ("bf16", "bf16", 4, 16, 1), ("fp16", "fp16", 4, 16, 1),
            ("fp32", "fp32", 4, 4, 8), ("bf16", "fp8e4nv", 4, 4, 16), ("bf16", "bf16", 1, 64, 1)]
QUICK = [VARIANTS[0], VARIANTS[3]]


def _signature(fn, q: str, kv: str, splits: int) -> dict[str, str]:
    sig = {}
    for n in fn.arg_names:
        if n in ("Q", "OUT"):
            sig[n] = f"*{q}"
        elif n in ("K", "V"):
            sig[n] = f"*{kv}"
        elif n in ("TBL", "LENS", "KIND", "QSL", "CS"):
            sig[n] = "*i32"
        elif n in ("ACC", "MAXS", "SUMS"):
            sig[n] = "*fp32" if splits > 1 else f"*{q}"
        elif n in ("KSCALE", "VSCALE"):
            sig[n] = "*fp32"
        elif n == "qk_scale":
            sig[n] = "fp32"
        else:
            sig[n] = "constexpr" if n.isupper() else "i32"
    return sig


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", type=int, default=90, help="CUDA compute capability (90: H100/H200)")
    p.add_argument("--quick", action="store_true", help="two variants and the combine kernel")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("compile_check: unset TRITON_INTERPRET", file=sys.stderr)
        return 2
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fwd, combine = head_pages._kernels()
    target, failed = GPUTarget("cuda", args.arch, 32), 0
    for q, kv, group, block_q, splits in QUICK if args.quick else VARIANTS:
        const = dict(PAGE_SIZE=16, GROUP=group, GROUP_P2=group, BLOCK_Q=block_q, BLOCK_N=64,
                     HEAD_DIM=128, HEAD_DIM_P2=128, NUM_SPLITS=splits,
                     IS_FP8=kv.startswith("fp8"), DOT_PREC="ieee" if q == "fp32" else "tf32",
                     DOT_F32=False, HAS_CS=splits == 1)  # (both branches compiled)
        name = f"fwd q={q} kv={kv} group={group} block_q={block_q} splits={splits}"
        try:
            k = triton.compile(ASTSource(fwd, _signature(fwd, q, kv, splits), const),
                               target=target)
            print(f"{name}: ok, {k.metadata.shared} B shared memory", flush=True)
        except Exception as exc:  # report every variant
            failed += 1
            print(f"{name}: FAILED {type(exc).__name__}: {exc}", flush=True)
    sig = {n: "*fp32" if n in ("ACC", "MAXS", "SUMS") else "*bf16" if n == "OUT" else
           "constexpr" if n.isupper() else "i32" for n in combine.arg_names}
    try:
        triton.compile(ASTSource(combine, sig, dict(NUM_SPLITS=16, HEAD_DIM=128,
                                                    HEAD_DIM_P2=128)), target=target)
        print("combine splits=16: ok", flush=True)
    except Exception as exc:
        failed += 1
        print(f"combine: FAILED {type(exc).__name__}: {exc}", flush=True)
    print(f"triton {triton.__version__}, sm_{args.arch}: {'all ok' if not failed else failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
