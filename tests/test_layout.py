"""The code's shape, checked (docs/design.md, "Layout"): which package may import which, every
monkeypatch of vLLM in the registration table, glue files small enough to read."""

from __future__ import annotations

import ast
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
    """server/ gets what it needs at install time (integration/api_server.py is its adapter)."""
    assert not imports_of(path) & {"vllm", "vllm_kvevict"}


@pytest.mark.parametrize("path", [p for p in files("vllm_kvevict") if "integration" not in p.parts],
                         ids=lambda p: str(p.relative_to(REPO)))
def test_only_integration_imports_vllm(path):
    """Policies, ledger maths, stats, masks, reference, training, evaluation: plain Python."""
    assert "vllm" not in imports_of(path)


@pytest.mark.parametrize("path", files("vllm_kvevict/integration"),
                         ids=lambda p: p.name)
def test_glue_files_stay_small(path):
    assert len(path.read_text().splitlines()) <= 300


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
    patch: it belongs in registration.WRAPS, where the contract test sees it."""
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
