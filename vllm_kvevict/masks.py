"""Head masks on disk, and turning learned gates into a binary mask at a head sparsity.

A mask file holds one gate per (layer, KV head) in [0, 1]; higher means "more of a full head".
Three formats are read, detected from the content:

- ours, JSON ("vllm-kvevict-head-mask", version 1), written by `save_head_gates`:
    format          "vllm-kvevict-head-mask"
    version         1
    model           model name the gates were trained for, e.g. "SmolLM2-135M-Instruct"
    num_layers      L
    num_kv_heads    H
    objective       how the gates were obtained: "prulong" | "duo" | "heuristic" | ...
    sink, window    streaming-head sink and window used in training (int or null)
    train_sparsity  target head sparsity of training (float or null)
    gates           L x H list of floats in [0, 1]
    log_alphas      L x H list of floats (PruLong's hard-concrete parameters) or null
    notes           free text (optional, default "")
    extra           any further metadata, a JSON object (optional, default {})
  Every key is required except notes and extra; unknown keys are an error (typos would
  otherwise be ignored silently).
- PruLong TSV (`save_prulong_masks.py`, written by csv.writer, so CRLF line ends): L rows of H
  tab-separated values, all exactly 0 or 1 (1 = full head).
- DuoAttention TSV (`full_attention_heads.tsv`): L rows of H tab-separated continuous gates
  printed as %.18e, roughly in [0, 1]. Like DuoAttention we clip to [0, 1] on load, but only
  within CLIP_TOLERANCE; anything further out means a wrong file, not rounding.
A TSV whose values are all exactly 0 or 1 is read as PruLong, any other as DuoAttention.

Two ways to pick the full heads at head sparsity S (share of streaming heads) over N = L * H:
- `full_heads_at_sparsity` (PruLong's rule, made deterministic): the round(S * N) lowest gates
  stream (round half up); equal gates stream in flat (layer-major) index order.
- `duo_quantile_full_heads` (DuoAttention's deployment rule): threshold at the S-quantile of all
  gates (linear interpolation, as numpy.quantile) and keep heads >= threshold full. DuoAttention
  adds uniform noise in [0, 1e-6) first to break ties at random; we do not, so all heads tied
  at the threshold stay full and the realised sparsity can fall below S (the released Llama-3.1
  pattern has 57 gates exactly 1.0: at S = 0.8 the quantile rule keeps 57 full, top-k 51). With
  distinct gates it keeps N - ceil(S * (N - 1)) heads full, which can differ from top-k by one.
"""

from __future__ import annotations

import glob
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm_kvevict.config import KVPolicyError

FORMAT = "vllm-kvevict-head-mask"
VERSION = 1
CLIP_TOLERANCE = 1e-3
REQUIRED_KEYS = ("format", "version", "model", "num_layers", "num_kv_heads", "objective",
                 "sink", "window", "train_sparsity", "gates", "log_alphas")
OPTIONAL_KEYS = ("notes", "extra")
# Repo root = parent of the vllm_kvevict package; shipped masks live in <root>/head_masks.
HEAD_MASKS_DIR = Path(__file__).resolve().parent.parent / "head_masks"


class MaskError(ValueError):
    """A head-mask file or setting that cannot be used; the message says where and why."""


@dataclass
class HeadGates:
    gates: torch.Tensor                      # float32 [L, H], in [0, 1], higher = more full
    log_alphas: torch.Tensor | None = None   # float32 [L, H] or None
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.gates = torch.as_tensor(self.gates).to(torch.float32)
        if self.gates.dim() != 2 or self.gates.numel() == 0:
            raise MaskError(f"gates must be a non-empty [layers, kv_heads] matrix, "
                            f"got shape {tuple(self.gates.shape)}")
        if not torch.isfinite(self.gates).all():
            raise MaskError("gates contain NaN or inf")
        if (self.gates < 0).any() or (self.gates > 1).any():
            raise MaskError("gates must lie in [0, 1] (higher = more of a full head)")
        if self.log_alphas is not None:
            self.log_alphas = torch.as_tensor(self.log_alphas).to(torch.float32)
            if tuple(self.log_alphas.shape) != self.shape:
                raise MaskError(f"log_alphas shape {tuple(self.log_alphas.shape)} != gates "
                                f"shape {self.shape}")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.gates.shape)  # type: ignore[return-value]


