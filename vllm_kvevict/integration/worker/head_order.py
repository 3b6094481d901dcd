"""A head mask under tensor parallel: each layer's KV heads reordered so that every rank holds
its share of the layer's full heads (issue 47).

vLLM gives each rank a contiguous slice of KV heads and wants the same spec per layer on every
rank, so each rank's paged cache holds the most full heads any rank has there; a mask that puts
a layer's full heads side by side pays for that (DuoAttention's Llama-3.1-8B: 1.27x / 1.48x at
TP 2). Permuting a layer's KV heads with their query heads and o_proj's input columns serves the
same model; dealt round-robin, every rank gets ceil or floor of the full and streaming heads.
Our loader (`loader_class`, registered with vLLM's `register_model_loader`) permutes the
checkpoint's tensors as vLLM's loader streams them, before the per-rank slicing (the CPU build
repacks the weights right after loading). Design: docs/design/parallel.md, "Tensor parallel".
"""

from __future__ import annotations

import contextlib
import functools
import re

import torch

from vllm_kvevict.integration.kv_cache.head_split import layer_heads

# the load formats vLLM reads through DefaultModelLoader with Hugging Face parameter names
DEFAULT_LOADER_FORMATS = ("auto", "hf", "safetensors", "pt", "npcache", "fastsafetensors",
                          "instanttensor")
LOAD_FORMAT = "kvevict-head-order"
_PROJ = re.compile(r"layers\.(\d+)\.self_attn\.(q_proj|k_proj|v_proj|o_proj)\.(weight|bias)$")


def balanced_order(streaming: torch.Tensor, world: int) -> torch.Tensor:
    """long [L, H]: row l lists layer l's KV heads (original indices) in the served order. Full
    heads first, then streaming ones, each kind in its original order, dealt round-robin over
    the ranks: rank r's contiguous slice holds sequence positions r, r + T, ... A layer whose
    ranks already hold equal shares keeps vLLM's order."""
    layers, heads = streaming.shape
    per_rank = heads // world
    rows = []
    for row in streaming.tolist():
        seq = [h for h in range(heads) if not row[h]] + [h for h in range(heads) if row[h]]
        dealt = [seq[r + world * i] for r in range(world) for i in range(per_rank)]
        full_per_rank = [sum(not row[h] for h in range(r * per_rank, (r + 1) * per_rank))
                         for r in range(world)]
        rows.append(dealt if max(full_per_rank) - min(full_per_rank) > 1 else list(range(heads)))
    return torch.tensor(rows, dtype=torch.long).view(layers, heads)


def padded_heads(streaming: torch.Tensor, world: int) -> tuple[int, int]:
    """(paged full heads, streaming companion heads) one rank declares over all layers."""
    declared = layer_heads(streaming, 1, rank=0, world=world)
    return sum(h.paged_heads for h in declared), sum(h.companion_heads for h in declared)


def choose(streaming: torch.Tensor, world: int, wanted: str, blocker: str | None):
    """(order or None, one line for the start-up log or None). The order is used only where it
    declares fewer heads than vLLM's contiguous one; `blocker` says why it cannot be applied
    (weights vLLM's default loader does not read, LoRA, quantization)."""
    if world == 1 or streaming.shape[1] % world or streaming.shape[1] == world:
        return None, None  # (one head per rank or replicated heads: nothing to balance)
    order = balanced_order(streaming, world)
    before = padded_heads(streaming, world)
    after = padded_heads(streaming.gather(1, order), world)
    if sum(after) >= sum(before):
        return None, None
    change = (f"full heads {before[0]} -> {after[0]}, streaming companions {before[1]} -> "
              f"{after[1]} per rank over all layers")
    if wanted != "balanced":
        return None, (f"tensor parallel: --kv-tp-head-order {wanted}: KV heads in vLLM's "
                      f"order; balanced would declare {change}")
    if blocker:
        return None, (f"tensor parallel: KV heads in vLLM's order ({blocker}); a balanced "
                      f"order would declare {change}")
    return order, (f"tensor parallel: each layer's KV heads reordered so every rank holds "
                   f"its share of the full heads (--kv-tp-head-order balanced): {change}")


def permute(name: str, tensor: torch.Tensor, order: torch.Tensor, queries_per_kv: int,
            head_dim: int) -> torch.Tensor:
    """A checkpoint tensor in the served head order (others unchanged): q/k/v projections'
    output rows and o_proj's input columns move with their KV head."""
    match = _PROJ.search(name)
    if match is None:
        return tensor
    layer, proj, kind = int(match.group(1)), match.group(2), match.group(3)
    if proj == "o_proj" and kind == "bias":
        return tensor
    perm = order[layer]
    heads = perm.numel()
    width = head_dim * (queries_per_kv if proj in ("q_proj", "o_proj") else 1)
    dim = 1 if proj == "o_proj" else 0
    if tensor.dim() <= dim or tensor.shape[dim] != heads * width:
        raise RuntimeError(
            f"vllm-kvevict: {name} has shape {tuple(tensor.shape)}, not {heads} KV heads x "
            f"{width} along dim {dim}; the balanced head order cannot permute it: start with "
            "--kv-tp-head-order contiguous")
    shape = tensor.shape
    grouped = tensor.reshape(*shape[:dim], heads, width, *shape[dim + 1:])
    return grouped.index_select(dim, perm).reshape(shape)


@functools.cache
def loader_class():
    """vLLM's DefaultModelLoader in the user's load format, the served model's attention
    projections permuted as they stream past; registered under LOAD_FORMAT (built on first
    use: this module imports no vLLM at import). vLLM builds it from the load config alone;
    the worker's state is handed to it by `loading`, for the load's duration."""
    import dataclasses

    from vllm.model_executor.model_loader import register_model_loader
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    class HeadOrderLoader(DefaultModelLoader):
        state = None  # the worker's state while `loading` runs

        def __init__(self, load_config):
            self.target = True
            super().__init__(dataclasses.replace(load_config,
                                                 load_format=self.state.base_load_format))

        def load_model(self, vllm_config, model_config, prefix=""):
            # a draft model has heads of its own: only the served model is permuted
            self.target = model_config is vllm_config.model_config
            return super().load_model(vllm_config=vllm_config, model_config=model_config,
                                      prefix=prefix)

        def get_all_weights(self, model_config, model):
            weights = super().get_all_weights(model_config, model)
            if not self.target:
                yield from weights
                return
            shape, order = self.state.served.shape, self.state.head_order
            for name, tensor in weights:
                yield name, permute(name, tensor, order, shape.queries_per_kv, shape.head_dim)

    return register_model_loader(LOAD_FORMAT)(HeadOrderLoader)


@contextlib.contextmanager
def loading(vllm_config, state):
    """While vLLM's worker loads the model: its load format is ours, over the user's."""
    if state is None or state.head_order is None:
        yield
        return
    load_config = vllm_config.load_config
    state.base_load_format = load_config.load_format
    loader = loader_class()
    loader.state, load_config.load_format = state, LOAD_FORMAT
    try:
        yield
    finally:
        loader.state, load_config.load_format = None, state.base_load_format


def blocker(vllm_config) -> str | None:
    """Why the weights cannot be permuted at load (None: they can)."""
    load_format = str(vllm_config.load_config.load_format)
    if load_format not in DEFAULT_LOADER_FORMATS:
        return f"--load-format {load_format} is not read by vLLM's default loader"
    if getattr(vllm_config.model_config, "quantization", None):
        return f"quantized weights ({vllm_config.model_config.quantization})"
    if getattr(vllm_config, "lora_config", None) is not None:
        return "LoRA adapters would need their rows permuted too"
    return None
