"""Our scheduler and worker as vLLM's classes (integration/core/kvevict_scheduler.py,
kvevict_worker.py): installed through `scheduler_config.scheduler_cls` /
`parallel_config.worker_cls`, composed with a user's subclass of vLLM's class, and a class of
any other kind refused at start-up with one line."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from vllm.config import SchedulerConfig
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from vllm_kvevict.config import KVPolicyError
from vllm_kvevict.integration.core.kvevict_scheduler import KVEvictScheduler, install
from vllm_kvevict.integration.plugins.composition import composed
from vllm_kvevict.integration.worker.kvevict_worker import KVEvictWorker
from vllm_kvevict.integration.worker.kvevict_worker import install as install_worker

ASYNC = "vllm.v1.core.sched.async_scheduler.AsyncScheduler"
NOT_A_SCHEDULER = "vllm.v1.core.sched.interface.SchedulerInterface"


def installed(**scheduler_kwargs) -> SchedulerConfig:
    config = SimpleNamespace(scheduler_config=SchedulerConfig.default_factory(**scheduler_kwargs))
    install(config)
    install(config)  # idempotent
    return pickle.loads(pickle.dumps(config.scheduler_config))  # as the engine core gets it


def test_stock_scheduler_becomes_ours():
    assert installed().get_scheduler_cls() is KVEvictScheduler
    assert installed(scheduler_cls="vllm.v1.core.sched.scheduler.Scheduler"
                     ).get_scheduler_cls() is KVEvictScheduler


def test_our_methods_come_before_a_user_subclass_in_the_mro():
    class Users(Scheduler):
        def schedule(self, *args, **kwargs):
            return super().schedule(*args, **kwargs)

    mro = composed(KVEvictScheduler, Users).__mro__
    assert mro[1:4] == (KVEvictScheduler, Users, Scheduler)
    for name in ("__init__", "schedule", "_reserve_prefill_lookahead", "update_from_output"):
        assert next(k for k in mro if name in vars(k)) is KVEvictScheduler, name


@pytest.mark.parametrize("user", [ASYNC, AsyncScheduler])
def test_a_user_scheduler_subclass_is_composed_by_a_name_another_process_resolves(user):
    """The engine core is a spawned process: it gets the class as a name it imports."""
    config = installed(scheduler_cls=user)
    name = config.scheduler_cls
    assert isinstance(name, str)
    cls = config.get_scheduler_cls()
    assert cls.__mro__[1:3] == (KVEvictScheduler, AsyncScheduler)
    code = ("from vllm.utils.import_utils import resolve_obj_by_qualname\n"
            f"cls = resolve_obj_by_qualname({name!r})\n"
            "print([k.__name__ for k in cls.__mro__[1:3]])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "['KVEvictScheduler', 'AsyncScheduler']"


def test_a_scheduler_of_another_kind_is_refused():
    with pytest.raises(KVPolicyError, match=r"^--scheduler-cls .*SchedulerInterface.* is not "
                                            r"a subclass of vLLM's Scheduler"):
        installed(scheduler_cls=NOT_A_SCHEDULER)
    with pytest.raises(KVPolicyError, match="^--scheduler-cls nowhere.Nothing: cannot import"):
        installed(scheduler_cls="nowhere.Nothing")


@pytest.mark.served_release
def test_vllm_serve_refuses_it_with_one_line(bundled_model_dir):
    vllm = Path(sys.executable).parent / "vllm"
    proc = subprocess.run([str(vllm), "serve", str(bundled_model_dir), "--kv-policy", "prulong",
                           "--scheduler-cls", NOT_A_SCHEDULER],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"vllm-kvevict: error: --scheduler-cls {NOT_A_SCHEDULER} is not a "
                           "subclass of vLLM's Scheduler"), last
    assert "Loading weights" not in proc.stderr + proc.stdout


def installed_worker(worker_cls: str) -> str:
    config = SimpleNamespace(parallel_config=SimpleNamespace(worker_cls=worker_cls))
    install_worker(config)
    install_worker(config)  # idempotent
    return config.parallel_config.worker_cls


def test_workers_stock_and_composed_by_a_name_a_worker_process_resolves():
    assert installed_worker("vllm.v1.worker.cpu_worker.CPUWorker") == \
        "vllm_kvevict.integration.worker.kvevict_worker.KVEvictWorker_over_vllm:v1:worker:cpu_worker:CPUWorker"
    name = installed_worker("user_scheduler.StepLoggingWorker")
    assert name == ("vllm_kvevict.integration.worker.kvevict_worker."
                    "KVEvictWorker_over_user_scheduler:StepLoggingWorker")
    code = ("from vllm.utils.import_utils import resolve_obj_by_qualname\n"
            f"cls = resolve_obj_by_qualname({name!r})\n"
            "print([k.__name__ for k in cls.__mro__[1:4]])")
    tests_dir = Path(__file__).resolve().parent
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=tests_dir.parent,
                          env={**os.environ, "PYTHONPATH": str(tests_dir)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "['KVEvictWorker', 'StepLoggingWorker', 'CPUWorker']"


def test_a_worker_of_another_kind_is_refused():
    with pytest.raises(KVPolicyError, match=r"^--worker-cls vllm.v1.worker.gpu_worker.Worker "
                                            r"is not a subclass of vLLM's CPUWorker"):
        installed_worker("vllm.v1.worker.gpu_worker.Worker")
    with pytest.raises(KVPolicyError, match="^--worker-cls nowhere.Nothing: cannot import"):
        installed_worker("nowhere.Nothing")


@pytest.mark.server
def test_served_with_a_user_scheduler_subclass(bundled_model_dir, tokenizer, hf_model):
    """Composed in the engine core and the worker: the user's classes run under ours, token
    eviction's ledger is attached, and the tokens are the reference's."""

    from conftest import start_server
    from test_policies_vllm import CASES, flags, reference, served, source_prompts

    policy, chunk = CASES["snapkv-patched-0.5"]
    tests_dir = str(Path(__file__).resolve().parent)  # the engine core imports the user's class
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [tests_dir,
                                                       os.environ.get("PYTHONPATH")]))}
    server = start_server(bundled_model_dir, [*flags(policy, chunk), "--scheduler-cls",
                                              "user_scheduler.StepLoggingScheduler",
                                              "--worker-cls", "user_scheduler.StepLoggingWorker"],
                          env=env)
    for prompt in source_prompts(tokenizer, (700,)):
        text, _ = served(server.base_url, prompt)
        assert text == tokenizer.decode(reference(hf_model, bundled_model_dir, policy, prompt,
                                                  chunk).token_ids)
    log = server.log_path.read_text(errors="replace")
    assert "KVEvictScheduler_over_user_scheduler:StepLoggingScheduler" in log
    assert "token eviction ledger over 1 KV-cache group(s)" in log
    assert "user scheduler: first step, under KVEvictScheduler" in log
    assert "user worker: first step, under KVEvictWorker" in log


# A CUDA platform simulated where the plugin asks which platform it is on (support.platform_name,
# read by the activation gate, start-up validation, the worker install and the worker's backend
# registration), on vLLM's real engine configs of this CPU build: the worker class is the one
# CUDA's platform sets for "auto" (test_vllm_contract checks vllm/platforms/cuda.py says so).
SIMULATED_CUDA = """
import json, sys
sys.path.insert(0, "tests")
import triton_interpreter
triton_interpreter.enable()  # vLLM 0.32 wants Triton for its V2 runner (here: the interpreter)
from vllm_kvevict.integration.plugins import support
support.platform_name = lambda: "cuda"
from vllm.engine.arg_utils import EngineArgs
from vllm.utils.import_utils import resolve_obj_by_qualname
from vllm_kvevict.config import KVPolicyError
from vllm_kvevict.integration.attention import flex_attention
from vllm_kvevict.integration.plugins import registration
registration.register()
print("REASON", json.dumps(registration.inactive_reason))
for extra in json.loads(sys.argv[2]):
    policy = {"policy": "prulong", "sparsity": 0.7, **extra.pop("policy", {})}
    args = EngineArgs(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=2048,
                      worker_cls="vllm.v1.worker.gpu_worker.Worker",
                      additional_config={"kv_policy": policy}, **extra)
    try:
        config = args.create_engine_config()
    except KVPolicyError as exc:
        print("REFUSED", json.dumps(str(exc)))
        continue
    worker = resolve_obj_by_qualname(config.parallel_config.worker_cls)
    print("WORKER", json.dumps([config.parallel_config.worker_cls,
                                [k.__name__ for k in worker.__mro__[:3]]]))
    from vllm_kvevict.integration.plugins.versions import uses_v2_runner
    print("CONFIG", json.dumps([uses_v2_runner(config),
                                config.additional_config["kv_policy"].get("attention_backend"),
                                getattr(config.attention_config.backend, "name", None),
                                args.async_scheduling,
                                getattr(args.compilation_config.cudagraph_mode, "name", None)]))
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    print("FLEX", flex_attention.use_head_pages_backend(config, "cuda"),
          AttentionBackendEnum.FLEX_ATTENTION.get_path() == flex_attention.FLEX_BACKEND,
          AttentionBackendEnum.CPU_ATTN.get_path() != flex_attention.FLEX_BACKEND)
