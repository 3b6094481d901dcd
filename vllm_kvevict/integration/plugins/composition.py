"""Our classes installed where vLLM builds its own from a class name in the engine config
(`scheduler_config.scheduler_cls`, `parallel_config.worker_cls`), composed with a user's
subclass of vLLM's class (or, for a class of ours that subclasses only a base of it, as our
worker does, with vLLM's own): ours first in the MRO, theirs under `super()`.

vLLM resolves those names in spawned processes (engine core, workers), so a composed class is
named by a string that process can import: `<module of ours>.<Ours>_over_<user class path>`
(dots written as colons), rebuilt there by that module's `__getattr__` (`resolve`).
"""

from __future__ import annotations

import functools
import importlib

from vllm_kvevict.config import KVPolicyError


def class_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def import_class(path: str):
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _prefix(ours: type) -> str:
    return f"{ours.__name__}_over_"


@functools.cache
def composed(ours: type, user_cls: type) -> type:
    """`ours` over a user's subclass of the vLLM class ours subclasses."""
    name = _prefix(ours) + class_path(user_cls).replace(".", ":")
    return type(name, (ours, user_cls), {"__module__": ours.__module__, "__qualname__": name})


def resolve(ours: type, name: str) -> type:
    """For the module `__getattr__` of `ours`: rebuild a composed class from its name."""
    if not name.startswith(_prefix(ours)):
        raise AttributeError(f"module {ours.__module__!r} has no attribute {name!r}")
    return composed(ours, import_class(name[len(_prefix(ours)):].replace(":", ".")))


def install_over(ours: type, stock: type, chosen, flag: str) -> str:
    """The class name vLLM should build instead of `chosen` (the class vLLM would build: its
    default `stock`, or the user's, given as a class or an import path). Raises KVPolicyError
    (one line starting with `flag`, the user's flag and value) when the user's class cannot be
    composed with ours."""
    try:
        base = import_class(chosen) if isinstance(chosen, str) else chosen
    except (ImportError, AttributeError, ValueError) as exc:
        raise KVPolicyError(f"{flag}: cannot import it ({exc})") from None
    if isinstance(base, type) and issubclass(base, ours):
        return class_path(base) if base is ours else f"{ours.__module__}.{base.__name__}"
    if not (isinstance(base, type) and issubclass(base, stock)):
        raise KVPolicyError(
            f"{flag} is not a subclass of vLLM's {stock.__name__} "
            f"({class_path(stock)}): vllm-kvevict's {ours.__name__} can only be composed "
            "with one")
    if base is stock and issubclass(ours, stock):
        return class_path(ours)
    try:
        importable = import_class(class_path(base)) is base
    except (ImportError, AttributeError):
        importable = False
    if not importable:  # the spawned process must import it by name
        raise KVPolicyError(f"{flag}: {class_path(base)} is not importable by that "
                            "name")
    return f"{ours.__module__}.{composed(ours, base).__name__}"
