"""Shared fixtures: the bundled model and `vllm serve` processes started once per test session.

Servers run on loopback in eager mode with a small KV pool, one at a time per pytest process: a
fixture that needs a differently configured server stops the previous one first. `make test`
runs two pytest-xdist workers, each pinned with its servers and its reference to one core
(`pytest_configure`), so two OpenMP pools never share a core; tests marked `serial` (tensor
parallelism: one rank per core) run after them, alone on the machine.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

pytest.register_assert_rewrite("mechanism_soak")  # (its asserts explain themselves too)

from vllm_kvevict.integration.plugins.versions import vllm_release  # noqa: E402
from vllm_kvevict.launch import ServerProcess, free_port  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
SERVED_NAME = "smollm2"
SERVED_RELEASE = (0, 32)  # integration/plugins/support.py: SUPPORTED_VLLM


class VLLMServer(ServerProcess):
    """One `vllm serve` subprocess of the bundled model (eager, 512 MiB pool, 8K context)."""

    def __init__(self, model_dir: Path, extra_args: list[str], env: dict | None = None,
                 log_dir: Path | None = None, eager: bool = True):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        log_dir = log_dir or Path(os.environ.get("KVEVICT_TEST_LOGS", "/tmp"))
        argv = [str(VENV_BIN / "vllm"), "serve", str(model_dir),
                "--served-model-name", SERVED_NAME, "--host", "127.0.0.1",
                "--port", str(self.port), *(["--enforce-eager"] if eager else []),
                "--max-model-len", "8192",
                "--kv-cache-memory-bytes", str(512 << 20), "--seed", "0", "--dtype", "float32",
                *extra_args]
        super().__init__(argv, log_dir / f"vllm-serve-{self.port}.log", env=env or {})

    def wait_ready(self, timeout: float = 300.0) -> "VLLMServer":
        try:
            self.wait_healthy(self.base_url, timeout)
        except TimeoutError:
            self.stop()
            raise
        return self


def pytest_configure(config):
    """Under pytest-xdist, pin this worker to one core and hand that core to the servers it
    starts (vLLM binds its OpenMP threads to VLLM_CPU_OMP_THREADS_BIND; a test may override
    it, as tensor parallelism's "0|1"). Two OpenMP pools on one core slow each other down
    many times over; one pool per core costs little (vLLM serving a 135M model gains far less
    than 2x from its second core, and start-up is single-threaded Python imports)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not worker:
        return
    cores = sorted(os.sched_getaffinity(0))
    core = cores[int(worker.removeprefix("gw")) % len(cores)]
    os.sched_setaffinity(0, {core})
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
    import torch

    torch.set_num_threads(1)


def skip_without_fp8_kv_cache(kv_cache_dtype: str = "fp8") -> None:
    """Skip a test that serves an fp8 KV cache where vLLM's CPU attention refuses one: it
    needs AVX-512 or AMX (`cpu_attn._get_attn_isa`, asked here with the test models' shape,
    so the reason is vLLM's own and moves with it; AVX2-only CPUs of this machine kind
    exist). A served fp8 cache on such a CPU fails at start-up in vLLM's worker."""
    if not kv_cache_dtype.startswith("fp8"):
        return
    import torch
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    try:
        _get_attn_isa(torch.float32, 128, 64, kv_cache_dtype)
    except NotImplementedError as exc:
        pytest.skip(f"vLLM cannot serve --kv-cache-dtype {kv_cache_dtype} on this CPU: {exc}")


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
def tiny_qwen3(tmp_path_factory):
    """get(num_kv_heads) -> a tiny random Qwen3 (4 layers, head_dim 64; tests/tiny_models.py)
    with that many KV heads, built once per session."""
    from tiny_models import build_tiny_model

    root = tmp_path_factory.mktemp("tiny-qwen3")
    built: dict[int, Path] = {}

    def get(num_kv_heads: int) -> Path:
        if num_kv_heads not in built:
            built[num_kv_heads] = build_tiny_model("qwen3", root, num_kv_heads=num_kv_heads,
                                                   name=f"tiny-qwen3-kv{num_kv_heads}")
        return built[num_kv_heads]
    return get


@pytest.fixture(scope="module")
def one_torch_thread():
    """The reference on one thread, beside the server's OpenMP pool (see test_compat.py)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def hf_model(bundled_model_dir):
    """The bundled model in plain transformers, for the reference oracle."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(bundled_model_dir, dtype=torch.float32).eval()


def start_server(model_dir: Path, extra_args: list[str], env: dict | None = None,
                 eager: bool = True, reuse: bool = False) -> VLLMServer:
    """Start a server after stopping any other (two cores: one server at a time). The port
    `free_port` found can be taken before vLLM binds it (the other pytest worker's servers and
    engine processes bind ports too; seen once in a dry run): then again on a new port.
    `reuse`: the running server if it was started with these very arguments and is alive (a
    file's short soak runs on the server its previous test started: no second start)."""
    key = (str(model_dir), tuple(extra_args), tuple(sorted((env or {}).items())), eager)
    if reuse and _current and _current[0].key == key and _current[0].proc.poll() is None:
        return _current[0]
    while _current:
        _current.pop().stop()
    for attempt in range(3):
        server = VLLMServer(model_dir, extra_args, env, eager=eager)
        server.key = key
        _current.append(server)
        try:
            return server.wait_ready(300.0 if eager else 900.0)
        except RuntimeError as exc:
            if "Address already in use" not in str(exc) or attempt == 2:
                raise
            _current.remove(server)


def pool_width(server: VLLMServer) -> int | None:
    """Head pages per pool block of a head-mask server (every group's block costs the widest
    group's: `pool_groups.py`'s start-up line); None when the server logged no such plan."""
    m = re.search(r"blocks of (\d+) head pages", server.log_path.read_text(errors="replace"))
    return int(m.group(1)) if m else None


def served_policy_builds(server: VLLMServer) -> dict[int, int]:
    """process id -> times that process built the served policy (its start-up log line)."""
    import re

    builds: dict[int, int] = {}
    for match in re.finditer(r"vllm-kvevict: serving .*\(process (\d+), build (\d+)\)",
                             server.log_path.read_text(errors="replace")):
        pid = int(match.group(1))
        builds[pid] = builds.get(pid, 0) + 1
    return builds


# make test hands whole files to two pytest-xdist workers (--dist loadfile, in this order:
# --no-loadscope-reorder), so the files that start servers go first, longest first (measured on
# one worker in the dry run of 2026-11-29 after the CI tier's cuts: about 7 down to 1.5
# minutes; the Triton, quiet-steps, token-prefix and pareto files placed by the durations of
# 2026-12-07's run), and the many short files fill in at the end: both workers then finish
# within a few minutes of each other.
LONGEST_FIRST = ("test_reliability.py", "test_selfcheck.py", "test_compat.py",
                 "test_policies_vllm.py", "test_admission.py", "test_flex_vllm.py",
                 "test_v2_runner.py",
                 "test_pool_no_leak.py", "test_pool_storage.py", "test_serve_full.py",
                 "test_model_families_vllm.py", "test_tenant_isolation.py", "test_hybrid.py",
                 "test_decode_eviction.py", "test_triton_vllm.py", "test_quiet_steps.py",
                 "test_kv_stats.py", "test_operator_view.py", "test_vllm_features.py",
                 "test_speculative.py", "test_evaluation.py", "test_offline_llm.py",
                 "test_token_prefix_cache.py", "test_pareto.py", "test_scheduler_class.py")


def pytest_collection_modifyitems(config, items):
    """Files in LONGEST_FIRST order, the rest after them as collected; and
    KVEVICT_LIST_SLOW=1: name the slow-tier items while collecting (test_compat_doc.py checks
    the compatibility page's tier marks against them in one collection)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: file order kept
    if vllm_release() != SERVED_RELEASE:  # the vLLM 0.33 environment: engine side only
        skip = pytest.mark.skip(reason=f"needs vLLM {SERVED_RELEASE[0]}.{SERVED_RELEASE[1]}, the "
                                       "release served (CPU ops, an active plugin)")
        for item in items:
            if item.get_closest_marker("served_release") or item.get_closest_marker("server"):
                item.add_marker(skip)
    if os.environ.get("KVEVICT_LIST_SLOW") == "1":
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        for item in items:
            if item.get_closest_marker("slow"):
                reporter.write_line(f"slow-tier: {item.nodeid}")


def pytest_sessionfinish(session, exitstatus):
    while _current:
        _current.pop().stop()


# A LoRA adapter for the bundled model (test_compat.py's LoRA row, test_token_prefix_cache.py)
LORA_NAME, LORA_RANK, LORA_ALPHA = "tiny-lora", 8, 16


@pytest.fixture(scope="session")
def lora_adapter(tmp_path_factory):
    """A random rank-8 adapter on q_proj and v_proj of every layer, in PEFT's file layout."""
    import json

    import torch
    from safetensors.torch import save_file

    out = tmp_path_factory.mktemp("lora")
    g = torch.Generator().manual_seed(0)
    hidden, kv = 576, 3 * 64
    tensors = {}
    for i in range(30):
        for module, rows in (("q_proj", hidden), ("v_proj", kv)):
            name = f"base_model.model.model.layers.{i}.self_attn.{module}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(LORA_RANK, hidden, generator=g) / 24
            tensors[f"{name}.lora_B.weight"] = torch.randn(rows, LORA_RANK, generator=g) * 0.5
    save_file(tensors, out / "adapter_model.safetensors")
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": LORA_RANK, "lora_alpha": LORA_ALPHA, "bias": "none",
        "target_modules": ["q_proj", "v_proj"]}))
    return out, tensors


@pytest.fixture(scope="session")
def lora_model(hf_model, lora_adapter):
    """The bundled model with the adapter merged: W += (alpha / r) B A."""
    import copy

    import torch

    _, tensors = lora_adapter
    merged = copy.deepcopy(hf_model)
    scale = LORA_ALPHA / LORA_RANK
    with torch.no_grad():
        for i, layer in enumerate(merged.model.layers):
            for module in ("q_proj", "v_proj"):
                name = f"base_model.model.model.layers.{i}.self_attn.{module}"
                delta = tensors[f"{name}.lora_B.weight"] @ tensors[f"{name}.lora_A.weight"]
                getattr(layer.self_attn, module).weight += scale * delta
    return merged
