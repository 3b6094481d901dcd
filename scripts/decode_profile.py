"""Decode-step profile in one process (`LLM` class, no server): the time of every decode-only
step (`execute_model`) and of each part of the attention (our backend's methods, timed by
wrapping them), per step. prulong 0.7 on the bundled model by default.

    python scripts/decode_profile.py BATCH PROMPT_TOKENS NEW_TOKENS [--policy stock|prulong:0.7]
        [--block-size 128] [--full-block-size 128] [--prefix-caching] [--linear] [--repeat 3] [--cprofile FILE]
                                                                      # e.g. 8 2000 40
Set OMP_NUM_THREADS=1 to time one thread, as a served engine with
VLLM_CPU_NUM_OF_RESERVED_CPU=1 runs on this two-core machine.
"""
import argparse
import collections
import os
import time

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
ap = argparse.ArgumentParser()
ap.add_argument("batch", type=int); ap.add_argument("prompt_tokens", type=int); ap.add_argument("new_tokens", type=int)
ap.add_argument("--policy", default="prulong:0.7"); ap.add_argument("--block-size", type=int, default=128)
ap.add_argument("--prefix-caching", action="store_true")
ap.add_argument("--kv-cache-dtype", default="auto", help="e.g. fp8 (vLLM's --kv-cache-dtype)")
ap.add_argument("--full-block-size", type=int, help="a head mask's full heads in blocks of this many tokens (--kv-full-block-size)")
ap.add_argument("--cprofile", metavar="FILE", help="also cProfile the decode steps' engine steps into FILE")
ap.add_argument("--linear", action="store_true", help="also time vLLM's linear layers (the weights' products)")
ap.add_argument("--repeat", type=int, default=1, help="generate this many times in one process, a report each")
ap.add_argument("--per-group", action="store_true", help="vLLM's per-group scheduling path (no quiet steps, kv_cache_coordinator.py)")
args = ap.parse_args()
B, N, S = args.batch, args.prompt_tokens, args.new_tokens
name, _, sparsity = args.policy.partition(":")
extra = {} if name == "stock" else {"additional_config": {"kv_policy": {"policy": name, **({"sparsity": float(sparsity)} if sparsity else {}), **({"full_block_size": args.full_block_size} if args.full_block_size else {})}}}
if name == "stock":
    os.environ["VLLM_PLUGINS"] = "no-such-plugin"  # (set before vLLM loads its plugins)
import vllm_kvevict.integration.attention.backend as be
from vllm_kvevict.integration.core.kvevict_scheduler import KVEvictScheduler

KVEvictScheduler.quiet_steps = not args.per_group

T = collections.defaultdict(float); C = collections.Counter(); ON = [False]
def wrap(owner, name, label):
    f = getattr(owner, name)
    def w(*a, **k):
        if not ON[0]: return f(*a, **k)
        t = time.perf_counter(); r = f(*a, **k); T[label] += time.perf_counter() - t; C[label] += 1; return r
    setattr(owner, name, w)
I = be.KVEvictAttentionImpl
wrap(I, "forward", "forward"); wrap(I, "_kernel", "kernel"); wrap(I, "_streaming", "streaming")
wrap(I, "do_kv_cache_update", "kv_update")
wrap(be, "decode_window", "decode_window"); wrap(be, "decode_attention", "decode_attention")
wrap(be, "decode_in_place", "decode_in_place")
wrap(be.KVEvictMetadataBuilder, "build", "meta_build")
import vllm.v1.attention.backends.cpu_attn as cpu_attn

wrap(cpu_attn.CPUAttentionBackendImpl, "forward", "vllm_forward")  # (stock; a head mask's all-full layers)
import vllm.model_executor.layers.attention.attention as attention_layer

wrap(attention_layer.Attention, "forward", "attention_layer")  # everything a layer does for attention
import cProfile

# the engine core's whole step and the scheduler's part of it (plugin: our scheduler and managers)
import vllm.v1.engine.core as core

