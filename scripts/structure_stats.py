"""The glue's shape in numbers, at any commit (docs/results/structure/README.md's tables).

    python scripts/structure_stats.py                 # the working tree
    python scripts/structure_stats.py --rev c5c927a   # a commit (read with git, no checkout)
    python scripts/structure_stats.py --rev c5c927a --rev HEAD --markdown

Every number is computed from the files alone (ast and a regex), so two runs on one commit agree.
"""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from test_layout import kind_branch_lines, own_imports  # noqa: E402  (the test's readings)
GLUE = "vllm_kvevict/integration/"

def read_tree(rev: str | None) -> dict[str, str]:
    """path -> text of every .py and .md file (the working tree when `rev` is None)."""
    if rev is None:
        paths = [p for p in REPO.rglob("*") if p.suffix in (".py", ".md") and p.is_file()
                 and not any(part.startswith(".") for part in p.relative_to(REPO).parts)]
        return {str(p.relative_to(REPO)): p.read_text(errors="replace") for p in paths}
    names = subprocess.run(["git", "ls-tree", "-r", "--name-only", rev], cwd=REPO, check=True,
                           capture_output=True, text=True).stdout.split()
    return {n: subprocess.run(["git", "show", f"{rev}:{n}"], cwd=REPO, check=True,
                              capture_output=True, text=True).stdout
            for n in names if n.endswith((".py", ".md"))}


def module_name(path: str) -> str:
    parts = path[:-3].split("/")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(tree: dict[str, str], prefix: str = "vllm_kvevict/"):
    """(modules, arrows at load, arrows inside functions) among the package's own modules, as
    tests/test_layout.py's `own_imports` counts them."""
    modules = {module_name(p): p for p in tree if p.startswith(prefix) and p.endswith(".py")}
    at_load: dict[str, set[str]] = {}
    in_fn: dict[str, set[str]] = {}
    for module, path in modules.items():
        loaded, inner = own_imports(module, path, modules, tree[path])
        at_load[module], in_fn[module] = loaded, set(inner)
    return modules, at_load, in_fn


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def floors(graph: dict[str, set[str]]) -> int:
    """The longest import chain, in modules; the modules of a cycle count as one floor."""
    component = {v: v for v in graph}
    for members in cycles(graph):
        component.update({v: members[0] for v in members})
    dag: dict[str, set[str]] = {}
    for v, targets in graph.items():
        dag.setdefault(component[v], set()).update(
            component.get(w, w) for w in targets if component.get(w, w) != component[v])
    memo: dict[str, int] = {}

    def depth(v: str) -> int:
        if v not in memo:
            memo[v] = 1 + max((depth(w) for w in dag.get(v, ())), default=0)
        return memo[v]
    return max((depth(v) for v in dag), default=0)


def functions_over(tree: dict[str, str], prefix: str, limit: int) -> list[str]:
    out = []
    for path, text in tree.items():
        if path.startswith(prefix) and path.endswith(".py"):
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                        and node.end_lineno - node.lineno + 1 > limit:
                    out.append(f"{path}:{node.name}")
    return sorted(out)


def module_globals(tree: dict[str, str], prefix: str = "vllm_kvevict/") -> list[str]:
    """Module-level names a function rebinds (`global x`): per-process state held in modules."""
    out = set()
    for path, text in tree.items():
        if path.startswith(prefix) and path.endswith(".py"):
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.Global):
                    out |= {f"{module_name(path)}.{n}" for n in node.names}
    return sorted(out)


def torch_config_at_import(tree: dict[str, str]) -> list[str]:
    """Module-level statements of the glue that assign into torch's config."""
    out = []
    for path, text in tree.items():
        if path.startswith(GLUE) and path.endswith(".py"):
            for node in ast.parse(text).body:
                if isinstance(node, ast.Assign) and any(
                        ast.unparse(t).startswith("torch.") for t in node.targets):
                    out.append(f"{path}:{node.lineno}")
    return out


def kind_branches(tree: dict[str, str]) -> tuple[int, int]:
    """(lines, files) of the glue that ask the policy's kind (tests/test_layout.py's
    `KIND_PREDICATES`, outside comments and docstrings)."""
    hits = [len(kind_branch_lines(text)) for path, text in tree.items()
            if path.startswith(GLUE) and path.endswith(".py")]
    return sum(hits), sum(map(bool, hits))


