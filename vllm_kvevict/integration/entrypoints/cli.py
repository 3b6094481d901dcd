"""`vllm serve --kv-policy ...`: our flags on vLLM's own parser, carried in `additional_config`.

vLLM builds the serve parser with `EngineArgs.add_cli_args` and copies only its dataclass fields
in `from_cli_args`, so we wrap both: the first adds an argument group, the second folds the
parsed values into `additional_config["kv_policy"]` and validates them before any model loads.
`--additional-config '{"kv_policy": {...}}'` is the equivalent stable form; flags win over it.
The flags themselves are a plain table (`vllm_kvevict/flags.py`).
"""

from __future__ import annotations

import argparse
import copy

from vllm_kvevict.config import KVPolicyConfig, KVPolicyError
from vllm_kvevict.flags import FLAGS, fail, flag_message
from vllm_kvevict.integration.entrypoints.api_server import share_between_api_servers
from vllm_kvevict.integration.plugins.support import current_activation
from vllm_kvevict.served import ADDITIONAL_CONFIG_KEY


def add_kv_policy_args(parser: argparse.ArgumentParser) -> None:
    if any(a.dest == "kv_policy" for a in parser._actions):  # idempotent
        return
    group = parser.add_argument_group(
        "vllm-kvevict", "KV-cache eviction (PruLong paper). Equivalent JSON form: "
                        "--additional-config '{\"kv_policy\": {\"policy\": \"prulong\", "
                        "\"sparsity\": 0.7}}'.")
    for flag, (field, typ, help_text) in FLAGS.items():
        group.add_argument(flag, dest="kv_" + field if field != "policy" else "kv_policy",
                           type=typ, default=argparse.SUPPRESS, help=help_text)


def policy_from_args(args: argparse.Namespace, additional_config: dict | None) -> dict | None:
    """Merged, validated kv_policy dict (or None when neither form is used)."""
    base = dict((additional_config or {}).get(ADDITIONAL_CONFIG_KEY) or {})
    if isinstance((additional_config or {}).get(ADDITIONAL_CONFIG_KEY), str):
        base = {"policy": additional_config[ADDITIONAL_CONFIG_KEY]}
    for _flag, (field, _typ, _help) in FLAGS.items():
        dest = "kv_" + field if field != "policy" else "kv_policy"
        value = getattr(args, dest, None)
        if value is not None:
            base[field] = value
    if not base:
        return None
    try:
        return KVPolicyConfig.from_dict(base).to_dict()
    except KVPolicyError as exc:
        raise KVPolicyError(flag_message(exc), exc.field) from None


def fold_into_engine_args(engine_args, args: argparse.Namespace) -> None:
    additional = engine_args.additional_config
    if additional is None or not isinstance(additional, dict):
        additional = {}
    try:
        policy = policy_from_args(args, additional)
    except KVPolicyError as exc:
        fail(str(exc))
    inactive_reason = current_activation()[0]
    if policy is not None and inactive_reason is not None:
        fail(f"--kv-* flags need an active plugin, and it is inactive here: {inactive_reason}")
    # several API servers (vLLM's default with --data-parallel-size) share one kv_stats log
    share_between_api_servers(getattr(args, "api_server_count", None))
    if policy is not None:
        engine_args.additional_config = {**additional, ADDITIONAL_CONFIG_KEY: policy}
        # and in the parsed args, as the JSON form: the API-server processes vLLM's launcher
        # starts build their config from these args before our plugin has loaded there (a
        # copy: the fast layout is chosen later, in each process, on its own engine args)
        args.additional_config = {**additional, ADDITIONAL_CONFIG_KEY: copy.deepcopy(policy)}


# -- EngineArgs hooks (registration.py) ---------------------------------------------------------

def add_cli_args(stock_add_cli_args, parser, *args, **kwargs):
    """`EngineArgs.add_cli_args`: vLLM's arguments, then ours."""
    parser = stock_add_cli_args(parser, *args, **kwargs)
    add_kv_policy_args(parser)
    return parser


def from_cli_args(cls, stock_from_cli_args, args):
    """`EngineArgs.from_cli_args`: vLLM copies its dataclass fields; we fold ours into
    `additional_config`."""
    engine_args = stock_from_cli_args(cls, args)
    fold_into_engine_args(engine_args, args)
    return engine_args