PROF = cProfile.Profile() if args.cprofile else None
E = {"step": 0.0, "schedule": 0.0, "update": 0.0}
orig_step = core.EngineCore.step
def timed(sched, name):
    f = getattr(sched, name)
    def w(*a, **k):
        t = time.perf_counter(); r = f(*a, **k); E.setdefault("_" + name, 0.0); E["_" + name] = time.perf_counter() - t; return r
    setattr(sched, name, w)
def step(self):
    if not getattr(self.scheduler, "_timed", False):
        timed(self.scheduler, "schedule"); timed(self.scheduler, "update_from_output"); self.scheduler._timed = True
    n0 = steps["n"]
    if PROF is not None and steps["n"] > 0: PROF.enable()  # (a decode step follows a decode step)
    t = time.perf_counter(); r = orig_step(self)
    if PROF is not None: PROF.disable()
    if steps["n"] > n0:
        E["step"] += time.perf_counter() - t; E["schedule"] += E["_schedule"]; E["update"] += E["_update_from_output"]
    return r
core.EngineCore.step = step
if args.linear:
    import vllm.model_executor.layers.linear as linear
    for cls in (linear.QKVParallelLinear, linear.RowParallelLinear, linear.MergedColumnParallelLinear):
        def timed_linear(f):
            def w(self, *a, **k):
                if not ON[0]: return f(self, *a, **k)
                t = time.perf_counter(); r = f(self, *a, **k)
                label = "mm_" + self.prefix.split(".")[-1]; T[label] += time.perf_counter() - t; C[label] += 1
                return r
            return w
        cls.forward = timed_linear(cls.forward)
from vllm import LLM, SamplingParams

from vllm_kvevict.model import ensure_bundled_model

llm = LLM(model=str(ensure_bundled_model()), enforce_eager=True, dtype="float32", max_model_len=8192,
          kv_cache_memory_bytes=2 << 30, seed=0, max_num_batched_tokens=8192, skip_tokenizer_init=True,
          enable_prefix_caching=args.prefix_caching, max_num_seqs=B, block_size=args.block_size,
          kv_cache_dtype=args.kv_cache_dtype, **extra)
import vllm.v1.worker.cpu_model_runner as cmr

Runner = cmr.CPUModelRunner
orig = Runner.execute_model
steps = {"n": 0, "t": 0.0}
def ex(self, scheduler_output, *a, **k):
    decode = scheduler_output.total_num_scheduled_tokens == len(scheduler_output.num_scheduled_tokens) and not scheduler_output.scheduled_new_reqs
    ON[0] = decode
    t = time.perf_counter(); r = orig(self, scheduler_output, *a, **k)
    if decode: steps["n"] += 1; steps["t"] += time.perf_counter() - t
    ON[0] = False
    return r
Runner.execute_model = ex
prompts = [{"prompt_token_ids": [100 + (j * 7 + i) % 5000 for j in range(N)]} for i in range(B)]
for rep in range(args.repeat):
    T.clear(); C.clear(); E.update(step=0.0, schedule=0.0, update=0.0); steps.update(n=0, t=0.0)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=S, ignore_eos=True, detokenize=False), use_tqdm=False)
    n = steps["n"]
    print(f"RESULT {args.policy}{' per-group' if args.per_group else ''} bs={args.block_size} full_bs={args.full_block_size} {args.kv_cache_dtype} pc={args.prefix_caching} B={B} N={N} decode steps {n}: execute_model {steps['t']/n*1000:.1f} ms/step")
    print(f"RESULT   engine step {E['step']/n*1000:.1f} ms/step: schedule {E['schedule']/n*1000:.2f}, update_from_output {E['update']/n*1000:.2f}")
    for k, v in sorted(T.items(), key=lambda x: -x[1]):
        print(f"RESULT   {k:18s} {v/n*1000:7.2f} ms/step  ({C[k]//n} calls/step)")
if PROF is not None:
    PROF.dump_stats(args.cprofile)