# -- reading ------------------------------------------------------------------------------------

def load_head_gates(path: str | Path) -> HeadGates:
    """Read a mask file in any of the three formats (see the module docstring)."""
    path = Path(path)
    if not path.is_file():
        raise MaskError(f"{path}: head-mask file not found (expected our JSON, a PruLong TSV "
                        f"or a DuoAttention full_attention_heads.tsv)")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise MaskError(f"{path}: cannot read head-mask file: {exc}") from None
    if not text.strip():
        raise MaskError(f"{path}: head-mask file is empty (expected JSON or L rows of H "
                        f"tab-separated gates)")
    if path.suffix == ".json" or text.lstrip().startswith("{"):
        return _load_json(path, text)
    return _load_tsv(path, text)


def _load_tsv(path: Path, text: str) -> HeadGates:
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()  # optional trailing newline
    rows: list[list[float]] = []
    for r, line in enumerate(lines, start=1):
        cells = line.rstrip("\r").split("\t")
        if rows and len(cells) != len(rows[0]):
            raise MaskError(f"{path}: row {r} has {len(cells)} values, row 1 has "
                            f"{len(rows[0])}; expected L rows of H tab-separated values")
        row = []
        for c, cell in enumerate(cells, start=1):
            try:
                value = float(cell)
            except ValueError:
                raise MaskError(f"{path}: row {r}, column {c}: {cell!r} is not a number; "
                                f"expected gates in [0, 1]") from None
            row.append(value)
        rows.append(row)
    gates = _checked_gates(path, rows)
    binary = all(v in (0.0, 1.0) for row in rows for v in row)
    meta = _default_meta(path, "prulong" if binary else "duo",
                         "prulong-tsv" if binary else "duo-tsv")
    if not binary:
        meta.update(_duo_config(path))
    return HeadGates(gates=gates, log_alphas=None, meta=meta)


def _duo_config(path: Path) -> dict[str, Any]:
    """Sink and recent size from the config.json DuoAttention writes beside its pattern."""
    try:
        config = json.loads((path.parent / "config.json").read_text(encoding="utf-8"))
        return {"sink": int(config["sink_size"]), "window": int(config["recent_size"])}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def _load_json(path: Path, text: str) -> HeadGates:
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise MaskError(f"{path}: not valid JSON ({exc}); expected a {FORMAT!r} file") from None
    if not isinstance(doc, dict):
        raise MaskError(f"{path}: expected a JSON object, got {type(doc).__name__}")
    missing = [k for k in REQUIRED_KEYS if k not in doc]
    if missing:
        raise MaskError(f"{path}: missing key(s) {missing}; a {FORMAT!r} file needs "
                        f"{list(REQUIRED_KEYS)}")
    unknown = sorted(set(doc) - set(REQUIRED_KEYS) - set(OPTIONAL_KEYS))
    if unknown:
        raise MaskError(f"{path}: unknown key(s) {unknown}; put extra metadata under 'extra'")
    if doc["format"] != FORMAT:
        raise MaskError(f"{path}: format is {doc['format']!r}, expected {FORMAT!r}")
    if doc["version"] != VERSION or isinstance(doc["version"], bool):
        raise MaskError(f"{path}: version {doc['version']!r} is not supported, expected "
                        f"{VERSION}")
    num_layers, num_heads = doc["num_layers"], doc["num_kv_heads"]
    for key in ("num_layers", "num_kv_heads"):
        if not _is_int(doc[key]) or doc[key] < 1:
            raise MaskError(f"{path}: {key} must be a positive integer, got {doc[key]!r}")
    for key in ("sink", "window"):
        if doc[key] is not None and (not _is_int(doc[key]) or doc[key] < 0):
            raise MaskError(f"{path}: {key} must be a non-negative integer or null, "
                            f"got {doc[key]!r}")
    sp = doc["train_sparsity"]
    if sp is not None and (not _is_number(sp) or not 0.0 <= sp <= 1.0):
        raise MaskError(f"{path}: train_sparsity must be a number in [0, 1] or null, got {sp!r}")
    for key in ("model", "objective"):
        if not isinstance(doc[key], str):
            raise MaskError(f"{path}: {key} must be a string, got {doc[key]!r}")
    if not isinstance(doc.get("notes", ""), str):
        raise MaskError(f"{path}: notes must be a string")
    if not isinstance(doc.get("extra", {}), dict):
        raise MaskError(f"{path}: extra must be a JSON object")

    expected = (num_layers, num_heads)
    gates = _checked_gates(path, _matrix(path, "gates", doc["gates"], expected))
    log_alphas = None
    if doc["log_alphas"] is not None:
        rows = _matrix(path, "log_alphas", doc["log_alphas"], expected)
        log_alphas = torch.tensor(rows, dtype=torch.float64).to(torch.float32)
    meta = _default_meta(path, doc["objective"], "json")
    meta.update(model=doc["model"], sink=doc["sink"], window=doc["window"],
                train_sparsity=None if sp is None else float(sp),
                notes=doc.get("notes", ""), extra=dict(doc.get("extra", {})))
    return HeadGates(gates=gates, log_alphas=log_alphas, meta=meta)


