"""Schedule the requests of one run: a fixed number in flight (closed loop) or Poisson arrivals
(open loop), always bounded by both the request count and the wall-clock duration.

At the duration bound no new request starts and the ones in flight are abandoned (counted as
`cancelled`), so the run ends by itself even against a hung server.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from tqdm import tqdm

from loadtest.client import RequestResult, make_http_client, send_request
from loadtest.monitors import MetricsSampler, RssSampler
from loadtest.workloads import Prompt


@dataclass(frozen=True)
class LoadSettings:
    base_url: str  # already checked by loadtest.loopback.check_base_url
    model: str
    concurrency: int | None = 1  # closed loop: requests in flight
    rate: float | None = None  # open loop: Poisson arrivals per second (replaces concurrency)
    max_duration_s: float = 300.0
    request_timeout_s: float | None = None  # whole request; defaults to max_duration_s
    ignore_eos: bool = True
    arrival_seed: int = 0  # seeds the Poisson arrival times
    server_pid: int | None = None  # sample this process tree's RSS
    scrape_metrics: bool = True
    progress: bool = True

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.rate is None):
            raise ValueError("give exactly one of concurrency and rate")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.rate is not None and not self.rate > 0:
            raise ValueError(f"rate must be > 0, got {self.rate}")
        if not self.max_duration_s > 0:
            raise ValueError(f"max_duration_s must be > 0, got {self.max_duration_s}")


@dataclass
class RunData:
    results: list[RequestResult]
    num_requests: int
    duration_s: float
    started_at: str
    metrics: dict[str, Any] | None = None
    memory: dict[str, Any] | None = None


def poisson_arrivals(n: int, rate: float, seed: int) -> np.ndarray:
    """Start offsets (s) of n requests with exponential gaps; the first starts at 0."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n)
    return np.concatenate(([0.0], np.cumsum(gaps[1:])))


async def run_load(prompts: list[Prompt], settings: LoadSettings) -> RunData:
    loop = asyncio.get_running_loop()
    timeout = settings.request_timeout_s or settings.max_duration_s
    results: list[RequestResult] = []
    bar = tqdm(total=len(prompts), disable=not settings.progress, unit="req",
               desc=f"{settings.model} " + (f"c={settings.concurrency}"
                                             if settings.rate is None else f"rate={settings.rate}"))
    async with make_http_client(timeout) as client:
        samplers: list[MetricsSampler | RssSampler] = []
        if settings.scrape_metrics:
            samplers.append(MetricsSampler(client, settings.base_url))
        if settings.server_pid is not None:
            samplers.append(RssSampler(settings.server_pid))
        started_at = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
        t0 = time.perf_counter()  # timelines and request starts are relative to this
        for s in samplers:
            await s.start(t0)
        load_start, load_start_loop = time.perf_counter(), loop.time()
        deadline = load_start_loop + settings.max_duration_s

        async def one(prompt: Prompt) -> None:
            res = await send_request(client, settings.base_url, settings.model, prompt, t0,
                                     deadline, timeout, settings.ignore_eos)
            results.append(res)
            bar.update(1)

        if settings.rate is None:
            pending = iter(prompts)

            async def worker() -> None:
                for prompt in pending:  # one shared iterator: each prompt is sent once
                    if loop.time() >= deadline:
                        return
                    await one(prompt)

            await asyncio.gather(*(worker() for _ in range(settings.concurrency)))
        else:
            tasks = []
            offsets = poisson_arrivals(len(prompts), settings.rate, settings.arrival_seed)
            for prompt, offset in zip(prompts, offsets):
                start_at = load_start_loop + offset
                if start_at >= deadline:
                    break
                await asyncio.sleep(max(0.0, start_at - loop.time()))
                tasks.append(asyncio.create_task(one(prompt)))
            await asyncio.gather(*tasks)
        duration = time.perf_counter() - load_start
        for s in samplers:
            await s.stop()
    bar.close()
    metrics = next((s.summary() for s in samplers if isinstance(s, MetricsSampler)), None)
    memory = next((s.summary() for s in samplers if isinstance(s, RssSampler)), None)
    results.sort(key=lambda r: r.index)
    return RunData(results, len(prompts), duration, started_at, metrics, memory)


def run(prompts: list[Prompt], settings: LoadSettings) -> RunData:
    """Synchronous entry point."""
    return asyncio.run(run_load(prompts, settings))
