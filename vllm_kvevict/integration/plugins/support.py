"""Where the plugin serves: the vLLM releases and platforms this release is built and tested
for, and, outside them, a recorded self-check pass (`vllm_kvevict/selfcheck/`) for this plugin,
vLLM, platform and device. Read by the entry point in every vLLM process (import-light)."""

from __future__ import annotations

import functools
import os

from vllm_kvevict._version import __version__
from vllm_kvevict.selfcheck import records

# What this release is built and tested for. Anywhere else the plugin stays inert unless the
# self-check (`python -m vllm_kvevict.selfcheck`) recorded a pass for this plugin, vLLM,
# platform and device: `vllm serve` without --kv-* flags is stock vLLM (one log line says why),
# and a --kv-* flag (or `additional_config["kv_policy"]`) stops the server at start-up with that
# reason, which names the command. A pass unlocks the dtypes it was recorded for.
SUPPORTED_VLLM = ("0.32.0",)
SUPPORTED_PLATFORMS = ("cpu",)


def vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def platform_name() -> str:
    from vllm.platforms import current_platform

    return str(current_platform.device_type)


def support_problem(version: str, platform: str) -> str | None:
    """Why this vLLM cannot be served by this release (None: it can)."""
    base = version.split("+")[0]
    if base not in SUPPORTED_VLLM:
        return (f"vLLM {version} is not supported (supported: {', '.join(SUPPORTED_VLLM)}): "
                "the plugin patches vLLM internals checked only for those versions")
    if platform not in SUPPORTED_PLATFORMS:
        return (f"platform {platform!r} is not supported (supported: "
                f"{', '.join(SUPPORTED_PLATFORMS)}); docs/design/attention.md, 'The CUDA path', "
                "says how the policies would map onto vLLM's GPU backends")
    return None


def activation(version: str, platform: str) -> tuple[str | None, dict[str, str]]:
    """(why the plugin stays inactive, or None; what unlocked an unsupported platform: dtype ->
    recorded pass, "*" during a self-check run)."""
    problem = support_problem(version, platform)
    if problem is None:
        return None, {}
    if os.environ.get(records.ENV_CHECKING) == "1":
        return None, {"*": "this self-check run"}
    device = records.device_name(platform)
    passes = records.passed_dtypes(__version__, version.split("+")[0], platform, device)
    if passes:
        return None, {dtype: str(path) for dtype, path in passes.items()}
    return (f"{problem}; to verify this platform ({platform}, {device}) and unlock it, run "
            f"`{records.COMMAND}` here: it records a pass for this vLLM, device and dtype"), {}


@functools.cache
def current_activation() -> tuple[str | None, dict[str, str]]:
    """`activation` of this process's vLLM and platform (decided once per process)."""
    return activation(vllm_version(), platform_name())


def unlocked_dtype_error(dtype: str, unlocked_by: dict[str, str]) -> str | None:
    """On a platform unlocked by recorded passes: the served dtype must be one of theirs."""
    if not unlocked_by or "*" in unlocked_by or dtype in unlocked_by:
        return None
    return (f"--dtype {dtype}: this platform is unlocked by self-check passes for "
            f"{', '.join(sorted(unlocked_by))} only; run `{records.COMMAND} --dtype {dtype}` "
            "to verify it")
