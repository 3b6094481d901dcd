"""Pipeline parallel stays refused with every policy (`features.parallel_error`): vLLM CPU 0.32's
own pipeline parallel fails on its first request, without the plugin. This test holds that
fact against stock vLLM; when it fails, vLLM has fixed it and pipeline parallel can be built
(per-stage KV-cache specs: each stage declares its own layers' heads and groups)."""

from __future__ import annotations

import httpx
import pytest

from conftest import SERVED_NAME, start_server


@pytest.mark.server
@pytest.mark.serial  # a stage per core
@pytest.mark.slow
@pytest.mark.served_release
def test_stock_vllm_cpu_pipeline_parallel_fails_on_its_first_request(bundled_model_dir):
    # VLLM_PLUGINS names the plugins allowed to load; naming none of ours gives stock vLLM
    server = start_server(bundled_model_dir, ["--pipeline-parallel-size", "2"],
                          env={"VLLM_PLUGINS": "no-such-plugin",
                               "VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    r = httpx.post(server.base_url + "/v1/completions", timeout=300, trust_env=False,
                   json={"model": SERVED_NAME, "prompt": "The capital of France is",
                         "max_tokens": 4, "temperature": 0})
    log = server.log_tail(10 ** 7)
    assert "Worker_PP1" in log  # two stages really ran
    # the second stage expects the first stage's intermediate tensors and has none
    assert r.status_code == 500, r.text
    assert "sync_and_gather_intermediate_tensors" in log and "AssertionError" in log