def kind_reads(tree: dict[str, str]) -> tuple[int, int]:
    """(lines, files) of the glue reading `.kind` (`ServedPolicy.kind`: the factories)."""
    hits = {p: {n.lineno for n in ast.walk(ast.parse(t))
                if isinstance(n, ast.Attribute) and n.attr == "kind"}
            for p, t in tree.items() if p.startswith(GLUE) and p.endswith(".py")}
    return sum(map(len, hits.values())), sum(bool(h) for h in hits.values())


def table_rows(tree: dict[str, str]) -> str:
    """WRAPS / RELIED_ON / TOUCHED: the rows of the contract's three tables (registration.py
    held them before issue 69's second slice, plugins/contract.py after)."""
    text = tree.get(GLUE + "plugins/contract.py") or tree.get(GLUE + "registration.py", "")
    sizes = {}
    for node in ast.parse(text).body:
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, ast.AnnAssign) else []
        for target in targets:
            if isinstance(target, ast.Name) and target.id in ("WRAPS", "RELIED_ON", "TOUCHED") \
                    and isinstance(node.value, (ast.Tuple, ast.List)):
                sizes[target.id] = len(node.value.elts)
    return " + ".join(str(sizes.get(k, "?")) for k in ("WRAPS", "RELIED_ON", "TOUCHED"))


def state_fields(tree: dict[str, str]) -> int:
    """The fields of the worker's per-process state (`worker.WorkerState`)."""
    state = tree.get(GLUE + "worker/state.py") or tree.get(GLUE + "worker.py", "")
    for node in ast.walk(ast.parse(state)):
        if isinstance(node, ast.ClassDef) and node.name == "WorkerState":
            return sum(isinstance(item, ast.AnnAssign) for item in node.body)
    return 0


def cross_arrows(tree: dict[str, str], src: str, dst: str) -> int:
    """Module imports (at load or inside functions) from the glue folder `src` into `dst`."""
    modules, at_load, in_fn = import_graph(tree)
    return sum(1 for m in modules if m.startswith(f"vllm_kvevict.integration.{src}.")
               for t in at_load[m] | in_fn[m]
               if t.startswith(f"vllm_kvevict.integration.{dst}."))


def global_statements(tree: dict[str, str]) -> int:
    """`global` statements in vllm_kvevict/ and server/."""
    return sum(isinstance(node, ast.Global) for path, text in tree.items()
               if path.startswith(("vllm_kvevict/", "server/")) and path.endswith(".py")
               for node in ast.walk(ast.parse(text)))


def state_pulls(tree: dict[str, str]) -> int:
    """Calls of the worker state's pull functions (`init_state` / `get_state`) in the glue."""
    return sum(len(re.findall(r"\b(?:init_state|get_state)\(", t)) for p, t in tree.items()
               if p.startswith(GLUE) and p.endswith(".py") and "seeded_sampling" not in p)


def surface(tree: dict[str, str]) -> str:
    """RELIED_ON + TOUCHED as the ratchet counts them on vLLM 0.32 (every row: the V1 runner's
    included)."""
    sizes = dict(zip(("WRAPS", "RELIED_ON", "TOUCHED"), table_rows(tree).split(" + ")))
    try:
        return str(int(sizes["RELIED_ON"]) + int(sizes["TOUCHED"]))
    except ValueError:
        return "?"


def long_docstrings(tree: dict[str, str], limit: int = 12) -> int:
    """Glue modules whose docstring runs over `limit` lines."""
    out = 0
    for path, text in tree.items():
        if path.startswith(GLUE) and path.endswith(".py"):
            doc = ast.get_docstring(ast.parse(text), clean=False)
            out += bool(doc) and doc.count("\n") + 1 > limit
    return out


def words(text: str) -> int:
    return len(text.split())


