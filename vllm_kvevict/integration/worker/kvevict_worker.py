"""The plugin's worker side, composed over the worker class vLLM's platform builds (CPU:
`CPUWorker`; CUDA and ROCm: `gpu_worker.Worker`) or over a user's `--worker-cls` that
subclasses it, and installed as vLLM's worker class (`parallel_config.worker_cls`) when the
engine config is created; any other class is refused at start-up (`composition.py`). Every
method overridden here is one of vLLM's `Worker` (the base of every platform's worker).

`KVEvictWorker` builds this process's policy state once, from the config vLLM hands it
(`state.build_state`), sets it as the attention context (`attention/context.py`) and keeps it in
step with vLLM: the KV-cache specs it declares, the shared-cache layers' specs, and, around
every step, releasing finished requests, making seeded requests' generators rewindable and
booking token evictions.
"""

from __future__ import annotations

import copy

from vllm.v1.worker.gpu_worker import Worker

from vllm_kvevict.integration.attention import flex_attention
from vllm_kvevict.integration.attention.context import set_attention_context
from vllm_kvevict.integration.plugins import support
from vllm_kvevict.integration.plugins.composition import import_class, install_over, resolve
from vllm_kvevict.integration.worker import head_order, runners, seeded_sampling
from vllm_kvevict.integration.worker.state import WorkerState, build_state


class KVEvictWorker(Worker):
    kv_state: WorkerState  # this process's (init_device); `full` too (its planner plans nothing)
    head_pages = False  # --kv-attention-backend flex or triton (flex_attention.py)

    def __init__(self, vllm_config, *args, **kwargs) -> None:
        super().__init__(vllm_config, *args, **kwargs)
        self.head_pages = flex_attention.use_head_pages_backend(vllm_config,
                                                                support.platform_name())

    def init_device(self) -> None:
        """The state is built once vLLM's distributed set-up is done (a tensor-parallel rank's
        heads need it)."""
        super().init_device()
        self.kv_state = set_attention_context(build_state(self.vllm_config))
        self.kv_state.planner.runner = self.model_runner

    def load_model(self, *args, **kwargs) -> None:
        """A head mask under tensor parallel: vLLM's loader reads the weights with each layer's
        KV heads in the balanced order the state chose (`head_order.py`). Then the served
        kind's planner installs what it needs on the loaded model (token eviction: patched
        eviction's question rows, `question_rows.py`)."""
        with head_order.loading(self.vllm_config, self.kv_state):
            super().load_model(*args, **kwargs)
        self.kv_state.planner.after_load(self.model_runner)

    def get_kv_cache_spec(self):
        """The served kind's specs (its planner's `declare_specs`): a head mask's streaming
        heads in their companions' groups, token eviction's tiers (with prefix caching:
        `prefix_specs`)."""
        return self.kv_state.planner.declare_specs(self.model_runner, super().get_kv_cache_spec)

    def initialize_from_config(self, kv_cache_config) -> None:
        """vLLM adds a layer that shares another's cache to that layer's group but gives it no
        per-layer spec (a head-mask layer without full heads shares its companion's cache):
        give it its target's."""
        shared = runners.shared_layers(self.model_runner, self.vllm_config)
        if self.kv_state.planner.declares_specs and shared:
            kv_cache_config = copy.deepcopy(kv_cache_config)  # the engine core's is not ours
            share_layer_specs(shared, kv_cache_config.kv_cache_groups)
        super().initialize_from_config(kv_cache_config)

    def execute_model(self, scheduler_output):
        """Finished and preempted requests release their state before the step, token
        evictions are booked after it; seeded requests' CPU generators are made rewindable
        before the step samples (`seeded_sampling.py`)."""
        planner = self.kv_state.planner
        planner.begin_step(self.model_runner, scheduler_output)
        try:
            output = super().execute_model(scheduler_output)
            seeded_sampling.prepare(self.model_runner)  # any policy: stock vLLM's CPU worker too
        finally:
            planner.finish_step()
        return output


def share_layer_specs(shared: dict, groups) -> None:
    """Before vLLM's `add_kv_sharing_layers_to_kv_cache_groups` (KVEvictWorker): it adds the
    sharing layers' names to the groups but not their per-layer spec entry; a layer sharing
    another's cache shares its spec too."""
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    for group in groups:
        spec = group.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            for name, target in shared.items():
                if target in spec.kv_cache_specs:
                    spec.kv_cache_specs.setdefault(name, spec.kv_cache_specs[target])


def __getattr__(name: str):
    """vLLM resolves `worker_cls` by name in each worker process: rebuild a composed class."""
    return resolve(KVEvictWorker, name)


# The class each platform's `check_and_update_config` sets for `worker_cls="auto"` (contract-
# tested against vLLM's platform modules); another platform's must subclass vLLM's Worker.
PLATFORM_WORKERS = {"cpu": "vllm.v1.worker.cpu_worker.CPUWorker",
                    "cuda": "vllm.v1.worker.gpu_worker.Worker",
                    "rocm": "vllm.v1.worker.gpu_worker.Worker",
                    "xpu": "vllm.v1.worker.xpu_worker.XPUWorker"}


def install(vllm_config) -> None:
    """Make vLLM build our worker: over the platform's worker class, or over the user's
    `--worker-cls`. Raises KVPolicyError when the user's class is not a subclass of the
    platform's."""
    stock = import_class(PLATFORM_WORKERS.get(support.platform_name(),
                                              "vllm.v1.worker.gpu_worker.Worker"))
    parallel = vllm_config.parallel_config
    parallel.worker_cls = install_over(KVEvictWorker, stock, parallel.worker_cls,
                                       f"--worker-cls {parallel.worker_cls}")
