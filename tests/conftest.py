"""Shared fixtures: the bundled model and `vllm serve` processes started once per test session.

Servers run on loopback in eager mode with a small KV pool; two cores allow one at a time, so a
fixture that needs a differently configured server stops the previous one first.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
SERVED_NAME = "smollm2"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VLLMServer:
    """One `vllm serve` subprocess of the bundled model; its log goes to a file."""

    def __init__(self, model_dir: Path, extra_args: list[str], env: dict | None = None,
                 log_dir: Path | None = None):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        log_dir = log_dir or Path(os.environ.get("KVEVICT_TEST_LOGS", "/tmp"))
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"vllm-serve-{self.port}.log"
        self.argv = [str(VENV_BIN / "vllm"), "serve", str(model_dir),
                     "--served-model-name", SERVED_NAME, "--host", "127.0.0.1",
                     "--port", str(self.port), "--enforce-eager", "--max-model-len", "8192",
                     "--kv-cache-memory-bytes", str(512 << 20), "--seed", "0", "--dtype", "float32",
                     *extra_args]
        full_env = {**os.environ, **(env or {})}
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=full_env, start_new_session=True)

    def wait_ready(self, timeout: float = 300.0) -> "VLLMServer":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}; "
                                   f"log {self.log_path}:\n{self.log_tail()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.stop()
        raise TimeoutError(f"vllm serve not ready after {timeout}s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


@pytest.fixture(scope="session")
def bundled_model_dir() -> Path:
    from vllm_kvevict.model import ensure_bundled_model

    return ensure_bundled_model()


_current: list[VLLMServer] = []


@pytest.fixture(scope="session")
def tokenizer(bundled_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(bundled_model_dir)


@pytest.fixture(scope="session")
def hf_model(bundled_model_dir):
    """The bundled model in plain transformers, for the reference oracle."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(bundled_model_dir, dtype=torch.float32).eval()


def start_server(model_dir: Path, extra_args: list[str], env: dict | None = None) -> VLLMServer:
    """Start a server after stopping any other (two cores: one server at a time)."""
    while _current:
        _current.pop().stop()
    server = VLLMServer(model_dir, extra_args, env)
    _current.append(server)
    return server.wait_ready()


def pytest_sessionfinish(session, exitstatus):
    while _current:
        _current.pop().stop()