def stats(rev: str | None) -> dict[str, object]:
    tree = read_tree(rev)
    glue_py = [p for p in tree if p.startswith(GLUE) and p.endswith(".py")]
    glue_files = [p for p in glue_py if not p.endswith("__init__.py")]
    folders = {p.rsplit("/", 1)[0] for p in glue_py} - {GLUE.rstrip("/")}
    modules, at_load, in_fn = import_graph(tree)
    glue = {m for m in modules if modules[m].startswith(GLUE)}
    glue_load = {m: at_load[m] & glue for m in glue}
    glue_all = {m: (at_load[m] | in_fn[m]) & glue for m in glue}
    both = {m: at_load[m] | in_fn[m] for m in modules}
    kind_lines, kind_files = kind_branches(tree)
    docs = {p: t for p, t in tree.items() if p.startswith("docs/") and p.endswith(".md")
            and not p.startswith(("docs/results/", "docs/proposals/"))
            and p != "docs/design/structure.md"}  # (where these tables were until issue 85)
    readme = tree.get("README.md", "")
    return {
        "kind branches in the glue (lines / files)": f"{kind_lines} / {kind_files}",
        "`.kind` reads (the factories' choice; lines / files)": "{} / {}".format(*kind_reads(tree)),
        "isinstance(rule, TokenEvictionLedger)": sum(
            len(re.findall(r"isinstance\([^)]*TokenEvictionLedger\)", tree[p]))
            for p in glue_py),
        "module globals rebound by functions": len(module_globals(tree)),
        "torch config set at import (glue)": len(torch_config_at_import(tree)),
        "glue files (.py, no __init__) / folders": f"{len(glue_files)} / {len(folders)}",
        "glue lines": sum(len(tree[p].splitlines()) for p in glue_py),
        "glue import floors / arrows (at load)": f"{floors(glue_load)} / "
                                                 f"{sum(map(len, glue_load.values()))}",
        "glue import floors / arrows (with imports inside functions)":
            f"{floors(glue_all)} / {sum(map(len, glue_all.values()))}",
        "import cycles in vllm_kvevict/ (imports inside functions counted)": len(cycles(both)),
        "own imports inside functions (vllm_kvevict/)": sum(map(len, in_fn.values())),
        "glue functions over 40 / 60 lines": f"{len(functions_over(tree, GLUE, 40))} / "
                                             f"{len(functions_over(tree, GLUE, 60))}",
        "vllm_kvevict/ functions over 40 / 60 lines":
            f"{len(functions_over(tree, 'vllm_kvevict/', 40))} / "
            f"{len(functions_over(tree, 'vllm_kvevict/', 60))}",
        "glue files over 300 lines": sum(len(tree[p].splitlines()) > 300 for p in glue_py),
        "WorkerState fields": state_fields(tree),
        "WRAPS + RELIED_ON + TOUCHED rows": table_rows(tree),
        "RELIED_ON + TOUCHED literals (vLLM 0.34's count; 0.32 adds 5)": surface(tree),
        "attention -> worker / worker -> attention module arrows":
            f"{cross_arrows(tree, 'attention', 'worker')} / "
            f"{cross_arrows(tree, 'worker', 'attention')}",
        "`global` statements (vllm_kvevict/, server/)": global_statements(tree),
        "init_state / get_state calls (glue)": state_pulls(tree),
        "glue module docstrings over 12 lines": long_docstrings(tree),
        "docs/ design pages over 300 lines": sum(
            len(t.splitlines()) > 300 for t in docs.values()),
        "README lines / words": f"{len(readme.splitlines())} / {words(readme)}",
        "docs/design.md lines / words": f"{len(tree.get('docs/design.md', '').splitlines())} / "
                                        f"{words(tree.get('docs/design.md', ''))}",
        "docs words (docs/**.md, not results/ or proposals/)": sum(map(words, docs.values())),
        "README + docs/design.md words (before a newcomer opens a file)":
            words(readme) + words(tree.get("docs/design.md", "")),
        "README + docs words (all of the above docs)": words(readme) + sum(map(words,
                                                                              docs.values())),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rev", action="append", help="a commit (repeatable); default: the "
                        "working tree")
    parser.add_argument("--markdown", action="store_true", help="one table, a column per rev")
    parser.add_argument("--details", action="store_true", help="list the cycles, globals and "
                        "long functions too")
    args = parser.parse_args()
    revs = args.rev or [None]
    table = {rev or "working tree": stats(rev) for rev in revs}
    if args.markdown:
        print("| measure | " + " | ".join(table) + " |")
        print("|---|" + "---|" * len(table))
        for key in next(iter(table.values())):
            print(f"| {key} | " + " | ".join(str(col[key]) for col in table.values()) + " |")
    else:
        for name, col in table.items():
            print(f"== {name}")
            for key, value in col.items():
                print(f"  {key}: {value}")
    if args.details:
        for rev in revs:
            tree = read_tree(rev)
            modules, at_load, in_fn = import_graph(tree)
            print(f"== {rev or 'working tree'}: details")
            print("  cycles:", cycles({m: at_load[m] | in_fn[m] for m in modules}))
            print("  module globals:", module_globals(tree))
            print("  torch config at import:", torch_config_at_import(tree))
            print("  glue functions over 60:", functions_over(tree, GLUE, 60))


if __name__ == "__main__":
    main()
