"""Start, wait for and stop a `vllm serve` process for one KV policy: the one module that does
it for the tests, the evaluation, the load tests and the scripts.

`policy_flags` and `build_server_command` derive the `--kv-*` flags from the CLI's own table
(`flags.py`, which vLLM's parser gets too), so a flag is named in one place. The server runs in
its own process group: stopping it terminates the engine-core children too, not just the API
process.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from vllm_kvevict.config import EVICTION_MODES
from vllm_kvevict.flags import FLAG_OF_FIELD as FLAG_OF


# the `vllm` installed beside this interpreter: a venv's tools run without activating it
VLLM = str(Path(sys.executable).parent / "vllm")


def policy_flags(policy: dict) -> list[str]:
    """`vllm serve` flags for a kv_policy dict, e.g. {"policy": "snapkv", "sparsity": 0.5}."""
    out: list[str] = []
    for key, value in policy.items():
        if key not in FLAG_OF:
            raise ValueError(f"unknown kv_policy key {key!r}; valid: {sorted(FLAG_OF)}")
        out += [FLAG_OF[key], f"{value:g}" if isinstance(value, float) else str(value)]
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class PolicySpec:
    policy: str
    sparsity: float | None = None
    eviction: str | None = None
    tiers: int | None = None  # --kv-tiers (token eviction: KV-cache groups of layers)
    token_policy: str | None = None  # --kv-token-policy (a head mask's full heads evict)
    token_sparsity: float | None = None
    decode_budget: int | None = None  # --kv-decode-budget (decode-time eviction)
    decode_interval: int | None = None  # --kv-decode-interval

    @property
    def label(self) -> str:
        """As written on the command line, e.g. `pyramidkv:0.7:patched`,
        `pyramidkv:0.7:patched:t6` or `prulong:0.5+snapkv:0.5:patched`."""
        parts = [self.policy]
        if self.sparsity is not None:
            parts.append(f"{self.sparsity:g}")
        if self.token_policy is not None:
            head = ":".join(parts)
            parts = [self.token_policy] + ([] if self.token_sparsity is None
                                           else [f"{self.token_sparsity:g}"])
        if self.eviction is not None:
            parts.append(self.eviction)
        if self.tiers is not None:
            parts.append(f"t{self.tiers}")
        if self.decode_budget is not None:
            parts.append(f"d{self.decode_budget}" + (
                "" if self.decode_interval is None else f"e{self.decode_interval}"))
        label = ":".join(parts)
        return label if self.token_policy is None else f"{head}+{label}"

    @property
    def slug(self) -> str:
        """File-name-safe label."""
        return self.label.replace(":", "-")


def parse_policy(text: str) -> PolicySpec:
    """`POLICY[:SPARSITY[:EVICTION[:tTIERS][:dBUDGET[eINTERVAL]]]]`, e.g. `full`, `prulong:0.7`,
    `snapkv:0.7:patched`, `pyramidkv:0.7:patched:t6` (6 KV-cache groups of layers),
    `snapkv:0.7:naive:d512e128` (decode-time eviction to 512 every 128 tokens), or a head
    mask with a token policy, `HEAD:SPARSITY+TOKEN:SPARSITY[:EVICTION]`, e.g.
    `prulong:0.5+snapkv:0.5:patched` (--kv-token-policy)."""
    if "+" in text:
        head_text, _, token_text = text.partition("+")
        head, token = parse_policy(head_text), parse_policy(token_text)
        if head.eviction is not None or head.tiers is not None or token.tiers is not None:
            raise ValueError(f"a head mask with a token policy looks like "
                             f"HEAD:SPARSITY+TOKEN:SPARSITY[:EVICTION], got {text!r}")
        return PolicySpec(head.policy, head.sparsity, token.eviction,
                          token_policy=token.policy, token_sparsity=token.sparsity)
    parts = text.split(":")
    tiers = decode = interval = None
    # trailing options after POLICY:SPARSITY:EVICTION: tTIERS, dBUDGET[eINTERVAL]
    while len(parts) > 3:
        option = parts.pop()
        m = re.fullmatch(r"t(\d+)|d(\d+)(?:e(\d+))?", option)
        if not m or int(m.group(1) or m.group(2)) <= 0 or (m.group(3) and
                                                            int(m.group(3)) <= 0):
            raise ValueError(f"{option!r} in {text!r} must look like t6 (tiers) or d512 / "
                             f"d512e128 (decode budget / interval), positive integers")
        if m.group(1):
            tiers = int(m.group(1))
        else:
            decode, interval = int(m.group(2)), m.group(3) and int(m.group(3))
    if not parts[0]:
        raise ValueError(f"policy must look like NAME[:SPARSITY[:EVICTION[:tTIERS]"
                         f"[:dBUDGET[eINTERVAL]]]], got {text!r}")
    sparsity = eviction = None
    if len(parts) >= 2:
        try:
            sparsity = float(parts[1])
        except ValueError:
            raise ValueError(f"sparsity in {text!r} is not a number") from None
        if not 0.0 <= sparsity <= 1.0:
            raise ValueError(f"sparsity in {text!r} must be in [0, 1]")
    if len(parts) == 3:
        eviction = parts[2]
        if eviction not in EVICTION_MODES:
            raise ValueError(f"eviction in {text!r} must be one of {', '.join(EVICTION_MODES)}")
    return PolicySpec(parts[0], sparsity, eviction, tiers, decode_budget=decode,
                      decode_interval=interval)


def build_server_command(model: str, spec: PolicySpec, *, kv_cache_bytes: int,
                         max_batched_tokens: int, host: str = "127.0.0.1", port: int = 8000,
                         extra_args: list[str] | tuple[str, ...] = (),
                         executable: str = VLLM, eager: bool = True) -> list[str]:
    """argv of `vllm serve` for one policy; every policy gets the same pool and batch size."""
    policy = {"policy": spec.policy, "sparsity": spec.sparsity, "eviction": spec.eviction,
              "tiers": spec.tiers, "token_policy": spec.token_policy,
              "token_sparsity": spec.token_sparsity, "decode_budget": spec.decode_budget,
              "decode_interval": spec.decode_interval}
    argv = [executable, "serve", model,
            *policy_flags({k: v for k, v in policy.items() if v is not None})]
    argv += ["--kv-cache-memory-bytes", str(kv_cache_bytes),
             "--max-num-batched-tokens", str(max_batched_tokens),
             *(["--enforce-eager"] if eager else []), "--host", host, "--port", str(port)]
    return argv + list(extra_args)


# vLLM without this package: VLLM_PLUGINS names no installed plugin, so none loads
STOCK = "stock"
STOCK_ENV = {"VLLM_PLUGINS": "no-such-plugin"}


def server_launch(model: str, text: str, **kwargs) -> tuple[list[str], dict[str, str]]:
    """argv and environment of `vllm serve` for a benchmark's policy text (`parse_policy`), or
    for "stock": vLLM without the plugin, where --kv-policy does not exist. The keyword
    arguments are `build_server_command`'s."""
    if text != STOCK:
        return build_server_command(model, parse_policy(text), **kwargs), {}
    argv = build_server_command(model, PolicySpec("full"), **kwargs)
    at = argv.index("--kv-policy")
    return argv[:at] + argv[at + 2:], dict(STOCK_ENV)


