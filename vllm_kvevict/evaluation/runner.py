"""Drive live `vllm serve` processes over an evaluation grid and append one JSONL record per
(setting, example).

- One server at a time (two cores), started through vllm_kvevict.launch (own process group, log
  file, stopped on exit or Ctrl-C). A server is started only when one of its requests is still
  missing from the results file, so a resumed run skips finished servers entirely.
- Order per chunk size: full, streaming, then each sweep; a sweep with bisection asks
  grid.next_sparsities for its next points after each round, using the categories' scores so
  far and 90 % of full attention's score at the same chunk as thresholds. Its first round
  includes every point an earlier run measured (grid.first_round), so examples added by a
  resumed run get the same points as the older ones.
- Requests go one at a time by default: with several in flight, vLLM's token budget is shared
  and a prompt's prefill chunks no longer fall at multiples of the chunk size, which changes
  what the evicting policies keep. `--concurrency` > 1 is allowed (the footprint is computed
  from the boundaries the server really used and recorded), but results then depend on timing.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import socket
import sys
import time
import uuid
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

import httpx
from tqdm import tqdm

from vllm_kvevict.launch import ServerProcess, build_server_command
from vllm_kvevict.evaluation.client import (SERVED_NAME, complete, example_id, gold_fields,
                                            gold_logprobs, is_current, to_record)
from vllm_kvevict.evaluation.critical import FRACTION
from vllm_kvevict.evaluation.grid import (HEAD_MASK, GridSpec, base_method, head_policy,
                                          kv_cache_dtype, per_point, ServerConfig, Setting, Sweep,
                                          file_digest, first_round, next_sparsities,
                                          worst_case_points)
from vllm_kvevict.evaluation.tasks import Example
from vllm_kvevict.masks import default_mask_path

# Prefix caching off for every policy (the evicting ones turn it off themselves): generated
# prompts share their opening blocks, and a cache hit would make `full` chunk differently.
SERVE_EXTRA = ["--dtype", "float32", "--served-model-name", SERVED_NAME, "--max-model-len",
               "8192", "--seed", "0", "--no-enable-prefix-caching"]


class ResultStore:
    """The JSONL results file: existing records are loaded, new ones appended and flushed one
    by one (a killed run loses at most the requests in flight). A later record of the same
    (setting, example) replaces an earlier one (a log-prob added to a run without them). A
    record that a task's larger generation budget supersedes (client.is_current) stays in the
    file but counts as not done."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._latest: dict[tuple[str, str], dict] = {}
        self.superseded: dict[tuple[str, str], dict] = {}
        self.lines = 0  # records read or written, superseded and replaced ones included
        if path.exists():
            for line_no, line in enumerate(path.read_text().splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    # A line cut by a kill mid-write: drop it, the request runs again.
                    print(f"warning: {path}:{line_no} is not JSON; ignored", file=sys.stderr)
                    continue
                self._remember(record)
        path.parent.mkdir(parents=True, exist_ok=True)

    def _remember(self, record: dict) -> None:
        self.lines += 1
        if not is_current(record):
            self.superseded[(record["setting"], record["example"])] = record
            return
        self._latest[(record["setting"], record["example"])] = record

    @property
    def records(self) -> list[dict]:
        return list(self._latest.values())

    def get(self, setting: Setting, example: Example) -> dict | None:
        return self._latest.get((setting.key, example_id(example)))

    def has(self, setting: Setting, example: Example) -> bool:
        return self.get(setting, example) is not None

    def add(self, record: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        self._remember(record)

    def of_setting(self, setting: Setting, examples: Sequence[Example]) -> list[dict]:
        wanted = {example_id(e) for e in examples}
        return [r for (key, ex), r in self._latest.items() if key == setting.key
                and ex in wanted]


def category_scores(records: Sequence[dict]) -> dict[str, float]:
    """Category -> mean over its tasks of the task's mean score (as the report computes)."""
    per_task: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        per_task[r["category"]][r["task"]].append(r["score"])
    return {c: sum(sum(v) / len(v) for v in tasks.values()) / len(tasks)
            for c, tasks in per_task.items()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kv_bytes_per_token(model_dir: str) -> int:
    """float32 K and V of every layer and KV head: what full attention holds per token."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 2 * 4


class Runner:
    def __init__(self, spec: GridSpec, examples: Sequence[Example], store: ResultStore,
                 model_dir: str, log_dir: Path, concurrency: int = 1,
                 kv_cache_bytes: int | None = None, reserved_cpus: str = "1",
                 request_timeout_s: float = 900.0, progress: bool = True,
                 logprobs: bool = True) -> None:
        self.spec, self.examples, self.store = spec, list(examples), store
        self.logprobs = logprobs  # a second request per example: the gold answer's log-prob
        self.model_dir, self.log_dir = model_dir, log_dir
        self.concurrency = max(1, concurrency)
        self.reserved_cpus = reserved_cpus
        self.request_timeout_s = request_timeout_s
        longest = max(e.length + max(e.max_tokens, len(e.gold_ids)) for e in self.examples)
        # Room for every request in flight at full size (no preemption), at least 512 MiB.
        need = int(1.25 * self.concurrency * (longest + 128) * kv_bytes_per_token(model_dir))
        self.kv_cache_bytes = kv_cache_bytes or max(512 << 20, need)
        self.categories = sorted({e.category for e in self.examples})
        self.run_id = time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]
        self.server_starts = 0
        self.requests_run = 0
        self.request_seconds: dict[int, list[float]] = defaultdict(list)
        self.bar = tqdm(total=self.planned_requests(), unit="req", disable=not progress,
                        dynamic_ncols=True)

    # ---------------------------------------------------------------------------- planning

    def planned_requests(self) -> int:
        per = len(self.examples)
        total = 0
        for chunk in self.spec.chunks:
            total += per * len(self.spec.fixed_settings(chunk))
            for sweep in self.spec.sweeps(chunk):
                total += per * worst_case_points(len(sweep.candidates), len(self.categories),
                                                 self.spec.bisect)
        return total

    def resolve_mask(self, sweep: Sweep, sparsity: float) -> tuple[str, str]:
        """(mask path, digest) served for a head-mask point: the sweep's mask, else the one
        the server would pick for this sparsity (passed explicitly so the record names it)."""

        head = head_policy(sweep.policy)
        path = sweep.mask or default_mask_path(self.model_dir, head, sparsity)
        if path is None:
            raise FileNotFoundError(f"no {head} head mask for {self.model_dir}; pass "
                                    f"--mask {head}=PATH")
        return str(path), file_digest(path)

    def sweep_setting(self, sweep: Sweep, sparsity: float) -> Setting:
        if not per_point(sweep.policy):
            return sweep.setting(sparsity)
        if sparsity == 1.0 and base_method(sweep.policy) in HEAD_MASK:
            # every head streaming: the mask does not matter (the cache dtype does)
            dtype = kv_cache_dtype(sweep.policy)
            return Setting(ServerConfig("streaming" if dtype == "auto" else f"streaming@{dtype}",
                                        sweep.chunk))
        path, digest = self.resolve_mask(sweep, sparsity)
        return Setting(ServerConfig(sweep.policy, sweep.chunk, sparsity, sweep.eviction, path,
                                    sweep.token_sparsity), sparsity, digest)

    # ----------------------------------------------------------------------------- running

    def run(self) -> None:
        try:
            for chunk in self.spec.chunks:
                for setting in self.spec.fixed_settings(chunk):
                    with self.server(setting.server) as server:
                        self.run_setting(server, setting)
                for sweep in self.spec.sweeps(chunk):
                    self.run_sweep(sweep)
        finally:
            self.bar.close()

    def run_sweep(self, sweep: Sweep) -> None:
        full = self.store.of_setting(Setting(ServerConfig("full", sweep.chunk)), self.examples)
        thresholds = {c: FRACTION * s for c, s in category_scores(full).items()}
        candidates = list(sweep.candidates)
        measured: dict[float, dict[str, float]] = {}
        if sweep.policy in HEAD_MASK:
            streaming = self.store.of_setting(self.sweep_setting(sweep, 1.0), self.examples)
            if streaming:
                candidates.append(1.0)
                measured[1.0] = category_scores(streaming)
        if self.spec.bisect and not thresholds:
            raise RuntimeError(f"bisection of {sweep.label} at chunk {sweep.chunk} needs the "
                               f"full-attention results at that chunk (method 'full')")
        budget = worst_case_points(len(sweep.candidates), len(self.categories),
                                   self.spec.bisect)
        seen = [s for s in sweep.candidates
                if self.store.of_setting(self.sweep_setting(sweep, s), self.examples)]
        pending = first_round(sweep.candidates, seen, thresholds, self.spec.bisect)
        if not pending:
            return
        run_points = 0
        # Token eviction: one server for the whole sweep; head masks: one per point.
        shared = not per_point(sweep.policy)
        with self.server(self.sweep_setting(sweep, pending[0]).server, enabled=shared) as srv:
            while pending:
                for sparsity in pending:
                    setting = self.sweep_setting(sweep, sparsity)
                    if shared:
                        self.run_setting(srv, setting)
                    else:
                        with self.server(setting.server) as own:
                            self.run_setting(own, setting)
                    measured[sparsity] = category_scores(
                        self.store.of_setting(setting, self.examples))
                    run_points += 1
                pending = (next_sparsities(candidates, measured, thresholds)
                           if self.spec.bisect else [])
        # Bisection needed fewer points than planned: shrink the bar's total.
        unused = max(0, budget - run_points) * len(self.examples)
        if unused:
            self.bar.total = max(self.bar.n, self.bar.total - unused)
            self.bar.refresh()

    @contextmanager
    def server(self, config: ServerConfig, enabled: bool = True) -> Iterator["LazyServer"]:
        lazy = LazyServer(self, config, enabled)
        try:
            yield lazy
        finally:
            lazy.stop()

    def run_setting(self, server: "LazyServer", setting: Setting) -> None:
        # A run with log-probs completes the records of a run without them (one request each).
        todo = [e for e in self.examples if not self.store.has(setting, e) or (
            self.logprobs and self.store.get(setting, e).get("gold_logprob") is None)]
        self.bar.update(len(self.examples) - len(todo))
        if not todo:
            return
        self.bar.set_postfix_str(setting.key, refresh=False)
        base_url = server.ensure_started()
        timeout = httpx.Timeout(self.request_timeout_s, connect=10.0)
        with httpx.Client(timeout=timeout, trust_env=False) as client:
            pool = cf.ThreadPoolExecutor(self.concurrency)
            try:
                futures = {pool.submit(self.request, client, base_url, setting, e): e
                           for e in todo}
                for future in cf.as_completed(futures):
                    record, seconds = future.result()
                    self.store.add(record)
                    self.requests_run += 1
                    self.request_seconds[futures[future].length].append(seconds)
                    self.bar.update(1)
            finally:
                # Ctrl-C or kill: drop the queued requests, wait only for the ones in flight.
                pool.shutdown(wait=True, cancel_futures=True)

    def request(self, client: httpx.Client, base_url: str, setting: Setting,
                example: Example) -> tuple[dict, float]:
        """One example's record (and the seconds it took) on a running server."""
        start = time.monotonic()
        done = self.store.get(setting, example)
        if done is not None:  # only its gold log-prob is missing
            gold = gold_logprobs(client, base_url, example, setting)
            return dict(done, **gold_fields(gold), gold_run=self.run_id), \
                time.monotonic() - start
        response = complete(client, base_url, example, setting)
        # A superseded record's gold log-prob stands: it does not depend on the generation
        # budget (prompt, gold answer and policy are the same).
        old = self.store.superseded.get((setting.key, example_id(example)), {})
        carried = old.get("gold_logprob") is not None
        gold = (gold_logprobs(client, base_url, example, setting)
                if self.logprobs and not carried else None)
        record = to_record(example, setting, response, self.run_id, gold)
        if carried:
            record.update(gold_logprob=old["gold_logprob"], gold_tokens=old["gold_tokens"])
        return record, time.monotonic() - start


class LazyServer:
    """A server config that is started on first use and stopped by the runner."""

    def __init__(self, runner: Runner, config: ServerConfig, enabled: bool = True) -> None:
        self.runner, self.config, self.enabled = runner, config, enabled
        self.process: ServerProcess | None = None
        self.base_url = ""

    def argv(self, port: int) -> list[str]:
        c = self.config
        spec = c.policy_spec()
        # vLLM refuses a token budget below max_num_seqs (CPU default 128): keep it small so
        # chunks down to 16 tokens are accepted.
        extra = list(SERVE_EXTRA) + ["--max-num-seqs", str(max(16, self.runner.concurrency))]
        extra += ["--kv-mask", c.mask] if c.mask else []
        extra += c.server_args
        return build_server_command(self.runner.model_dir, spec,
                                    kv_cache_bytes=self.runner.kv_cache_bytes,
                                    max_batched_tokens=c.chunk, port=port, extra_args=extra)

    def ensure_started(self) -> str:
        if not self.enabled:
            raise RuntimeError("this sweep starts one server per point")
        if self.process is None:
            port = free_port()
            env = ({"VLLM_CPU_NUM_OF_RESERVED_CPU": self.runner.reserved_cpus}
                   if self.runner.reserved_cpus else {})
            log = self.runner.log_dir / f"server_{self.config.slug}.log"
            self.base_url = f"http://127.0.0.1:{port}"
            self.process = ServerProcess(self.argv(port), log, env=env)
            self.runner.server_starts += 1
            try:
                self.process.wait_healthy(self.base_url, timeout_s=600.0)
            except BaseException:
                self.stop()
                raise
        return self.base_url

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()
            self.process = None
