"""Tiny random models of each supported family, saved so `vllm serve <dir>` loads them.

Every model has head_dim 64 (vLLM's CPU attention kernel rejects 16), GQA with two query heads
per KV head, float32 weights and the bundled SmolLM2 tokenizer (copied beside the weights).
Weights are drawn with a large std (0.2) so greedy continuations vary instead of repeating one
token; biases and RMSNorm weights are random too (transformers initialises them to 0 and 1).
What each family adds to the attention the reference must reproduce:
- llama3: Llama 3 rope scaling (low frequencies stretched 8x);
- qwen2: biases on q/k/v;
- qwen3: RMSNorm of each query/key head before RoPE, and an explicit head_dim (the hidden size
  is not num_attention_heads * head_dim);
- mistral: a plain Llama layout; sliding_window None (the policies need full attention).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

FAMILIES = ("llama3", "qwen2", "qwen3", "mistral")
HEAD_DIM = 64
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "chat_template.jinja")
# Llama 3.1's scaling but from 1024 original positions (transformers wants fewer than
# max_position_embeddings), so the smoothed band's wavelengths (256..1024) fall within prompts
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 1024}


def model_config(family: str, vocab_size: int, bos: int, eos: int, num_kv_heads: int = 2,
                 num_layers: int = 4):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    heads = 2 * num_kv_heads
    common = dict(vocab_size=vocab_size, hidden_size=heads * HEAD_DIM, intermediate_size=256,
                  num_hidden_layers=num_layers, num_attention_heads=heads,
                  num_key_value_heads=num_kv_heads, head_dim=HEAD_DIM,
                  max_position_embeddings=8192, initializer_range=0.2,
                  tie_word_embeddings=False, bos_token_id=bos, eos_token_id=eos,
                  pad_token_id=eos)
    if family == "llama3":
        return LlamaConfig(**common, rope_parameters=LLAMA3_ROPE)
    if family == "qwen2":
        return Qwen2Config(**common, use_sliding_window=False)
    if family == "qwen3":
        # hidden 3/4 of heads * head_dim: only an explicit head_dim gives the right shapes
        return Qwen3Config(**{**common, "hidden_size": heads * HEAD_DIM * 3 // 4},
                           use_sliding_window=False)
    if family == "mistral":
        return MistralConfig(**common, sliding_window=None)
    raise ValueError(f"unknown family {family!r}; one of {FAMILIES}")


def build_tiny_model(family: str, out_dir: Path, *, num_kv_heads: int = 2, num_layers: int = 4,
                     seed: int = 0, name: str | None = None, init_std: float = 0.2) -> Path:
    """Save a random `family` model with the bundled tokenizer under out_dir/<name>
    (default tiny-<family>). A deep model needs a smaller `init_std`: at 0.2 its 32 random
    layers amplify float32 rounding until two correct implementations disagree."""
    from transformers import AutoTokenizer

    from vllm_kvevict.model import ensure_bundled_model
    from vllm_kvevict.selfcheck.tiny_model import random_model

    tokenizer_dir = ensure_bundled_model()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = model_config(family, len(tokenizer), tokenizer.bos_token_id,
                          tokenizer.eos_token_id, num_kv_heads, num_layers)
    config.dtype = torch.float32
    config.initializer_range = init_std
    model = random_model(config, seed)
    target = Path(out_dir) / (name or f"tiny-{family}")
    model.save_pretrained(target, safe_serialization=True)
    for file in TOKENIZER_FILES:
        if (tokenizer_dir / file).is_file():
            shutil.copy(tokenizer_dir / file, target / file)
    return target
