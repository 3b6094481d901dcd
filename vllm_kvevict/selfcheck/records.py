"""Recorded self-check passes: one JSON file per (plugin version, vLLM version, platform,
device, dtype). Plain Python: the plugin's entry point reads these in every vLLM process."""

from __future__ import annotations

import hashlib
import json
import os
import platform as _platform
from dataclasses import asdict, dataclass
from pathlib import Path

COMMAND = "python -m vllm_kvevict.selfcheck"
ENV_DIR = "VLLM_KVEVICT_SELFCHECK_DIR"
# Set by the self-check for the engines it starts: the plugin activates on an unverified
# platform for that check only (the engines serve nothing else).
ENV_CHECKING = "VLLM_KVEVICT_SELFCHECK_RUN"


@dataclass(frozen=True)
class PassKey:
    plugin: str   # vllm_kvevict.__version__
    vllm: str     # vLLM's version, without a local build tag
    platform: str  # vLLM's device type: cpu, cuda, rocm, xpu, ...
    device: str   # the device's name (GPU model; the CPU architecture)
    dtype: str    # the model dtype served: float32, bfloat16, float16

    def file_name(self) -> str:
        digest = hashlib.sha1(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()
        return f"pass-{self.platform}-{digest[:12]}.json"


def record_dir() -> Path:
    default = Path.home() / ".cache" / "vllm-kvevict" / "selfcheck"
    return Path(os.environ.get(ENV_DIR) or default)


def device_name(platform: str) -> str:
    """The name a pass is recorded under: the GPU's model on an accelerator (via torch), the
    machine's architecture on the CPU."""
    if platform in ("cuda", "rocm"):
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    return _platform.machine() or "unknown"


def write_pass(key: PassKey, details: dict, directory: Path | None = None) -> Path:
    directory = directory or record_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / key.file_name()
    path.write_text(json.dumps({"key": asdict(key), **details}, indent=2) + "\n")
    return path


def recorded_passes(directory: Path | None = None) -> list[tuple[PassKey, Path]]:
    directory = directory or record_dir()
    out = []
    for path in sorted(directory.glob("pass-*.json")) if directory.is_dir() else ():
        try:
            key = PassKey(**json.loads(path.read_text())["key"])
        except (ValueError, KeyError, TypeError):
            continue  # not ours, or damaged: ignored (it unlocks nothing)
        out.append((key, path))
    return out


def passed_dtypes(plugin: str, vllm: str, platform: str, device: str,
                  directory: Path | None = None) -> dict[str, Path]:
    """dtype -> the recorded pass for this plugin, vLLM, platform and device."""
    return {key.dtype: path for key, path in recorded_passes(directory)
            if (key.plugin, key.vllm, key.platform, key.device) == (plugin, vllm, platform,
                                                                     device)}
