"""A tiny random model with the attention shape of the user's model: the same architecture,
head_dim, GQA ratio, RoPE settings and normalisations, but 4 layers, at most 2 KV heads, a small
MLP and a 4096-token vocabulary (the self-check sends token ids, so no tokenizer is needed).
Weights are drawn with a large std (0.2) and random biases / norm weights, so greedy
continuations vary and a wrong attention shows in the tokens."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from vllm_kvevict.masks import HeadGates, save_head_gates

NUM_LAYERS = 4
MAX_KV_HEADS = 2
VOCAB = 4096


def tiny_config(model: str):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model)
    text = getattr(config, "text_config", None) or config
    heads, kv_heads = text.num_attention_heads, text.num_key_value_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    ratio = heads // kv_heads
    kv = min(kv_heads, MAX_KV_HEADS)
    text.num_hidden_layers = NUM_LAYERS
    text.num_key_value_heads = kv
    text.num_attention_heads = kv * ratio
    text.head_dim = head_dim
    text.hidden_size = kv * ratio * head_dim
    text.intermediate_size = 256
    text.vocab_size = VOCAB
    text.tie_word_embeddings = False
    text.initializer_range = 0.2
    text.bos_token_id, text.eos_token_id, text.pad_token_id = 1, 2, 2
    if hasattr(text, "layer_types"):
        text.layer_types = ["full_attention"] * NUM_LAYERS
    for name in ("sliding_window", "max_window_layers"):
        if hasattr(text, name):
            setattr(text, name, None)
    if hasattr(text, "use_sliding_window"):
        text.use_sliding_window = False
    text.max_position_embeddings = max(getattr(text, "max_position_embeddings", 0) or 0, 4096)
    return config


def random_model(config, seed: int = 0):
    """A float32 model of `config` with every weight random, biases and norm weights included
    (transformers zeroes biases and sets norm weights to 1: drawn here). The tests' tiny
    models are built by it too (tests/tiny_models.py)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.2)
            elif "norm" in name:
                param.uniform_(0.5, 1.5)
    return model


def build(model: str, out_dir: Path, seed: int = 0) -> Path:
    """Save the tiny model under out_dir (config.json + safetensors, float32)."""
    config = tiny_config(model)
    config.dtype = torch.float32
    tiny = random_model(config, seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    tiny.save_pretrained(out_dir, safe_serialization=True)
    (out_dir / "kvevict-selfcheck.json").write_text(json.dumps({"from": model, "seed": seed}))
    return out_dir


def random_mask(model_dir: Path, num_layers: int, num_kv_heads: int, seed: int = 0) -> Path:
    """Random gates per KV head in our mask format (no mask is shipped for a tiny model)."""
    generator = torch.Generator().manual_seed(seed)
    gates = torch.rand(num_layers, num_kv_heads, generator=generator)
    path = model_dir / "selfcheck-mask.json"
    save_head_gates(path, HeadGates(gates, meta={"model": model_dir.name,
                                                 "objective": "random (self-check)"}))
    return path
