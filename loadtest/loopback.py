"""Refuse to load-test a remote host by accident: only loopback targets pass without opt-in.

A load test is a small denial of service; pointing it at a shared server by a typo should fail
loudly instead. Host names are not resolved (DNS could say anything), so only the literal name
`localhost` and loopback IP literals (127.0.0.0/8, ::1) count as loopback.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit


class RemoteURLError(ValueError):
    """The base URL is not loopback and --allow-remote was not given."""


def is_loopback_host(host: str) -> bool:
    host = host.strip("[]").lower()
    if host == "localhost":
        return True
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


def check_base_url(url: str, allow_remote: bool = False) -> str:
    """Validate and normalise a server base URL (scheme://host:port, no trailing /v1 or slash)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"base URL must look like http://HOST:PORT, got {url!r}")
    if not allow_remote and not is_loopback_host(parts.hostname):
        raise RemoteURLError(
            f"refusing non-loopback base URL {url!r} (host {parts.hostname!r}); "
            "pass --allow-remote to load-test a remote server")
    base = url.rstrip("/")
    if base.endswith("/v1"):
        base = base[: -len("/v1")]
    return base
