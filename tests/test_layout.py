"""The code's shape, checked (docs/design.md, "Layout"): which package may import which (and no
import cycle), every monkeypatch of vLLM in the registration table, glue functions short enough
to read."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def imports_of(path: Path) -> set[str]:
    """Top-level package names a file imports (at any depth of the file)."""
    tree = ast.parse(path.read_text(), str(path))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module.split(".")[0])
    return out


def files(package: str) -> list[Path]:
    return sorted((REPO / package).rglob("*.py"))


@pytest.mark.parametrize("path", files("vllm_kvevict"), ids=lambda p: str(p.relative_to(REPO)))
def test_the_package_never_imports_server_or_loadtest(path):
    assert not imports_of(path) & {"server", "loadtest"}


@pytest.mark.parametrize("path", files("server"), ids=lambda p: str(p.relative_to(REPO)))
def test_server_imports_neither_vllm_nor_the_package(path):
    """server/ gets what it needs at install time (integration/entrypoints/api_server.py is
    its adapter)."""
    assert not imports_of(path) & {"vllm", "vllm_kvevict"}


@pytest.mark.parametrize("path", [p for p in files("vllm_kvevict")
                                  if not {"integration", "selfcheck"} & set(p.parts)
                                  or p.name == "records.py"],
                         ids=lambda p: str(p.relative_to(REPO)))
def test_only_integration_imports_vllm(path):
    """Policies, ledger maths, stats, masks, reference, training, evaluation: plain Python
    (and the self-check's pass records, which the plugin's entry point reads)."""
    assert "vllm" not in imports_of(path)


SELFCHECK_VLLM_API = {("vllm", None), ("vllm", "LLM"), ("vllm", "SamplingParams"),
                      ("vllm.platforms", "current_platform")}


@pytest.mark.parametrize("path", files("vllm_kvevict/selfcheck"), ids=lambda p: p.name)
def test_the_selfcheck_uses_vllms_public_api_only(path):
    """The self-check drives vLLM as a user does (the offline LLM class), nothing internal."""
    used = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            used |= {(a.name, None) for a in node.names if a.name.split(".")[0] == "vllm"}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm":
            used |= {(node.module, a.name) for a in node.names}
    assert used <= SELFCHECK_VLLM_API, used - SELFCHECK_VLLM_API


GLUE_FUNCTION_LINES = 60


def long_functions(path: Path, limit: int) -> dict[str, int]:
    """`file:function` -> its lines (the def through its last line, docstring included) for
    every function or method of `path` longer than `limit`."""
    out = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            if lines > limit:
                out[f"{path.name}:{node.name}"] = lines
    return out


@pytest.mark.parametrize("path", files("vllm_kvevict/integration"),
                         ids=lambda p: str(p.relative_to(REPO / "vllm_kvevict/integration")))
def test_glue_functions_stay_short(path):
    """A glue function over 60 lines is two functions (judged by functions, not file length:
    a file is as long as its one concept needs)."""
    found = long_functions(path, GLUE_FUNCTION_LINES)
    assert not found, f"glue functions over {GLUE_FUNCTION_LINES} lines: {found}"


def vllm_names(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("vllm"):
            names |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.Import):
            names |= {a.asname or a.name.split(".")[0] for a in node.names
                      if a.name.startswith("vllm")}
    return names


@pytest.mark.parametrize("path", [p for p in files("vllm_kvevict/integration")
                                  if p.name != "registration.py"], ids=lambda p: p.name)
def test_no_monkeypatch_outside_the_registration_table(path):
    """Assigning to an attribute of something imported from vLLM (a class, a module) is a
    patch: it belongs in contract.WRAPS, where the contract test sees it."""
    tree = ast.parse(path.read_text())
    vllm = vllm_names(tree)
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else []
        for target in targets:
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name):
                assert target.value.id not in vllm, f"{path.name}:{node.lineno} patches vLLM"
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id == "setattr" and node.args
                and isinstance(node.args[0], ast.Name)):
            assert node.args[0].id not in vllm, f"{path.name}:{node.lineno} patches vLLM"


# -- imports between the package's own modules -------------------------------------------------

def own_modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of vllm_kvevict/ and server/."""
    out = {}
    for package in ("vllm_kvevict", "server"):
        for path in files(package):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def own_imports(module: str, path: Path | str, modules: dict, text: str | None = None
                ) -> tuple[set[str], list[str]]:
    """(the own modules `module` imports when it is loaded, the own modules imported inside its
    functions, once per import statement). `from p import m` counts as m when m is a module,
    else as p; a package's parent `__init__` running first is not an arrow (that is Python
    loading a package, not this module reaching back). `text`: the file's source, when it is
    not read from `path` (scripts/structure_stats.py reads commits through git)."""
    path = Path(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    at_load, in_functions = set(), []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                      ast.Lambda))
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:  # relative: from the package, `level - 1` packages up
                    up = package.split(".")[:len(package.split(".")) - (child.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                         for a in child.names]
            else:
                visit(child, inner)
                continue
            targets = {owner(n) for n in names} - {None, module}
            if inner:
                in_functions.extend(sorted(targets))
            else:
                at_load.update(targets)
    visit(ast.parse(path.read_text() if text is None else text, str(path)), False)
    return at_load, in_functions


def import_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph, as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := walk(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := walk(node)):
            return found
    return None


def test_no_import_cycle_among_the_package_modules():
    """The module-level imports of vllm_kvevict/ and server/ form no cycle (a cycle makes the
    import order decide whether a name exists yet). Imports inside functions are counted, not
    failed on: a cycle they close is reported as a warning."""
    import warnings

    modules = own_modules()
    at_load, in_functions = {}, {}
    for module, path in modules.items():
        at_load[module], in_functions[module] = own_imports(module, path, modules)
    cycle = import_cycle(at_load)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
    count = sum(len(v) for v in in_functions.values())
    print(f"{count} imports of the package's own modules inside functions")
    through_functions = import_cycle({m: at_load[m] | set(in_functions[m]) for m in modules})
    if through_functions:
        warnings.warn(f"{count} imports of the package inside functions; they close the cycle "
                      + " -> ".join(through_functions))


def test_no_import_cycle_counting_imports_inside_functions():
    """vllm_kvevict/'s import graph with the imports inside functions as arrows too has no
    cycle: a piece two modules share lives in the module that owns it. (An import stays inside a
    function only where vLLM's process model needs it, e.g. the plugin entry point, which runs
    in every vLLM process and must not import vLLM's engine at load.)"""
    modules = {m: p for m, p in own_modules().items() if m.split(".")[0] == "vllm_kvevict"}
    graph = {}
    for module, path in modules.items():
        at_load, in_functions = own_imports(module, path, modules)
        graph[module] = at_load | set(in_functions)
    cycle = import_cycle(graph)
    assert cycle is None, "import cycle (imports inside functions counted): " + " -> ".join(cycle)


def test_import_cycle_is_found():
    assert import_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert import_cycle({"a": {"b"}, "b": set()}) is None


def plain_python_files() -> list[Path]:
    return [REPO / "vllm_kvevict" / "launch.py", *files("loadtest"),
            *files("vllm_kvevict/evaluation")]


@pytest.mark.parametrize("path", plain_python_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_plain_python_imports_nothing_from_the_glue(path):
    """launch.py, loadtest/ and evaluation/ run as plain Python: nothing of vllm_kvevict's
    integration/ (the flag table they need is vllm_kvevict/flags.py)."""
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        for name in names:
            assert not name.startswith("vllm_kvevict.integration"), \
                f"{path.name}:{node.lineno} imports {name}"


# -- vLLM objects changed or read privately: declared in contract.TOUCHED ------------------

def own_attribute_names() -> set[str]:
    """Attributes our classes define: class-body names, methods, and `self.x = ...` targets."""
    own = set()
    for path in files("vllm_kvevict"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        own.add(item.name)
                    targets = (item.targets if isinstance(item, ast.Assign) else
                               [item.target] if isinstance(item, ast.AnnAssign) else [])
                    own |= {t.id for t in targets if isinstance(t, ast.Name)}
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                    and isinstance(node.value, ast.Name) and node.value.id == "self":
                own.add(node.attr)
    return own


def touched_in(path: Path, own: set[str]) -> set[tuple[str, str]]:
    """(file, attribute) for every attribute set on something other than `self` that our
    classes do not define, every `setattr` on a name, and every private attribute read that we
    do not define (on any object, `self` included: a subclass reading vLLM's)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr not in own:
            store = isinstance(node.ctx, ast.Store) and not (
                isinstance(node.value, ast.Name) and node.value.id == "self")
            private = node.attr.startswith("_") and not node.attr.startswith("__")
            if store or private:
                found.add((str(path.relative_to(REPO / "vllm_kvevict/integration")), node.attr))
    return found


def test_vllm_objects_touched_only_as_declared():
    from vllm_kvevict.integration.plugins.contract import touched_sites

    own = own_attribute_names()
    found = set().union(*(touched_in(p, own) for p in files("vllm_kvevict/integration")))
    declared = touched_sites()
    assert not found - declared, f"undeclared in contract.TOUCHED: {sorted(found - declared)}"
    assert not declared - found, f"declared but not found: {sorted(declared - found)}"


def test_touched_vllm_attributes_exist_in_vllm():
    """Every private name we read is one vLLM's source defines (a contract, like RELIED_ON)."""
    import vllm

    from vllm_kvevict.integration.plugins.contract import TOUCHED

    source = "\n".join(p.read_text(errors="replace")
                       for p in Path(vllm.__file__).parent.rglob("*.py"))
    for _, attribute, _ in TOUCHED:
        if attribute.startswith("_") and attribute != "_actions":  # argparse's, not vLLM's
            assert f".{attribute}" in source or f"def {attribute}" in source, attribute


def test_pyflakes_finds_nothing_in_the_code():
    """Undefined names and unused imports in the package, server/, loadtest/ and scripts/
    (an undefined name on a rarely taken branch once reached a served request)."""
    import io

    from pyflakes.api import checkRecursive
    from pyflakes.reporter import Reporter

    out = io.StringIO()
    count = checkRecursive([str(REPO / d) for d in ("vllm_kvevict", "server", "loadtest",
                                                      "scripts")], Reporter(out, out))
    assert count == 0, out.getvalue()


def test_the_design_layout_tables_name_every_module():
    """docs/design.md's layout tables match the tree: every module and package of
    vllm_kvevict/, and every file of integration/ (by its path there), is named."""
    text = (REPO / "docs" / "design.md").read_text()
    start = text.index("## Layout")
    layout = text[start:text.index("\n## ", start)]
    package = REPO / "vllm_kvevict"
    missing = [p.name for p in package.iterdir()
               if not p.name.startswith(("_", ".")) and p.name != "integration"
               and (p.suffix == ".py" or p.is_dir())
               and f"`{p.name}{'/' if p.is_dir() else ''}`" not in layout]
    glue = package / "integration"
    missing += [str(p.relative_to(glue)) for p in glue.rglob("*.py")
                if p.name != "__init__.py" and f"`{p.relative_to(glue)}`" not in layout]
    assert not missing, f"not in docs/design.md's layout tables: {missing}"


# The glue's folders, each named after the vLLM concept its files extend (vLLM's own tree).
CONCEPT_FOLDERS = {"plugins": "vllm/plugins", "entrypoints": "vllm/entrypoints",
                   "core": "vllm/v1/core", "kv_cache": "vllm/v1/kv_cache_interface.py",
                   "worker": "vllm/v1/worker", "attention": "vllm/v1/attention",
                   "kv_stats": "vllm/distributed/kv_transfer, vllm/v1/metrics"}


def test_every_glue_file_sits_in_a_concept_folder():
    """A glue module lives in the folder of the vLLM concept it extends, one level deep, and
    each folder says which concept in its docstring (a new mechanism is classes in them, not a
    new folder cutting across them)."""
    glue = REPO / "vllm_kvevict" / "integration"
    stray = [str(p.relative_to(glue)) for p in glue.rglob("*.py")
             if p.relative_to(glue).parts[0] not in CONCEPT_FOLDERS and p.name != "__init__.py"
             or len(p.relative_to(glue).parts) > 2]
    assert not stray, f"glue outside the concept folders {sorted(CONCEPT_FOLDERS)}: {stray}"
    folders = {p.name for p in glue.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == set(CONCEPT_FOLDERS), folders ^ set(CONCEPT_FOLDERS)
    for folder in CONCEPT_FOLDERS:
        assert ast.get_docstring(ast.parse((glue / folder / "__init__.py").read_text())), folder


# -- imports inside functions: only where vLLM's process model needs them, each with its reason --

IN_FUNCTION_IMPORT_FILES = {"vllm_kvevict/__init__.py",
                            "vllm_kvevict/integration/plugins/registration.py"}


def in_function_own_imports(path: Path) -> list[int]:
    """Line numbers of the package's own imports made inside a function of `path`."""
    lines = []
    for fn in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom):
                    own = node.level > 0 or (node.module or "").startswith("vllm_kvevict")
                elif isinstance(node, ast.Import):
                    own = any(a.name.startswith("vllm_kvevict") for a in node.names)
                else:
                    continue
                if own:
                    lines.append(node.lineno)
    return sorted(set(lines))


def test_imports_inside_functions_only_at_the_entry_points_with_a_reason():
    """The plugin's entry point and registration table import vLLM-bound modules lazily (the
    entry point runs in every process vLLM starts, before vLLM is ready); nowhere else, and
    each such import has a comment within the five lines above it saying why."""
    for path in files("vllm_kvevict"):
        lines = in_function_own_imports(path)
        name = str(path.relative_to(REPO))
        if not lines:
            continue
        assert name in IN_FUNCTION_IMPORT_FILES, f"{name}: own imports inside functions {lines}"
        text = path.read_text().splitlines()
        for line in lines:
            above = text[max(0, line - 6):line - 1]
            assert any(s.strip().startswith("#") for s in above), f"{name}:{line} has no reason"


# -- the policy's kind, chosen once by a factory per concept ----------------------------------

# Where the glue reads `ServedPolicy.kind` (and nowhere else): each builds its concept's part
# for the served kind (an attention impl per layer, the scheduler's admission rule, the
# worker's step planner).
KIND_FACTORIES = {"attention/context.py", "attention/flex_attention.py",
                  "core/kv_cache_manager.py", "worker/state.py"}


# Where the glue asks the policy's kind (issue 69's five forms): KVPolicyConfig predicates,
# KVPolicy properties, the worker state's token part or pool storage, the ledger's type, and
# layer-name suffixes (scripts/structure_stats.py counts the same lines).
KIND_PREDICATES = re.compile(
    r"\.(uses_head_mask|evicts_tokens|is_hybrid|patched|caches_token_prefixes|caches_prefixes|"
    r"reuses_across_questions|token_eviction|has_streaming_heads|in_pool)\b"
    r"|\.token is (not )?None"
    r"|isinstance\([^)]*TokenEvictionLedger\)"
    r"|(COMPANION_SUFFIX|HEAD_SUFFIX)\b(?! =)"
    r"|\.policy [!=]= \"full\"")

# The glue's lines that still ask, per file (at most 12 in all): the token ledger's modes
# (patched questions, reuse across questions), start-up's "is a policy on at all" gate, and
# the two layer-name schemes' own functions. Everything else reads what a factory chose.
KIND_BRANCHES = {"core/token_ledger.py": 2, "entrypoints/validation.py": 1,
                 "kv_cache/head_pages.py": 3, "kv_cache/sink_window.py": 2}


def kind_branch_lines(text: str) -> list[int]:
    """The lines of `text` (a module) that ask the kind, outside comments and docstrings."""
    docstrings = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) \
                and isinstance(node.value.value, str):
            docstrings |= set(range(node.lineno, node.end_lineno + 1))
    return [n for n, line in enumerate(text.splitlines(), 1)
            if n not in docstrings and KIND_PREDICATES.search(line.split("#")[0])
            and not line.lstrip().startswith(("def ", "@"))]


def test_the_glue_asks_the_kind_only_where_listed():
    glue = REPO / "vllm_kvevict" / "integration"
    found = {}
    for path in files("vllm_kvevict/integration"):
        lines = kind_branch_lines(path.read_text())
        if lines:
            found[str(path.relative_to(glue))] = len(lines)
    assert found == KIND_BRANCHES, found
    assert sum(KIND_BRANCHES.values()) <= 12


def test_kind_branch_lines_are_found():
    text = "x = 1\nif cfg.evicts_tokens:\n    pass\n# state.in_pool\nname + COMPANION_SUFFIX\n"
    assert kind_branch_lines(text) == [2, 5]


def test_the_served_kind_names_each_policy():
    from vllm_kvevict.config import KVPolicyConfig
    from vllm_kvevict.served import KINDS, ModelShape, ServedPolicy

    shape = ModelShape(num_layers=4, num_kv_heads=2, num_q_heads=4, head_dim=64)
    expected = {"full": "full", "streaming": "head_mask", "duo": "head_mask",
                "prulong": "head_mask", "snapkv": "token", "pyramidkv": "token"}
    for policy, kind in expected.items():
        raw = {"policy": policy} if policy == "full" else {"policy": policy, "sparsity": 0.5}
        served = ServedPolicy(KVPolicyConfig.from_dict(raw), "tiny", shape, policy=None)
        assert served.kind == kind, policy
    hybrid = KVPolicyConfig.from_dict({"policy": "prulong", "sparsity": 0.5,
                                       "token_policy": "snapkv"})
    assert ServedPolicy(hybrid, "tiny", shape, policy=None).kind == "hybrid"
    assert set(expected.values()) | {"hybrid"} == set(KINDS)


def test_the_kind_is_read_only_by_the_factories():
    """`.kind` is read in the factories' files only; the attention paths no longer ask the
    state which kind they serve (each kind has its impl class, chosen by `get_impl_cls`)."""
    glue = REPO / "vllm_kvevict" / "integration"
    readers = set()
    for path in files("vllm_kvevict/integration"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "kind" \
                    and isinstance(node.ctx, ast.Load):
                readers.add(str(path.relative_to(glue)))
    assert readers == KIND_FACTORIES, readers ^ KIND_FACTORIES
    for name in ("attention/backend.py", "attention/flex_attention.py"):
        text = (glue / name).read_text()
        assert ".token is not None" not in text and ".token is None" not in text, name


# -- walls: who imports whom, and per-process state ----------------------------------------

# The glue's floors, top to bottom (issue 85): the plugin's entry points; the API server's
# concepts; the step's two sides (the engine core's scheduler, the worker, which builds each
# step's data); attention, which reads it; the stats, the KV-cache concepts; plugins' plain data
# (versions, support, composition, the contract table), read by every floor. A module imports
# its own folder or a lower floor only: attention never reaches into the worker.
FLOORS = (("plugins/registration.py", "plugins/contract_report.py"), ("entrypoints",),
          ("core", "worker"), ("attention",), ("kv_stats",), ("kv_cache",), ("plugins",))


def floor_of(module: str) -> tuple[int, str] | None:
    """(floor, folder) of a glue module (None outside integration/)."""
    parts = module.split(".")
    if parts[:2] != ["vllm_kvevict", "integration"] or len(parts) < 4:
        return None
    path = "/".join(parts[2:]) + ".py"
    for floor, names in enumerate(FLOORS):
        if path in names or parts[2] in names:
            return floor, parts[2]
    raise AssertionError(f"{module}: on no floor of FLOORS")


def test_the_glue_imports_only_down_its_floors():
    modules = own_modules()
    upward = []
    for module, path in modules.items():
        here = floor_of(module)
        if here is None:
            continue
        at_load, in_functions = own_imports(module, path, modules)
        for target in sorted(at_load | set(in_functions)):
            there = floor_of(target)
            if there is not None and there[1] != here[1] and there[0] <= here[0]:
                upward.append(f"{module} -> {target}")
    assert not upward, "imports up or across the glue's floors: " + "; ".join(upward)


def test_no_attention_module_imports_the_worker():
    modules = own_modules()
    for module, path in modules.items():
        if module.startswith("vllm_kvevict.integration.attention."):
            at_load, in_functions = own_imports(module, path, modules)
            worker = [t for t in at_load | set(in_functions)
                      if t.startswith("vllm_kvevict.integration.worker")]
            assert not worker, f"{module} imports {worker}"


# Every module-level name a function rebinds (`global`): one statement per process entry, in
# the function that sets it (`file: (function, names)`). Everything else per process is handed
# down from these.
GLOBAL_STATEMENTS = {
    # every vLLM process: the plugin applies its table once
    "vllm_kvevict/integration/plugins/registration.py":
        ("register", {"_registered", "inactive_reason", "unlocked_by"}),
    # every process: the served policy, built once per configuration (unit tests serve several)
    "vllm_kvevict/served.py": ("served_policy", {"_served", "_served_key", "builds"}),
    # a worker: the attention context, set once before the model is built
    "vllm_kvevict/integration/attention/context.py": ("set_attention_context", {"_context"}),
    # the API server: the engine config it created, and its Prometheus series
    "vllm_kvevict/integration/entrypoints/api_server.py": ("remember_config", {"_vllm_config"}),
    "server/metrics.py": ("get_metrics", {"_metrics"}),
}


def global_statements(path: Path) -> list[tuple[str, set[str]]]:
    """(function, names) of each `global` statement in `path`."""
    out = []
    for fn in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out += [(fn.name, set(node.names)) for node in ast.walk(fn)
                    if isinstance(node, ast.Global)]
    return out


def test_global_statements_only_at_the_process_entries():
    found = {}
    for path in files("vllm_kvevict") + files("server"):
        statements = global_statements(path)
        if statements:
            assert len(statements) == 1, f"{path}: {len(statements)} global statements"
            found[str(path.relative_to(REPO))] = statements[0]
    assert found == GLOBAL_STATEMENTS


def test_the_attention_context_is_set_once():
    from vllm_kvevict.integration.attention import context

    saved = context._context
    try:
        context._context = None
        assert context.attention_kind() == "full"  # no worker here: vLLM's own path
        first = object.__new__(context.AttentionContext)
        assert context.set_attention_context(first) is first
        assert context.set_attention_context(first) is first  # (the same one: no change)
        with pytest.raises(RuntimeError, match="set once"):
            context.set_attention_context(object.__new__(context.AttentionContext))
        assert context.attention_context() is first
    finally:
        context._context = saved
