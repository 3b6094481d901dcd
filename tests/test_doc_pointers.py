"""Backticked pointers in docs/ that name our code resolve (issue 85): a path (`worker/state.py`,
`vllm_kvevict/integration/kv_cache/specs.py`, `tests/test_fp8.py::test_name[param]`,
`docs/results/limits/`) exists in the repository, and a dotted `module.name` pointer
(`sink_window.canonical_chunk`, `contract.RELIED_ON`, `state.WorkerState.planner`,
`vllm_kvevict.gpu_check`) names a module of ours that defines the name (top-level def, class or
assignment; a method or class attribute for `Class.method`). A `Class.method` pointer whose
class is ours is checked the same way. Plain Python, no vLLM import.

Only our names are checked: a dotted pointer whose first part is no module stem or class of
ours (vLLM's, torch's: `kv_cache_utils.get_kv_cache_groups`) and a path whose first part is no
folder of ours are skipped, and so is a path with a line number (`scheduler.py:570`: vLLM's
source is cited that way). vLLM's files are named from `vllm/` (`vllm/v1/core/kv_cache_utils.py`).
"""

from __future__ import annotations

import ast
import functools
import os
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CODE_ROOTS = ("vllm_kvevict", "server", "loadtest", "scripts", "tests")
SKIP_DOCS = ("docs/results/", "docs/proposals/")
SKIP_DIRS = {".git", ".venv", "__pycache__", "node_modules", ".pytest_cache"}
IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
DOTTED = re.compile(rf"^{IDENT}(?:\.{IDENT})+$")
PATHLIKE = re.compile(r"^[\w.<>-]+(?:/[\w.<>-]*)*(?:::[\w\[\]./, =+|-]*)?$")
DOC_EXTS = (".py", ".md", ".toml", ".json", ".sh", ".txt", ".yaml", ".yml")
DATA_EXTS = DOC_EXTS + (".png", ".svg", ".csv", ".jsonl", ".html", ".log", ".gz", ".gguf")
# Dotted names that look like ours but name no module attribute, each with what it is.
NOT_POINTERS = {
    "vllm_kvevict.server": "the entry-point group server/ is installed under",
    "kv_stats.policy": "a field of the kv_stats a response carries",
    "api_server.entry.build_app": "vLLM's (vllm.entrypoints.launchers.api_server.entry)",
}


def doc_pages() -> list[Path]:
    return sorted(p for p in (REPO / "docs").rglob("*.md")
                  if not str(p.relative_to(REPO)).startswith(SKIP_DOCS))


@functools.cache
def repo_paths() -> tuple[frozenset[str], frozenset[str]]:
    """Every file and folder of the working tree (relative, '/'-separated), build outputs aside."""
    files, dirs = set(), set()
    for root, subdirs, names in os.walk(REPO):
        subdirs[:] = [d for d in subdirs if d not in SKIP_DIRS and not d.startswith(".venv")]
        rel = Path(root).relative_to(REPO)
        dirs |= {(rel / d).as_posix() for d in subdirs}
        files |= {(rel / n).as_posix() for n in names}
    return frozenset(files), frozenset(dirs)


@functools.cache
def modules_by_stem() -> dict[str, list[Path]]:
    """Module stem -> its files (`x.py`, or a package's `x/__init__.py`) under our code roots."""
    out: dict[str, list[Path]] = {}
    for root in CODE_ROOTS:
        for p in (REPO / root).rglob("*.py"):
            if SKIP_DIRS & set(p.parts):
                continue
            stem = p.parent.name if p.name == "__init__.py" else p.stem
            out.setdefault(stem, []).append(p)
        out.setdefault(root, []).append(REPO / root)  # a root folder (dotted module path)
    return out


def _targets(stmt: ast.stmt) -> list[str]:
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [stmt.name]
    if isinstance(stmt, ast.Assign):
        return [n.id for t in stmt.targets for n in ast.walk(t) if isinstance(n, ast.Name)]
    if isinstance(stmt, (ast.AnnAssign, ast.AugAssign)) and isinstance(stmt.target, ast.Name):
        return [stmt.target.id]
    return []


def _body_names(body: list[ast.stmt]) -> dict[str, ast.stmt]:
    """Names a module or class body defines, looking into if / try blocks at that level."""
    out: dict[str, ast.stmt] = {}
    for stmt in body:
        for name in _targets(stmt):
            out[name] = stmt
        for sub in ("body", "orelse", "finalbody"):
            if isinstance(stmt, (ast.If, ast.Try)) and getattr(stmt, sub, None):
                out.update(_body_names(getattr(stmt, sub)))
        if isinstance(stmt, ast.Try):
            for handler in stmt.handlers:
                out.update(_body_names(handler.body))
    return out


