"""The operator's live view of the KV pool, served at GET /kv: one self-contained HTML page
(live.html beside this file: inline JS and SVG, no external resources) that polls
GET /v1/kv_stats/timeline every second. An optional ?key=<api key> in the page's URL is sent as
`Authorization: Bearer <key>` (servers started with --api-key)."""

from __future__ import annotations

from importlib import resources


def page() -> str:
    """The HTML of the live page (read on each call: it is small, and edits show without restart)."""
    return resources.files(__package__).joinpath("live.html").read_text(encoding="utf-8")
