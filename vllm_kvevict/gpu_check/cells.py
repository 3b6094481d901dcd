"""Correctness cells: every policy's checked path (`layer.py`: FlexAttention, per
flex_attention mode; `kernel_path.py`: the head-pages Triton kernel) against the reference, per
dtype, over mixed steps (prefill chunks of two requests of different
prompt lengths, then decode steps; the shorter request decodes while the longer one still
prefills), on random q, k, v over scattered pages.

A cell passes when the largest |checked - reference| over its prefill rows (the chunks and
patched scoring's question rows) and over its decode rows is within the dtype's tolerance and
token eviction kept the same positions per head as the reference.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from vllm_kvevict.config import KVPolicyConfig
from vllm_kvevict.gpu_check import kernel_path
from vllm_kvevict.gpu_check.layer import (PAGE, CheckedLayer, LayerSetup, Row,
                                          compile_counter, kernel, kv_heads_to_q,
                                          reference_step)
from vllm_kvevict.masks import (HeadGates, full_heads_at_sparsity, load_head_gates,
                                resolve_full_heads)
from vllm_kvevict.policies import KVPolicy, build_policy
from vllm_kvevict.reference.attention import EMPTY, LayerKV
from vllm_kvevict.train import data as data_mod
from vllm_kvevict.train.trainer import TrainConfig, Trainer

# model shapes: (layers, KV heads, query heads per KV head, head dim)
LLAMA_8B = (32, 8, 4, 128)
SMOLLM2 = (30, 3, 3, 64)  # the bundled model, whose masks head_masks/ ships
# per dtype: max |checked - reference| / (1 + |reference|); bfloat16's is 2^-6, two of its
# rounding steps (its outputs are rounded once on either side)
# float16 (the kernel's cells): 2^-8, as the kernel's own tests
TOLERANCE = {"float32": 1e-4, "bfloat16": 1.6e-2, "float16": 2.0 ** -8}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PATHS = ("kernel", "flex")  # the checked attention paths: the head-pages kernel, FlexAttention


@dataclass(frozen=True)
class Sizes:
    prompts: tuple[int, ...]
    chunk: int
    decode: int
    sink: int
    window: int
    obs_window: int
    layers: int  # layers checked per policy, evenly spaced from the first to the last


CPU_SIZES = Sizes((80, 50), 32, 2, 4, 16, 8, 2)
CUDA_SIZES = Sizes((2048, 1500), 512, 4, 64, 256, 64, 8)

# name -> (shape, policy settings, mask: "bundled" (served lookup), "random" (seeded gates))
CASES = {
    "full": (LLAMA_8B, {"policy": "full"}, None),
    "streaming": (LLAMA_8B, {"policy": "streaming"}, None),
    "duo-0.5 llama (bundled)": (LLAMA_8B, {"policy": "duo", "sparsity": 0.5}, "bundled"),
    "prulong-0.5 smollm2 (bundled)": (SMOLLM2, {"policy": "prulong", "sparsity": 0.5},
                                      "bundled"),
    "prulong-0.7 smollm2 (bundled)": (SMOLLM2, {"policy": "prulong", "sparsity": 0.7},
                                      "bundled"),
    "prulong-0.5 llama": (LLAMA_8B, {"policy": "prulong", "sparsity": 0.5}, "random"),
    "prulong-0.7 llama": (LLAMA_8B, {"policy": "prulong", "sparsity": 0.7}, "random"),
    "snapkv naive": (LLAMA_8B, {"policy": "snapkv", "eviction": "naive"}, None),
    "snapkv patched": (LLAMA_8B, {"policy": "snapkv", "eviction": "patched"}, None),
    "pyramidkv naive": (LLAMA_8B, {"policy": "pyramidkv", "eviction": "naive"}, None),
    "pyramidkv patched": (LLAMA_8B, {"policy": "pyramidkv", "eviction": "patched"}, None),
    "prulong-0.7 + snapkv patched": (LLAMA_8B, {"policy": "prulong", "sparsity": 0.7,
                                                "token_policy": "snapkv"}, "random"),
    "prulong-0.5 + pyramidkv naive": (LLAMA_8B, {"policy": "prulong", "sparsity": 0.5,
                                                 "token_policy": "pyramidkv",
                                                 "eviction": "naive"}, "random"),
}
MODEL_NAMES = {LLAMA_8B: "Meta-Llama-3.1-8B-Instruct", SMOLLM2: "SmolLM2-135M-Instruct"}


def build_case(name: str, sizes: Sizes) -> tuple[KVPolicy, tuple[int, int, int, int]]:
    """The policy object the server would build (bundled masks resolved as it does; the Llama
    prulong mask: seeded random gates, thresholded as a trained mask is)."""
    shape, raw, mask = CASES[name]
    layers, kv_heads = shape[:2]
    cfg = KVPolicyConfig.from_dict(dict(raw, sink=sizes.sink, window=sizes.window,
                                        obs_window=sizes.obs_window))
    full = None
    if mask == "bundled":
        full, _ = resolve_full_heads(cfg, MODEL_NAMES[shape], layers, kv_heads)
    elif mask == "random":
        gates = torch.rand(layers, kv_heads, generator=torch.Generator().manual_seed(0))
        full = full_heads_at_sparsity(HeadGates(gates), cfg.sparsity)
    return build_policy(cfg, layers, kv_heads, full), shape


def schedule(prompts: tuple[int, ...], chunk: int, decode: int) -> list[list[tuple]]:
    """Per step, (request, start, tokens) of every request still running."""
    steps, pos = [], [0] * len(prompts)
    while any(p < n + decode for p, n in zip(pos, prompts)):
        step = []
        for r, n in enumerate(prompts):
            if pos[r] < n + decode:
                count = min(chunk, n - pos[r]) if pos[r] < n else 1
                step.append((r, pos[r], count))
                pos[r] += count
        steps.append(step)
    return steps


def checked_layers(num_layers: int, count: int) -> list[int]:
    count = max(1, min(count, num_layers))
    return sorted({round(i * (num_layers - 1) / max(count - 1, 1)) for i in range(count)})


def layer_setups(policy: KVPolicy, layer: int, shape, device: str, sizes: Sizes,
                 perturb: bool) -> tuple[LayerSetup, LayerSetup]:
    """(reference's, checked path's) setup of one layer; `perturb`: the checked path serves its
    first streaming head as a full head (a negative control: the cell must fail)."""
    streaming = policy.streaming_heads()[layer].to(device)
    evicting = ~streaming if policy.evicts_tokens else torch.zeros_like(streaming)
    tokens = len(sizes.prompts) * (sizes.chunk + sizes.obs_window)
    capacity = (tokens + (-tokens % 16), 2 * len(sizes.prompts))
    ref = LayerSetup(policy, layer, streaming, evicting, shape[3] ** -0.5, capacity)
    checked = LayerSetup(policy, layer, streaming.clone(), evicting, ref.scale, capacity)
    if perturb and bool(streaming.any()):
        checked.streaming[int(streaming.nonzero()[0])] = False
    return ref, checked


def make_row(r: int, start: int, count: int, sizes: Sizes, policy: KVPolicy, shape,
             gen: torch.Generator, device: str, dtype) -> Row:
    prompt = sizes.prompts[r]
    question = policy.config.question_rows(prompt) if start + count < prompt else 0
    n, (_, kv, group, d) = count + question, shape
    q, k, v = (torch.randn(h, n, d, generator=gen).to(device, dtype)
               for h in (kv * group, kv, kv))
    return Row(r, start, count, prompt, q, k, v, question)


def new_checked(setup: LayerSetup, sizes: Sizes, shape, gen, device: str, dtype) -> CheckedLayer:
    """Empty caches over scattered pages (as vLLM's pool hands them out), room for each
    request's prompt, decode tokens and question rows."""
    pages = [-(-(n + sizes.decode + sizes.obs_window) // PAGE) for n in sizes.prompts]
    perm = torch.randperm(sum(pages) + 3, generator=gen)
    table = torch.zeros(len(pages), max(pages), dtype=torch.int32)
    used = 0
    for r, n in enumerate(pages):
        table[r, :n] = perm[used:used + n].int()
        used += n
    slots = (sum(pages) + 3) * PAGE

    def empty():
        return [torch.zeros(slots, shape[1], shape[3], dtype=dtype, device=device)
                for _ in range(2)]
    evicting = int(setup.evicting.sum())
    return CheckedLayer(setup, table.to(device), empty(), empty(), [0] * len(pages),
                        [torch.zeros(evicting, 0, dtype=torch.long, device=device)
                         for _ in pages])


def simulate_layer(ref_setup: LayerSetup, setup: LayerSetup, sizes: Sizes, shape, run,
                   device: str, dtype, seed: int, new_layer=new_checked) -> dict:
    """The largest error (`_error`) of one layer's steps, prefill and decode rows apart, and
    the (request, head) pairs whose kept positions differ. `new_layer`: the checked path's
    state (`new_checked`: FlexAttention's; `kernel_path.new_kernel_layer`: the kernel's)."""
    gen = torch.Generator().manual_seed(seed)
    checked = new_layer(setup, sizes, shape, gen, device, dtype)
    refs = [LayerKV.empty(shape[1], shape[3], dtype, device) for _ in sizes.prompts]
    worst = {"prefill": 0.0, "decode": 0.0, "kept_mismatch": 0, "ties": 0}
    evict_q = kv_heads_to_q(setup.evicting.nonzero().flatten(), shape[2])
    for step in schedule(sizes.prompts, sizes.chunk, sizes.decode):
        rows = [make_row(*s, sizes, setup.policy, shape, gen, device, dtype) for s in step]
        out, question = checked.step(run, rows)
        first, asked = 0, 0
        for r in rows:
            ref, ties = reference_step(ref_setup, refs[r.index], r,
                                       checked.last_choice.pop(r.index, None))
            worst["ties"] += ties
            kind = "prefill" if r.prefill else "decode"
            diffs = [_error(out[:, first:first + r.count], ref[:, :r.count])]
            if r.question:
                diffs.append(_error(question[:, asked:asked + r.question],
                                    ref[evict_q, r.count:]))
                asked += r.question
            worst[kind] = max([worst[kind]] + diffs)
            worst["kept_mismatch"] += _kept_mismatch(refs[r.index], checked, r.index, setup)
            first += r.count
    return worst


def _error(checked: torch.Tensor, ref: torch.Tensor) -> float:
    """max |checked - ref| / (1 + |ref|) (inf where the checked path is not finite)."""
    checked, ref = checked.float(), ref.float()
    if not bool(torch.isfinite(checked).all()):
        return float("inf")
    return float(((checked - ref).abs() / (1 + ref.abs())).max()) if ref.numel() else 0.0


def _kept_mismatch(ref: LayerKV, checked: CheckedLayer, row: int, setup: LayerSetup) -> int:
    """Evicting heads whose kept positions differ between the reference and the checked path."""
    heads = setup.evicting.nonzero().flatten().tolist()
    bad = 0
    for i, h in enumerate(heads):
        mine = ref.positions[h][ref.positions[h] != EMPTY]
        bad += not torch.equal(mine, torch.sort(checked.kept[row][i]).values)
    return bad


def run_case(name: str, sizes: Sizes, device: str, dtype: str, compiled: bool,
             perturb: bool = False, path: str = "flex", options: dict | None = None) -> dict:
    """One correctness cell: the policy `name` over its checked layers, on the checked `path`
    ("flex": flex_attention, compiled or eager; "kernel": the head-pages Triton kernel with
    `options`, `kernel_path.OPTION_NAMES`)."""
    started = time.perf_counter()
    if path == "kernel" and (problem := kernel_path.interpreter_problem(device)):
        return {"policy": name, "dtype": dtype, "mode": "kernel", "status": problem,
                "passed": None}
    policy, shape = build_case(name, sizes)
    if path == "kernel":
        run, new_layer = kernel_path.kernel_run(device, options), kernel_path.new_kernel_layer
    else:
        run, new_layer = kernel(device, compiled), new_checked
    worst = {"prefill": 0.0, "decode": 0.0, "kept_mismatch": 0, "ties": 0}
    layers = checked_layers(shape[0], sizes.layers)
    compiles = compile_counter() if compiled and path == "flex" else None
    for layer in layers:
        ref, checked = layer_setups(policy, layer, shape, device, sizes, perturb)
        got = simulate_layer(ref, checked, sizes, shape, run, device, DTYPES[dtype], layer,
                             new_layer)
        worst = {k: worst[k] + got[k] if k in ("kept_mismatch", "ties") else
                 max(worst[k], got[k]) for k in worst}
    tol = TOLERANCE[dtype]
    ok = worst["prefill"] <= tol and worst["decode"] <= tol and worst["kept_mismatch"] == 0
    mode = "kernel" if path == "kernel" else "compiled" if compiled else "eager"
    return {"policy": name, "dtype": dtype, "mode": mode,
            "layers": layers, **worst, "tolerance": tol, "passed": ok,
            "compiles": compiles() if compiles else None,
            "seconds": round(time.perf_counter() - started, 2)}


def trainer_smoke(device: str, out_dir: str, steps: int = 6) -> dict:
    """The mask trainer (`vllm_kvevict.train`) for a few DuoAttention steps on a tiny random
    Llama on `device`: the loss (distillation + L1 of the gates, which start all full) must
    fall and the mask file be written and read back."""
    from transformers import LlamaConfig, LlamaForCausalLM

    started = time.perf_counter()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, initializer_range=0.2)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    sources = [data_mod.Source(f"doc:{i}", "text", text_value=" ".join(
        words[(i * 5 + j * j) % len(words)] for j in range(300))) for i in range(4)]
    path = f"{out_dir}/trainer-smoke-duo.json"
    cfg = TrainConfig(objective="duo", model="tiny-llama", out=path, seq_len=256, steps=steps,
                      chunk=32, sink=4, window=16, query_block=64, loss_block=64,
                      duo_passkeys=2, duo_passkey_words=2, device=device)
    trainer = Trainer(cfg, model=LlamaForCausalLM(config), sources=sources, eos_id=1,
                      encode=lambda text: [2 + ord(ch) % 120 for ch in text], log=lambda _: None)
    losses = [r.loss for r in trainer.train(progress=False)]
    gates = load_head_gates(trainer.export(path))
    ok = all(map(math.isfinite, losses)) and losses[-1] < losses[0] and gates.shape == (2, 2)
    return {"objective": "duo", "device": device, "losses": losses, "mask": path,
            "passed": ok, "seconds": round(time.perf_counter() - started, 2)}