def port_in_use(host: str, port: int) -> bool:
    """True if something already listens there: benchmarking it instead would be silent."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        return s.connect_ex((host, port)) == 0


class ServerProcess:
    """A server started in its own session/process group, with output to a log file."""

    def __init__(self, argv: list[str], log_path: Path, env: dict | None = None) -> None:
        self.argv, self.log_path = argv, log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True,
                                     env=None if env is None else {**os.environ, **env})

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, chars: int = 3000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-chars:]

    def wait_healthy(self, base_url: str, timeout_s: float = 900.0,
                     poll_s: float = 1.0) -> float:
        """Poll /health until 200; seconds it took. Fails early if the server exits."""
        start = time.monotonic()
        with httpx.Client(timeout=5.0, trust_env=False) as client:
            while time.monotonic() - start < timeout_s:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited with {self.proc.returncode} before "
                                       f"becoming healthy; log {self.log_path}:\n"
                                       f"{self.log_tail()}")
                try:
                    if client.get(f"{base_url}/health").status_code == 200:
                        return time.monotonic() - start
                except httpx.HTTPError:
                    pass
                time.sleep(poll_s)
        raise TimeoutError(f"server not healthy after {timeout_s:.0f} s; log {self.log_path}")

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM the process group, wait, then SIGKILL what is left."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10.0)
            except ProcessLookupError:
                pass
        # Children that outlived the leader still belong to its group.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self._log.close()
        return self.proc.returncode

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