"""


def simulated_cuda(model_dir, pass_dir, *configs: dict) -> list[tuple[str, str]]:
    from vllm_kvevict.selfcheck import records

    # (the V2 model runner: what vLLM picks on CUDA, where Triton is present)
    env = {**os.environ, records.ENV_DIR: str(pass_dir), "VLLM_TARGET_DEVICE": "cpu",
           "VLLM_USE_V2_MODEL_RUNNER": "1"}
    env.pop(records.ENV_CHECKING, None)
    proc = subprocess.run([sys.executable, "-c", SIMULATED_CUDA, str(model_dir),
                           json.dumps(list(configs))], capture_output=True, text=True,
                          timeout=600, cwd=Path(__file__).resolve().parent.parent, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [tuple(line.split(" ", 1)) for line in proc.stdout.splitlines()
            if line.split(" ", 1)[0] in ("REASON", "REFUSED", "WORKER", "CONFIG", "FLEX")]


def test_on_a_simulated_cuda_platform_a_pass_unlocks_the_gpu_worker_and_flex_attention(
        bundled_model_dir, tmp_path):
    """CUDA (simulated, above): without a recorded pass a policy is refused naming the
    self-check; with one our worker is composed over vLLM's GPU `Worker` (not the CPU one),
    the policy runs on FlexAttention by default (vLLM's V2 runner chosen, as on CUDA), vLLM's
    FLEX_ATTENTION name resolves to our backend in the worker; the CPU kernel and another
    vLLM backend are refused by flag, and so is async scheduling (off by default then), and
    FULL CUDA graphs (vLLM's default FULL_AND_PIECEWISE made PIECEWISE; an explicit FULL mode
    refused naming the flag; NONE, PIECEWISE and O0's default kept; `full` left alone)."""
    import vllm

    from vllm_kvevict import __version__
    from vllm_kvevict.selfcheck import records

    [(tag, reason), (tag2, refused)] = simulated_cuda(bundled_model_dir, tmp_path, {})
    assert tag == "REASON" and " is not supported (supported: " in reason  # version or platform
    assert "run `python -m vllm_kvevict.selfcheck` here" in reason
    assert tag2 == "REFUSED" and "needs an active plugin" in refused
    records.write_pass(records.PassKey(__version__, vllm.__version__.split("+")[0], "cuda",
                                       records.device_name("cuda"), "float32"), {}, tmp_path)
    out = simulated_cuda(bundled_model_dir, tmp_path, {},
                         {"policy": {"attention_backend": "cpu"}},
                         {"policy": {"attention_backend": "flex"},
                          "attention_backend": "FLASH_ATTN"},
                         {"async_scheduling": True},
                         *({"compilation_config": {"cudagraph_mode": mode}} for mode in
                           ("FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE", "NONE",
                            "PIECEWISE")),
                         {"optimization_level": 0},
                         {"policy": {"policy": "full"}})
    assert out[0] == ("REASON", "null")
    worker, mro = json.loads(out[1][1])
    # (our worker subclasses vLLM's Worker itself: over CUDA's, it is installed as it is)
    assert worker == "vllm_kvevict.integration.worker.kvevict_worker.KVEvictWorker"
    assert mro == ["KVEvictWorker", "Worker", "WorkerBase"]
    # (async scheduling, vLLM's default on CUDA: off, as the CPU platform runs every policy)
    assert json.loads(out[2][1]) == [True, "flex", "FLEX_ATTENTION", False, "PIECEWISE"]
    assert out[3] == ("FLEX", "True True True")
    assert out[4][0] == "REFUSED" and json.loads(out[4][1]).startswith(
        "--kv-attention-backend cpu is vLLM's CPU attention kernel, which platform 'cuda' does "
        "not have; valid there: --kv-attention-backend flex")
    assert out[5][0] == "REFUSED" and json.loads(out[5][1]).startswith(
        "--attention-backend FLASH_ATTN: --kv-policy prulong runs on vLLM's FlexAttention "
        "backend off the CPU platform; valid: leave --attention-backend out")
    assert out[6][0] == "REFUSED" and json.loads(out[6][1]).startswith(
        "--async-scheduling is not supported with --kv-policy prulong yet (untested")
    for line, mode in zip(out[7:10], ("FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")):
        assert line[0] == "REFUSED" and json.loads(line[1]).startswith(
            f"--compilation-config '{{\"cudagraph_mode\": \"{mode}\"}}' is not supported "
            "with --kv-policy prulong: a FULL CUDA graph replays attention"), line
        assert json.loads(line[1]).endswith("valid: NONE, PIECEWISE (or leave it out: the "
                                            "plugin sets PIECEWISE)")
    # the engine args' mode after start-up: as asked; O0's default (NONE) and `full` untouched
    configs = [json.loads(v) for tag, v in out[10:] if tag == "CONFIG"]
    assert [c[4] for c in configs] == ["NONE", "PIECEWISE", None, None]
    assert configs[3][1] is None  # `full`: vLLM's own backend, its graphs as vLLM sets them