def _matrix(path: Path, key: str, value: Any, expected: tuple[int, int]) -> list[list[float]]:
    """A JSON L x H list of finite numbers, checked against the header's shape."""
    shape_msg = (f"{path}: {key} must be a {expected[0]} x {expected[1]} list of numbers "
                 f"(num_layers x num_kv_heads)")
    if not isinstance(value, list) or len(value) != expected[0]:
        got = len(value) if isinstance(value, list) else type(value).__name__
        raise MaskError(f"{shape_msg}, got {got} rows")
    for r, row in enumerate(value, start=1):
        if not isinstance(row, list) or len(row) != expected[1]:
            got = len(row) if isinstance(row, list) else type(row).__name__
            raise MaskError(f"{shape_msg}, row {r} has {got} values")
        for c, v in enumerate(row, start=1):
            if not _is_number(v) or not math.isfinite(v):
                raise MaskError(f"{path}: {key} row {r}, column {c}: {v!r} is not a finite "
                                f"number")
    return [[float(v) for v in row] for row in value]


def _checked_gates(path: Path, rows: list[list[float]]) -> torch.Tensor:
    """Finite, in [0, 1] up to CLIP_TOLERANCE (then clipped), as float32 [L, H]."""
    for r, row in enumerate(rows, start=1):
        for c, v in enumerate(row, start=1):
            if not math.isfinite(v):
                raise MaskError(f"{path}: row {r}, column {c} is {v}; gates must be finite "
                                f"numbers in [0, 1]")
            if v < -CLIP_TOLERANCE or v > 1.0 + CLIP_TOLERANCE:
                raise MaskError(f"{path}: row {r}, column {c} is {v}, outside [0, 1] by more "
                                f"than the clipping tolerance {CLIP_TOLERANCE}")
    gates = torch.tensor(rows, dtype=torch.float64).clamp(0.0, 1.0)
    return gates.to(torch.float32)


def _default_meta(path: Path, objective: str, source_format: str) -> dict[str, Any]:
    return {"model": None, "objective": objective, "sink": None, "window": None,
            "train_sparsity": None, "notes": "", "extra": {}, "source": str(path),
            "source_format": source_format}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# -- writing ------------------------------------------------------------------------------------

