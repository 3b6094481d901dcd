"""The live KV-pool page (server/live.html, served at GET /kv) in a real headless Chromium,
against a stdlib HTTP server that serves the page and fake GET /v1/kv_stats/timeline JSON in the
endpoint's format (it changes on every call: three requests growing over time). No vLLM here: the
test against a real server lives with the server tests."""

from __future__ import annotations

import contextlib
import http.server
import json
import re
import threading
from html.parser import HTMLParser
from urllib.parse import parse_qs, urlparse

import pytest

from browser import Dom, ensure_chromium, polls, render
from server.live import page

T0 = 1764000000.0
MiB = 1 << 20
BYTES_PER_BLOCK = [393216, 196608]


class FakeTimeline:
    """The endpoint's JSON on a fake clock that moves 1 s per call (60 s of history at the first).

    cmpl-a finishes ("stop") at T0+40, cmpl-b starts at T0+30, cmpl-c at T0+55; points and samples
    every 0.5 s; a request holds min(full, 3 MiB + 10 % of full) under the fake policy."""

    REQS = [("cmpl-a-0", "cmpl-a-0-1a2b", 5.0, 40.0, "stop"),
            ("cmpl-b-0", "cmpl-b-0-3c4d", 30.0, None, None),
            ("cmpl-c-0", "cmpl-c-0-5e6f", 55.0, None, None)]

    def __init__(self, empty: bool = False, api_key: str | None = None, engines: bool = False):
        self.empty, self.api_key, self.engines = empty, api_key, engines
        self.calls: list[dict] = []   # since and Authorization of every timeline call

    @staticmethod
    def full_bytes(first: float, t: float) -> float:
        return min(t - first, 8.0) * 2.5 * MiB + max(t - first - 8.0, 0.0) * 0.1 * MiB

    @classmethod
    def points(cls, first: float, end: float | None, now: float) -> list[list[float]]:
        pts, t = [], T0 + first
        while t <= min(now, T0 + end if end else now) + 1e-9:
            full = cls.full_bytes(T0 + first, t)
            pts.append([t, min(full, 3 * MiB + 0.1 * full), full])
            t += 0.5
        return pts

    def body(self, since: float) -> dict:
        now = T0 + 60 + len(self.calls) - 1
        base = {"now": now, "policy": "prulong",
                "params": {"sparsity": 0.7, "sink": 16, "window": 64, "eviction": "naive"},
                "pool": {"num_blocks": None if self.empty else 1200,
                         "group_names": ["full heads", "streaming heads"],
                         "bytes_per_block": BYTES_PER_BLOCK, "block_size": 16}}
        if self.empty:
            return {**base, "samples": [], "requests": []}
        reqs, samples = [], []
        for rid, eid, first, end, reason in self.REQS:
            if T0 + first > now:
                continue
            finished = end is not None and T0 + end <= now
            reqs.append({"request_id": rid, "engine_request_id": eid, "first_t": T0 + first,
                         "finished": finished, "finish_reason": reason if finished else None,
                         "points": [p for p in self.points(first, end, now) if p[0] > since]})
        t = T0
        while t <= now:
            live = [r for r in self.REQS if T0 + r[2] <= t and (r[3] is None or t <= T0 + r[3])]
            held = sum(min(self.full_bytes(T0 + r[2], t), 3 * MiB + 0.1 * self.full_bytes(T0 + r[2], t))
                       for r in live)
            used = [round(3 * held / BYTES_PER_BLOCK[0]) + 20, round(7 * held / BYTES_PER_BLOCK[1]) + 30]
            if t > since:
                samples.append({"t": t, "blocks_used": used, "running": len(live),
                                "waiting": 1 if T0 + 28 <= t < T0 + 31 else 0,
                                "usage": sum(used) / 1200})
            t += 0.5
        view = {**base, "samples": samples, "requests": reqs}
        if self.engines:  # data parallel: engine 1 serves only cmpl-c, in a pool of 600 blocks
            one = {"pool": {**base["pool"], "num_blocks": 600}, "samples": samples[-3:],
                   "requests": [r for r in reqs if r["request_id"] == "cmpl-c-0"]}
            view["engines"] = {"0": {k: view[k] for k in ("pool", "samples", "requests")},
                               "1": one}
        return view


