"""vLLM general plugin (entry point `vllm.general_plugins`): runs in every vLLM process.

It must stay importable and idempotent: workers are spawned and load it again. All touches of
vLLM internals start here; each patched name is listed in `PATCHED` and checked by
tests/test_vllm_contract.py so a vLLM upgrade fails loudly instead of serving wrong attention.
"""

from __future__ import annotations

import functools
import logging

logger = logging.getLogger("vllm_kvevict")
_registered = False

PATCHED = (
    "vllm.engine.arg_utils.EngineArgs.add_cli_args",
    "vllm.engine.arg_utils.EngineArgs.from_cli_args",
    "vllm.engine.arg_utils.EngineArgs.create_engine_config",
)


def register() -> None:
    global _registered
    if _registered:
        return
    _registered = True
    _patch_cli()


def _patch_cli() -> None:
    from vllm.engine.arg_utils import EngineArgs

    from vllm_kvevict.integration import cli
    from vllm_kvevict.integration.validation import validate_against_model

    original_add = EngineArgs.add_cli_args
    original_from = EngineArgs.from_cli_args.__func__
    original_create = EngineArgs.create_engine_config

    @functools.wraps(original_add)
    def add_cli_args(parser, *a, **kw):
        parser = original_add(parser, *a, **kw)
        cli.add_kv_policy_args(parser)
        return parser

    @functools.wraps(original_from)
    def from_cli_args(cls, args):
        engine_args = original_from(cls, args)
        cli.fold_into_engine_args(engine_args, args)
        return engine_args

    @functools.wraps(original_create)
    def create_engine_config(self, *a, **kw):
        vllm_config = original_create(self, *a, **kw)
        validate_against_model(vllm_config)
        return vllm_config

    EngineArgs.add_cli_args = staticmethod(add_cli_args)
    EngineArgs.from_cli_args = classmethod(from_cli_args)
    EngineArgs.create_engine_config = create_engine_config