@functools.cache
def defined(path: Path) -> dict[str, ast.stmt]:
    return _body_names(ast.parse(path.read_text(), str(path)).body)


@functools.cache
def our_classes() -> dict[str, list[ast.ClassDef]]:
    out: dict[str, list[ast.ClassDef]] = {}
    for paths in modules_by_stem().values():
        for p in paths:
            if p.suffix == ".py" and p.relative_to(REPO).parts[0] != "tests":  # (tests: by path)
                for name, node in defined(p).items():
                    if isinstance(node, ast.ClassDef):
                        out.setdefault(name, []).append(node)
    return out


def _self_attrs(cls: ast.ClassDef) -> set[str]:
    """Attributes a class's methods set on `self` (instance fields)."""
    return {n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute)
            and isinstance(n.ctx, ast.Store) and isinstance(n.value, ast.Name)
            and n.value.id == "self"}


def class_has(cls: ast.ClassDef, name: str, seen: frozenset[str] = frozenset()) -> bool:
    """`name` defined in the class body, set on self, or found on one of its bases; True too
    when a base is not ours (vLLM's, torch's: what it defines is not checked here)."""
    if name in _body_names(cls.body) or name in _self_attrs(cls):
        return True
    for base in cls.bases:
        base_name = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", None)
        if base_name in (None, "object", "Protocol", "Generic", "NamedTuple", "Enum", "IntEnum"):
            continue
        if base_name not in our_classes() or base_name in seen:
            return True
        if any(class_has(c, name, seen | {cls.name}) for c in our_classes()[base_name]):
            return True
    return False


def resolve_in_module(path: Path, parts: list[str]) -> bool:
    """`parts` after a module: a submodule, a name it defines, and then a class member."""
    if not parts:
        return True
    if path.is_dir() or path.name == "__init__.py":
        pkg = path if path.is_dir() else path.parent
        sub = [pkg / f"{parts[0]}.py", pkg / parts[0] / "__init__.py"]
        for s in sub:
            if s.exists() and resolve_in_module(s, parts[1:]):
                return True
        if path.is_dir():
            init = path / "__init__.py"
            return init.exists() and resolve_in_module(init, parts)
    names = defined(path)
    node = names.get(parts[0])
    if node is None:
        return False
    if len(parts) == 1:
        return True
    if isinstance(node, ast.ClassDef):
        return len(parts) == 2 and class_has(node, parts[1])
    return False  # an attribute of a function or a value: not a pointer we can check


def dotted_ok(pointer: str) -> bool | None:
    """True / False for a pointer into our code; None when it is not ours."""
    first, *rest = pointer.split(".")
    if first in modules_by_stem():
        if any(resolve_in_module(p, rest) for p in modules_by_stem()[first]):
            return True
        if first not in our_classes():
            return False
    if first in our_classes() and len(rest) == 1:
        return any(class_has(c, rest[0]) for c in our_classes()[first])
    return None


def _node_ok(file: str, node: str) -> bool:
    """A pytest node id's function (or Class::method) in `file`, parameters stripped."""
    parts = [re.sub(r"\[.*$", "", part) for part in node.split("::") if part]
    if not parts:
        return True
    names = defined(REPO / file)
    if parts[0].endswith("...") and len(parts) == 1:  # `::test_tp2_under_the_v2_runner_...`
        return any(name.startswith(parts[0][:-3]) for name in names)
    head = names.get(parts[0])
    if head is None:
        return False
    return len(parts) == 1 or (isinstance(head, ast.ClassDef) and class_has(head, parts[1]))


def path_ok(pointer: str) -> bool | None:
    """True / False for a path into our tree (a suffix of a file or folder); None when not ours."""
    if re.search(r":\d", pointer):
        return None  # `file:line`: a citation of vLLM's source
    path, _, node = pointer.partition("::")
    path = path.rstrip("/")
    if not path or path.startswith(("vllm/", ".venv", "/", "~")) or "<" in path or "..." in path:
        return None
    first = path.split("/")[0]
    files, dirs = repo_paths()
    ours = {p.split("/")[0] for p in files | dirs}
    ours |= {Path(d).name for d in dirs if d.startswith(CODE_ROOTS)}
    if "/" not in path:
        if not path.endswith(DOC_EXTS):
            return None
        matches = [f for f in files if f == path or f.endswith("/" + path)]
    elif first in ours:
        matches = [f for f in files | dirs if f == path or f.endswith("/" + path)]
    else:
        return None
    if not matches:
        return False
    if node:
        return any(m.endswith(".py") and m in files and _node_ok(m, node) for m in matches)
    return True


