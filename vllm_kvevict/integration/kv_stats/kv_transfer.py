"""The engine's KV-transfer config (`--kv-transfer-config`), decided in the API-server process
before the engine starts: our stats connector alone, or beside the user's connector(s) under
vLLM's `MultiConnector`. `validation.py` refuses an evicting policy next to a user connector.
"""

from __future__ import annotations

import dataclasses
import logging
import os

logger = logging.getLogger("vllm.kvevict")  # under vLLM's logger: its handler and format

CONNECTOR_CLASS = "KVEvictStatsConnector"
CONNECTOR_MODULE = "vllm_kvevict.integration.kv_stats.stats_connector"
ENV_DISABLE = "VLLM_KVEVICT_STATS"  # "0" turns the stats connector off


OURS = {"kv_connector": CONNECTOR_CLASS, "kv_connector_module_path": CONNECTOR_MODULE}
MULTI = "MultiConnector"  # vLLM's: runs several connectors in one engine


def _children(ktc) -> list[dict]:
    if ktc is None or ktc.kv_connector != MULTI:
        return []
    return list((ktc.kv_connector_extra_config or {}).get("connectors") or [])


def _is_ours(entry) -> bool:
    get = entry.get if isinstance(entry, dict) else lambda k: getattr(entry, k, None)
    return (get("kv_connector") == CONNECTOR_CLASS
            and get("kv_connector_module_path") == CONNECTOR_MODULE)


def is_ours(kv_transfer_config) -> bool:
    """Our stats connector is the engine's connector or one of MultiConnector's."""
    return kv_transfer_config is not None and (
        _is_ours(kv_transfer_config) or any(_is_ours(c) for c in _children(kv_transfer_config)))


def user_connectors(kv_transfer_config) -> list[str]:
    """The KV connectors the user configured (ours excluded)."""
    ktc = kv_transfer_config
    if ktc is None or not ktc.kv_connector or _is_ours(ktc):
        return []
    if ktc.kv_connector == MULTI:
        return [c.get("kv_connector", "?") for c in _children(ktc) if not _is_ours(c)]
    return [ktc.kv_connector]


def stats_status(vllm_config) -> tuple[bool, str]:
    """(kv_stats enabled on this server, why not)."""
    if is_ours(getattr(vllm_config, "kv_transfer_config", None)):
        return True, ""
    if os.environ.get(ENV_DISABLE, "1") == "0":
        return False, f"{ENV_DISABLE}=0"
    return False, "stats connector not configured"


def inject_config(engine_args) -> None:
    """Give the engine our stats connector: alone, or beside the user's connector(s) through
    vLLM's MultiConnector (which runs each, and merges their kv_transfer_params)."""
    from vllm.config.kv_transfer import KVTransferConfig

    if os.environ.get(ENV_DISABLE, "1") == "0":
        return
    ktc = engine_args.kv_transfer_config
    if isinstance(ktc, dict):
        ktc = KVTransferConfig(**ktc)
    if ktc is None or not ktc.kv_connector:
        engine_args.kv_transfer_config = KVTransferConfig(**OURS, kv_role="kv_producer")
        return
    if is_ours(ktc):
        return
    extra = dict(ktc.kv_connector_extra_config or {})
    if ktc.kv_connector == MULTI:
        extra["connectors"] = [*_children(ktc), dict(OURS, kv_role=ktc.kv_role)]
    else:
        user = {f.name: getattr(ktc, f.name) for f in dataclasses.fields(ktc)
                if f.init and f.name != "engine_id"}
        extra = {"connectors": [user, dict(OURS, kv_role=ktc.kv_role)]}
    engine_args.kv_transfer_config = KVTransferConfig(
        kv_connector=MULTI, kv_role=ktc.kv_role, kv_connector_extra_config=extra,
        engine_id=ktc.engine_id)
    logger.info("vllm-kvevict: kv_stats beside the user's KV connector(s) %s through vLLM's "
                "MultiConnector", user_connectors(ktc))