def save_head_gates(path: str | Path, gates: HeadGates) -> None:
    """Write our JSON format; float32 values round-trip exactly (repr of the float64 value).

    meta supplies model, objective, sink, window, train_sparsity, notes and extra; where it
    comes from (source, source_format) is not written.
    """
    meta = gates.meta
    if gates.log_alphas is not None and not torch.isfinite(gates.log_alphas).all():
        raise MaskError(f"{path}: log_alphas contain NaN or inf, which JSON cannot hold")
    num_layers, num_heads = gates.shape
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "model": meta.get("model") or "unknown",
        "num_layers": num_layers,
        "num_kv_heads": num_heads,
        "objective": meta.get("objective") or "unknown",
        "sink": meta.get("sink"),
        "window": meta.get("window"),
        "train_sparsity": meta.get("train_sparsity"),
        "notes": meta.get("notes", ""),
        "extra": meta.get("extra", {}),
        "gates": gates.gates.tolist(),
        "log_alphas": None if gates.log_alphas is None else gates.log_alphas.tolist(),
    }
    lines = []
    for key, value in doc.items():
        if key in ("gates", "log_alphas") and value is not None:
            rows = ",\n".join("    " + json.dumps(row) for row in value)
            text = "[\n" + rows + "\n  ]"  # one layer per line, so files diff legibly
        else:
            text = json.dumps(value, allow_nan=False)
        lines.append(f"  {json.dumps(key)}: {text}")
    Path(path).write_text("{\n" + ",\n".join(lines) + "\n}\n", encoding="utf-8")


# -- sparsity -----------------------------------------------------------------------------------

def _check_sparsity(sparsity: float) -> float:
    if isinstance(sparsity, bool) or not isinstance(sparsity, (int, float)) \
            or not math.isfinite(sparsity) or not 0.0 <= sparsity <= 1.0:
        raise MaskError(f"head sparsity must be a number in [0, 1], got {sparsity!r}")
    return float(sparsity)


def num_streaming_heads(total_heads: int, sparsity: float) -> int:
    """round(sparsity * total_heads), half up, so 0.5 of 3 heads streams 2."""
    return min(int(math.floor(_check_sparsity(sparsity) * total_heads + 0.5)), total_heads)


def full_heads_at_sparsity(gates: HeadGates, sparsity: float) -> torch.Tensor:
    """Bool [L, H], True = full head: the round(S * L * H) lowest gates stream.

    Equal gates stream in flat (layer-major) index order, so the result never depends on
    chance (PruLong breaks ties with a seeded random draw).
    """
    flat = gates.gates.flatten()
    k = num_streaming_heads(flat.numel(), sparsity)
    order = torch.sort(flat, stable=True).indices
    full = torch.ones(flat.numel(), dtype=torch.bool)
    full[order[:k]] = False
    return full.view(gates.shape)


def duo_quantile_full_heads(gates: HeadGates, sparsity: float) -> torch.Tensor:
    """Bool [L, H], True = full head, by DuoAttention's rule: gates >= the S-quantile.

    Ties at the threshold all stay full (no tie-breaking noise), see the module docstring.
    """
    s = _check_sparsity(sparsity)
    values = gates.gates.to(torch.float64)
    if s <= 0.0:
        return torch.ones(gates.shape, dtype=torch.bool)
    if s >= 1.0:
        return torch.zeros(gates.shape, dtype=torch.bool)
    threshold = torch.quantile(values.flatten(), s, interpolation="linear")
    return values >= threshold


def check_shape(gates: HeadGates, num_layers: int, num_kv_heads: int, source: str = "") -> None:
    """Raise MaskError unless the mask fits a model with num_layers x num_kv_heads KV heads."""
    if gates.shape != (num_layers, num_kv_heads):
        where = f"{source}: " if source else ""
        raise MaskError(f"{where}head mask has {gates.shape[0]} layers x {gates.shape[1]} KV "
                        f"heads, but the model has {num_layers} layers x {num_kv_heads} KV heads")


# -- shipped masks ------------------------------------------------------------------------------

def model_key(model_name_or_path: str) -> str:
    """The directory name under head_masks/ for a model: its last path component, without a
    GGUF suffix and quantisation tag ("HuggingFaceTB/SmolLM2-135M-Instruct",
    "/models/SmolLM2-135M-Instruct/" and "SmolLM2-135M-Instruct.Q4_1.gguf" all give
    "SmolLM2-135M-Instruct")."""
    name = Path(str(model_name_or_path).rstrip("/")).name
    if name.lower().endswith(".gguf"):
        name = name[: -len(".gguf")]
        stem, dot, tag = name.rpartition(".")
        if dot and re.fullmatch(r"(?i)i?q\d\w*|bf16|f16|f32", tag):  # Q4_1, IQ2_XS, F16
            name = stem
    return name