@contextlib.contextmanager
def serve(timeline: FakeTimeline):
    """A stdlib server on a free loopback port: GET /kv (the page), GET /v1/kv_stats/timeline."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            url = urlparse(self.path)
            status, ctype = 200, "application/json"
            if url.path == "/kv":
                body, ctype = page().encode(), "text/html; charset=utf-8"
            elif url.path == "/v1/kv_stats/timeline":
                auth = self.headers.get("Authorization")
                if timeline.api_key and auth != f"Bearer {timeline.api_key}":
                    status, body = 401, b'{"error": "Unauthorized"}'
                else:
                    since = float(parse_qs(url.query).get("since", ["0"])[0])
                    timeline.calls.append({"since": since, "auth": auth})
                    body = json.dumps(timeline.body(since)).encode()
            else:
                status, body = 404, b'{"detail": "Not Found"}'
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)


@pytest.fixture(scope="module")
def chromium() -> str:
    return ensure_chromium()


def trapezoid(pts, k):
    return sum((b[0] - a[0]) * (a[k] + b[k]) / 2 for a, b in zip(pts, pts[1:]))


@pytest.mark.browser
def test_page_draws_requests_from_timeline_json(chromium):
    timeline = FakeTimeline()
    with serve(timeline) as base:
        html = render(f"{base}/kv")
    assert polls(html) >= 2, f"the page polled {polls(html)} times"
    dom = Dom(html)
    assert dom.by_id("status").text.startswith("live"), dom.by_id("status").text
    # incremental polling: the first asks for everything, later ones only for what is new
    assert timeline.calls[0]["since"] == 0 and timeline.calls[1]["since"] > T0, timeline.calls[:2]

    held = {e.attrs["data-request"]: e for e in dom.by_class("req-curve", "path")}
    full = {e.attrs["data-request"]: e for e in dom.by_class("req-full", "path")}
    assert len(held) >= 2 and set(held) == set(full) == {r[1] for r in FakeTimeline.REQS}
    # the finished request's points, appended across polls without duplicates (0.5 s apart, 35 s)
    assert len(re.findall(r"[ML]", held["cmpl-a-0-1a2b"].attrs["d"])) == 71

    areas = dom.by_class("pool-area", "path")
    assert [a.attrs["data-group"] for a in areas] == ["full heads", "streaming heads"]
    assert dom.by_class("pool-running") and dom.by_class("pool-waiting")

    assert dom.by_id("policy").text == "prulong" and "sparsity=0.7" in dom.by_id("params").text
    assert dom.by_id("c-seen").text == "3" and dom.by_id("c-finished").text == "1"
    rows = {e.attrs["data-request"]: e for e in dom.elements if e.tag == "tr" and "data-request" in e.attrs}
    assert list(rows) == ["cmpl-c-0-5e6f", "cmpl-b-0-3c4d", "cmpl-a-0-1a2b"]   # most recent first
    pts = FakeTimeline.points(5.0, 40.0, T0 + 100)
    cells = [e.text for e in dom.elements if e.tag == "td"][-6:]      # the last row: cmpl-a
    assert cells[1:] == ["cmpl-a-0", "stop", f"{max(p[1] for p in pts) / MiB:.2f}",
                         f"{max(p[2] for p in pts) / MiB:.2f}",
                         f"{trapezoid(pts, 1) / trapezoid(pts, 2):.3f}"], cells


@pytest.mark.browser
def test_page_draws_the_engine_chosen_in_its_url(chromium):
    """Data parallel: the timeline carries every engine core's pool under `engines`; the page
    draws the one named by ?engine= (default 0) and links to the others."""
    with serve(FakeTimeline(engines=True)) as base:
        zero = Dom(render(f"{base}/kv"))
        one = Dom(render(f"{base}/kv?engine=1"))
    assert zero.by_id("pool").text.startswith("1200 blocks")
    assert zero.by_id("engine").text == "engine 0 1"
    assert one.by_id("pool").text.startswith("600 blocks")
    rows = [e.attrs["data-request"] for e in one.elements
            if e.tag == "tr" and "data-request" in e.attrs]
    assert rows == ["cmpl-c-0-5e6f"]
    assert any(e.tag == "a" and e.attrs.get("href", "").endswith("engine=0")
               for e in one.elements)


@pytest.mark.browser
def test_page_without_pool_size_or_requests(chromium):
    with serve(FakeTimeline(empty=True)) as base:
        dom = Dom(render(f"{base}/kv"))
    assert int(dom.body().attrs["data-polls"]) >= 2
    assert dom.by_id("status").text.startswith("live"), dom.by_id("status").text
    assert not dom.by_class("req-curve") and not dom.by_class("pool-area")
    assert "no requests yet" in dom.by_id("req-table").text
    assert "pool size unknown" in dom.by_id("occ-unit").text


@pytest.mark.browser
def test_page_sends_key_and_explains_401(chromium):
    timeline = FakeTimeline(api_key="s3cret")
    with serve(timeline) as base:
        refused = Dom(render(f"{base}/kv", wait_ms=1500))
        dom = Dom(render(f"{base}/kv?key=s3cret", wait_ms=1500))
    status = refused.by_id("status")
    assert "401" in status.text and "?key=" in status.text and "err" in status.classes()
    assert int(refused.body().attrs["data-poll-errors"]) >= 1
    assert dom.by_id("status").text.startswith("live") and dom.by_class("req-curve")
    assert timeline.calls and all(c["auth"] == "Bearer s3cret" for c in timeline.calls)


def test_page_is_self_contained_html():
    html = page()
    assert html.lstrip().lower().startswith("<!doctype html>")
    for bad in ('src="http', "src='http", 'href="http', "href='http", "@import", "url(http"):
        assert bad not in html, bad

    class Balance(HTMLParser):
        VOID = {"meta", "link", "br", "hr", "img", "input"}

        def __init__(self):
            super().__init__()
            self.stack, self.errors, self.ids = [], [], []

        def handle_starttag(self, tag, attrs):
            self.ids += [v for k, v in attrs if k == "id"]
            if tag not in self.VOID:
                self.stack.append(tag)

        def handle_endtag(self, tag):
            if not self.stack or self.stack.pop() != tag:
                self.errors.append(tag)

    p = Balance()
    p.feed(html)
    p.close()
    assert not p.errors and not p.stack, (p.errors, p.stack)
    assert {"status", "occ", "req", "req-table"} <= set(p.ids) and len(p.ids) == len(set(p.ids))