def pointers(text: str):
    """(line number, pointer) for every backticked span of a page (code blocks skipped)."""
    in_block = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            in_block = not in_block
            continue
        if in_block:
            continue
        for span in re.findall(r"`([^`]+)`", line):
            yield number, span.strip()


def module_path_ok(pointer: str) -> bool | None:
    """`worker/state.PLANNERS`: a module named by its path, then names in it."""
    folder, _, dotted = pointer.rpartition("/")
    stem, *names = dotted.split(".")
    found = path_ok(f"{folder}/{stem}.py")
    if not found:
        return found
    files, _ = repo_paths()
    return any(resolve_in_module(REPO / f, names) for f in files
               if f == f"{folder}/{stem}.py" or f.endswith(f"/{folder}/{stem}.py"))


def check(pointer: str) -> bool | None:
    bare = re.sub(r"\(.*\)$", "", pointer)  # `build_step_plan(chunk=E)` -> the name
    if bare in NOT_POINTERS:
        return None
    if DOTTED.match(bare) and not bare.endswith(DATA_EXTS):
        return dotted_ok(bare)
    folder, _, last = bare.rpartition("/")
    if folder and DOTTED.match(last) and not last.endswith(DATA_EXTS) and " " not in folder:
        return module_path_ok(bare)
    if " " not in pointer and PATHLIKE.match(pointer) and ("/" in pointer or "::" in pointer
                                                          or pointer.endswith(DOC_EXTS)):
        return path_ok(pointer)
    return None


def unresolved() -> tuple[list[str], int]:
    bad, checked = [], 0
    for page in doc_pages():
        rel = page.relative_to(REPO).as_posix()
        for number, pointer in pointers(page.read_text()):
            verdict = check(pointer)
            if verdict is None:
                continue
            checked += 1
            if not verdict:
                bad.append(f"{rel}:{number}: `{pointer}`")
    return bad, checked


def test_the_resolver_tells_ours_from_stale_and_foreign():
    assert check("sink_window.canonical_chunk") is True
    assert check("contract.RELIED_ON") is True
    assert check("vllm_kvevict/integration/kv_cache/specs.py") is True
    assert check("kv_cache/specs.py") is True
    assert check("tests/test_layout.py::test_the_package_never_imports_server_or_loadtest") is True
    assert check("sink_window.no_such_name") is False
    assert check("kv_cache/no_such_file.py") is False
    assert check("tests/test_layout.py::no_such_test[x]") is False
    assert check("kv_cache_utils.get_kv_cache_groups") is None  # vLLM's
    assert check("torch._dynamo.config") is None
    assert check("scheduler.py:570") is None
    assert check("vllm/v1/core/kv_cache_utils.py") is None


def test_backticked_pointers_in_the_docs_name_code_that_exists():
    bad, checked = unresolved()
    assert checked > 100, checked  # the scan finds the docs' pointers
    assert not bad, "pointers in docs/ that name nothing in the code:\n" + "\n".join(bad)


# -- the results the README quotes name the commit they ran on (issue 87) ------------------------

HEX = re.compile(r"\b[0-9a-f]{7,40}\b")


def quoted_results() -> dict[str, Path]:
    """Each `docs/results/...` pointer in README.md -> the page that describes it: the file if
    it is a page, else its folder's README.md (or its one summary page)."""
    out = {}
    for pointer in sorted(set(re.findall(r"`(docs/results/[^`\s]*)`", (REPO / "README.md")
                                         .read_text()))):
        path = REPO / pointer
        folder = path if path.is_dir() else path.parent
        page = path if path.suffix == ".md" else next(
            (folder / name for name in ("README.md", "summary.md") if (folder / name).is_file()),
            folder / "README.md")
        out[pointer] = page
    return out


def names_a_commit(text: str) -> bool:
    """A word of the page that git resolves as a commit of this repository (a shallow clone,
    which may lack it: a word that looks like one, with a letter among its hex digits)."""
    import subprocess

    words = [w for w in HEX.findall(text) if re.search("[a-f]", w)]
    shallow = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=REPO,
                             capture_output=True, text=True).stdout.strip() != "false"
    if shallow:
        return bool(words)
    return any(subprocess.run(["git", "cat-file", "-e", f"{w}^{{commit}}"], cwd=REPO,
                              capture_output=True).returncode == 0 for w in words)


def test_every_results_page_the_readme_quotes_names_its_commit():
    pages = quoted_results()
    assert len(pages) >= 8, pages  # (the README's results paragraph and its feature notes)
    missing = [f"{pointer} ({page.relative_to(REPO)})" for pointer, page in pages.items()
               if not page.is_file() or not names_a_commit(page.read_text())]
    assert missing == [], f"results the README quotes without the commit they ran on: {missing}"
