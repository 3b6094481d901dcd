"""The contract report: every row of `contract.WRAPS`, `RELIED_ON`, `TOUCHED` and, counted
apart, `PUBLIC_INTERNALS` looked up on the installed vLLM, and whether the plugin can activate
here. A user runs it before serving on a vLLM this release was not tested with (`python -m
vllm_kvevict.contract`, seconds, no model); tests/test_vllm_contract.py checks the same names
precisely, this only that they are there.

WRAPS / RELIED_ON rows are dotted names: `present` when they resolve, `moved` when their leaf
(or its class) is defined in another file of vLLM's source, `missing` otherwise. TOUCHED rows
are attribute names: `present` when the name occurs in vLLM's source (a weak check), `ours` for
one of ours on vLLM's objects (`kvevict_*`). PUBLIC_INTERNALS rows are `Owner.attribute`:
`present` when vLLM's class has it (on the class, a field, or `self.attribute = ...`).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from vllm_kvevict.integration.plugins import contract
from vllm_kvevict.integration.plugins.support import activation, platform_name, vllm_version
from vllm_kvevict.integration.plugins.versions import V1_RUNNER

DEFINITION = re.compile(r"^\s*(?:async\s+)?(?:def|class)\s+(\w+)|^(\w+)\s*(?::[^=]*)?=",
                        re.MULTILINE)


@dataclass(frozen=True)
class Row:
    table: str        # WRAPS, RELIED_ON, TOUCHED or PUBLIC_INTERNALS
    name: str         # the dotted vLLM name, or "file.py: attribute" for TOUCHED
    status: str       # present, moved, missing, ours, or n/a (a row this release has no use for)
    where: str = ""   # moved: the vLLM files that define its leaf now


def resolve(dotted: str):
    """The object a dotted name names (None: it does not resolve)."""
    parts = dotted.split("(")[0].replace(":", ".").split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return None
        return obj
    return None


class VLLMSource:
    """Which files of the installed vLLM define a name, and every identifier they use."""

    def __init__(self) -> None:
        import vllm  # (in here: the report's module stays importable without vLLM)

        root = Path(vllm.__file__).parent
        self.defined: dict[str, set[str]] = {}
        words: set[str] = set()
        for path in root.rglob("*.py"):
            text = path.read_text(errors="replace")
            rel = str(path.relative_to(root.parent))
            for match in DEFINITION.finditer(text):
                self.defined.setdefault(match.group(1) or match.group(2), set()).add(rel)
            words.update(re.findall(r"\w+", text))
        self.words = words

    def defining(self, dotted: str) -> list[str]:
        """Files that define the name (with its class, for a class's attribute)."""
        parts = dotted.split("(")[0].replace(":", ".").split(".")
        files = self.defined.get(parts[-1], set())
        if len(parts) > 1 and parts[-2][:1].isupper():  # Owner.attribute: both in one file
            files = files & self.defined.get(parts[-2], set())
        return sorted(files)


def check_name(table: str, name: str, source: VLLMSource) -> Row:
    if resolve(name) is not None:
        return Row(table, name, "present")
    owner = name.split("(")[0].replace(":", ".").rsplit(".", 1)[0]
    if owner.rsplit(".", 1)[-1][:1].isupper() and resolve(owner) is not None:
        return Row(table, name, "missing")  # its class is where we name it, the attribute gone
    where = source.defining(name)
    return Row(table, name, "moved" if where else "missing", ", ".join(where[:3]))


def has_attribute(cls, attribute: str) -> bool:
    """vLLM's class has `attribute`: on the class, as a dataclass field, or assigned as
    `self.attribute` in the source of a class of its MRO (instance state set in __init__)."""
    if hasattr(cls, attribute) or attribute in getattr(cls, "__dataclass_fields__", {}):
        return True
    assigned = re.compile(rf"\bself\.{attribute}\s*(?::[^=\n]+)?=[^=]")
    for klass in cls.__mro__:
        try:
            if assigned.search(inspect.getsource(klass)):
                return True
        except (OSError, TypeError):  # (builtins: no source)
            continue
    return False


def check_internal(name: str) -> Row:
    owner, attribute = name.rsplit(".", 1)
    cls = resolve(owner)
    present = isinstance(cls, type) and has_attribute(cls, attribute)
    return Row("PUBLIC_INTERNALS", name, "present" if present else "missing")


def check_touched(file: str, attr: str, source: VLLMSource) -> Row:
    name = f"{file}: {attr}"
    if attr.startswith("kvevict_"):
        return Row("TOUCHED", name, "ours")
    return Row("TOUCHED", name, "present" if attr in source.words else "missing")


def report() -> dict:
    """Every row checked, and the activation verdict."""
    started = time.perf_counter()
    source = VLLMSource()
    rows = [check_name("WRAPS", w.target, source) for w in contract.WRAPS]
    rows += [check_name("RELIED_ON", name, source) for name in dict.fromkeys(contract.RELIED_ON)]
    if not V1_RUNNER:  # (where vLLM has no V1 runner the plugin's V1 parts never run)
        rows += [Row("RELIED_ON", name, "n/a", "V1 runner only: removed in vLLM 0.34")
                 for name in contract.V1_RUNNER_ROWS]
    rows += [check_touched(files, attr, source) for files, attr, _ in contract.TOUCHED]
    rows += [check_internal(name) for name in dict.fromkeys(contract.PUBLIC_INTERNALS)]
    if not V1_RUNNER:
        rows += [Row("PUBLIC_INTERNALS", name, "n/a", "V1 runner only: removed in vLLM 0.34")
                 for name in contract.V1_RUNNER_INTERNALS]
    version, platform = vllm_version(), platform_name()
    reason, unlocked_by = activation(version, platform)
    rows = [asdict(r) for r in rows]
    return {"vllm": version, "platform": platform, "rows": rows, "surface": surface(rows),
            "can_activate": reason is None, "inactive_reason": reason,
            "unlocked_by": unlocked_by, "seconds": round(time.perf_counter() - started, 1)}


def surface(rows: list[dict]) -> dict[str, int]:
    """Rows per table, where this vLLM uses them (n/a rows left out): RELIED_ON + TOUCHED is
    the surface tests/test_vllm_contract.py ratchets; PUBLIC_INTERNALS is counted apart."""
    tables = ("WRAPS", "RELIED_ON", "TOUCHED", "PUBLIC_INTERNALS")
    return {t: sum(r["table"] == t and r["status"] != "n/a" for r in rows) for t in tables}


def render(result: dict) -> str:
    rows = result["rows"]
    counts = {s: sum(r["status"] == s for r in rows)
              for s in ("present", "moved", "missing", "ours", "n/a")}
    size = surface(rows)
    lines = [f"vllm-kvevict contract report: vLLM {result['vllm']}, platform "
             f"{result['platform']} ({result['seconds']} s)", "",
             f"{'table':<16} {'status':<8} name", "-" * 100]
    lines += [f"{r['table']:<16} {r['status']:<8} {r['name']}"
              + (f"  ({r['where']})" if r["status"] == "n/a" else
                 f"  -> {r['where']}" if r["where"] else "") for r in rows]
    lines += ["", "rows: " + ", ".join(f"{n} {s}" for s, n in counts.items()),
              f"surface: RELIED_ON + TOUCHED = {size['RELIED_ON']} + {size['TOUCHED']} = "
              f"{size['RELIED_ON'] + size['TOUCHED']}; WRAPS {size['WRAPS']}; public-but-internal "
              f"attributes read {size['PUBLIC_INTERNALS']}; not vLLM's (NOT_VLLM, not looked up) "
              f"{len(contract.NOT_VLLM)}",
              "plugin can activate here: " + ("yes" if result["can_activate"] else
                                             f"no ({result['inactive_reason']})")]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Prints the table; exit 1 when a row moved or is missing (0 otherwise, whether or not
    the plugin activates: the last line says that)."""
    parser = argparse.ArgumentParser(prog="python -m vllm_kvevict.contract",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    args = parser.parse_args(argv)
    result = report()
    print(render(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return int(any(r["status"] in ("moved", "missing") for r in result["rows"]))