# Names a model is published under besides its head_masks/ directory: Meta renamed its Llama
# 3.1 repositories (meta-llama/Meta-Llama-3.1-8B-Instruct -> meta-llama/Llama-3.1-8B-Instruct).
MODEL_KEY_ALIASES = {"Llama-3.1-8B-Instruct": "Meta-Llama-3.1-8B-Instruct"}

_TRAINED_AT = re.compile(r"-s(\d+(?:\.\d+)?)\.json$")


def default_mask_path(model_name_or_path: str, policy: str, sparsity: float | None = None,
                      root: Path | None = None) -> Path | None:
    """The shipped mask for `policy` under `head_masks/<model-key>/`, or None if there is none.

    Masks trained at a target sparsity t are named `<policy>-s<t>.json`; the one whose t is
    nearest the requested `sparsity` is chosen (ties: the higher t; without `sparsity`: nearest
    the default 0.7). A plain `<policy>.json` is used only when no such file exists.
    The key comes from the model name or directory; if that has no masks and the directory has
    a config.json naming the original model (`_name_or_path`), that name is tried too, then
    their `MODEL_KEY_ALIASES`. The file's layers x KV heads must match the model (checked by
    `resolve_head_mask`: a same-named model of another shape is refused, never served).
    """
    if not policy or "/" in policy or "\\" in policy or policy.startswith("."):
        raise MaskError(f"invalid policy name for a mask file: {policy!r}")
    root = HEAD_MASKS_DIR if root is None else Path(root)
    keys = [model_key(model_name_or_path)]
    config = Path(str(model_name_or_path)) / "config.json"
    try:
        original = json.loads(config.read_text(encoding="utf-8")).get("_name_or_path")
        if isinstance(original, str) and original:
            keys.append(model_key(original))
    except (OSError, ValueError, AttributeError):
        pass
    keys += [MODEL_KEY_ALIASES[k] for k in keys if k in MODEL_KEY_ALIASES]
    want = 0.7 if sparsity is None else float(sparsity)
    for key in keys:
        if not key:
            continue
        trained = []
        for candidate in (root / key).glob(f"{glob.escape(policy)}-s*.json"):
            match = _TRAINED_AT.search(candidate.name)
            if match and candidate.name == f"{policy}-s{match.group(1)}.json":
                trained.append((abs(float(match.group(1)) - want), -float(match.group(1)),
                                candidate))
        if trained:
            return min(trained)[2]
        candidate = root / key / f"{policy}.json"
        if candidate.is_file():
            return candidate
    return None


def resolve_full_heads(cfg, model_name_or_path: str, num_layers: int, num_kv_heads: int):
    """(bool [L, H] full-head mask at `cfg.sparsity`, the mask file it came from) for a duo or
    prulong `KVPolicyConfig` (see `resolve_head_mask`)."""
    full_heads, path, _meta = resolve_head_mask(cfg, model_name_or_path, num_layers, num_kv_heads)
    return full_heads, path


def resolve_head_mask(cfg, model_name_or_path: str, num_layers: int, num_kv_heads: int):
    """(full-head mask, mask file, the file's metadata), reading the file once:
    `cfg.mask_path`, else the mask shipped for the model. A missing or mismatched mask raises
    `KVPolicyError` (the server refuses to start)."""

    path = cfg.mask_path or default_mask_path(model_name_or_path, cfg.policy, cfg.sparsity)
    if path is None:
        target = f" --target-sparsity {cfg.sparsity}" if cfg.policy == "prulong" else ""
        raise KVPolicyError(
            f"no {cfg.policy} head mask is shipped for model {model_name_or_path!r}; pass one "
            "with --kv-mask PATH (our JSON, a PruLong 0/1 TSV or a DuoAttention gate TSV), or "
            f"train one (it lands where the server looks): python -m vllm_kvevict.train "
            f"--objective {cfg.policy} --model {model_name_or_path}{target}")
    try:
        gates = load_head_gates(path)
        check_shape(gates, num_layers, num_kv_heads, str(path))
        full_heads = full_heads_at_sparsity(gates, cfg.sparsity)
    except MaskError as exc:
        raise KVPolicyError(str(exc)) from None
    return full_heads, str(path), dict(gates.meta)
