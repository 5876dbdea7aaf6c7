"""The shape of the house: every import runs downward, no role imports another, and nothing forms a circle.

Layers, bottom up (a package may import its own layer's shared packages and any layer below):

    schemas                                   the event contracts
    common, safety_model                      the leaf (configuration, tracing, models, ...), the safety model
    topics, producers                         the registry and the one place Kafka clients come from
    gateway, processors, gpu_workers, tools,  the roles (and the auditors' reader of the log);
    audit                                     none imports another
    tokenstream, bench                        the top: the CLI, stack, operator tools and benchmarks

Every import counts, a function's lazy one included: a lazy import upward is still an arrow upward.
"""

from __future__ import annotations

import ast
import importlib
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = [
    {"schemas"},
    {"common", "safety_model"},
    {"topics", "producers"},
    {"gateway", "processors", "gpu_workers", "tools", "audit"},
    {"tokenstream", "bench"},
]
ROLES = LAYERS[3]
# What each shared package of a layer may import from its own layer (a DAG inside the layer).
WITHIN = {
    "safety_model": set(),
    "common": set(),
    "topics": set(),
    "producers": {"topics"},
    "tokenstream": set(),
    "bench": {"tokenstream"},
}
LEVEL = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}


def project_modules() -> dict[str, Path]:
    modules = {}
    for pkg in LEVEL:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imports_of(path: Path, module: str) -> set[str]:
    """Every project module `path` imports, relative imports resolved, at any depth of the file."""
    found = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(n for n in names if n.split(".")[0] in LEVEL)
    return found


def module_graph() -> dict[str, set[str]]:
    modules = project_modules()
    graph = defaultdict(set)
    for module, path in modules.items():
        for target in imports_of(path, module):
            while target not in modules and "." in target:
                target = target.rpartition(".")[0]  # `from pkg.mod import name`: the module is pkg.mod
            if target in modules and target != module:
                graph[module].add(target)
    return graph


def wrong_arrows(graph: dict[str, set[str]]) -> list[str]:
    wrong = []
    for source, targets in graph.items():
        a = source.split(".")[0]
        for target in targets:
            b = target.split(".")[0]
            if a == b:
                continue
            if LEVEL[b] > LEVEL[a]:
                wrong.append(f"{source} -> {target}: upward ({a} is below {b})")
            elif LEVEL[b] == LEVEL[a] and a in ROLES:
                wrong.append(f"{source} -> {target}: one role imports another")
            elif LEVEL[b] == LEVEL[a] and b not in WITHIN.get(a, set()):
                wrong.append(f"{source} -> {target}: sideways within a layer")
    return sorted(wrong)


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one node (Tarjan), each a circle of imports."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                top = stack.pop()
                on.discard(top)
                group.append(top)
                if top == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in list(graph):
        if node not in index:
            visit(node)
    return found


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    packages = defaultdict(set)
    for source, targets in graph.items():
        for target in targets:
            if source.split(".")[0] != target.split(".")[0]:
                packages[source.split(".")[0]].add(target.split(".")[0])
    return packages


def test_every_import_runs_downward_and_no_role_imports_another():
    assert wrong_arrows(module_graph()) == []


def test_no_circle_of_files():
    assert circles(module_graph()) == []


def test_no_circle_of_packages():
    assert circles(package_graph(module_graph())) == []


def test_every_project_package_has_a_layer():
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()} - {"tests"}
    assert packages == set(LEVEL)


def test_each_top_level_folder_says_its_purpose_in_its_first_docstring_line():
    for pkg in LEVEL:
        doc = ast.get_docstring(ast.parse((ROOT / pkg / "__init__.py").read_text()))
        assert doc and len(doc.splitlines()[0]) > 20, f"{pkg}/__init__.py: no first docstring line"


def test_the_checks_catch_an_upward_import_a_role_importing_a_role_and_a_circle():
    graph = {
        "common.config": {"gateway.app"},
        "gateway.app": {"processors.cli"},
        "tools.a": {"tools.b"},
        "tools.b": {"tools.a"},
    }
    wrong = wrong_arrows(graph)
    assert any("common.config -> gateway.app: upward" in w for w in wrong)
    assert any("gateway.app -> processors.cli: one role imports another" in w for w in wrong)
    assert circles(graph) == [["tools.a", "tools.b"]]


def test_every_command_of_the_cli_resolves_to_a_module_that_imports():
    from tokenstream import cli

    for table in (cli.ROLE_COMMANDS, cli.PASS_THROUGH, cli.TOOL_APPS):
        for target in table.values():
            module, attr = target.split(":")
            assert hasattr(importlib.import_module(module), attr), target


def test_a_missing_role_module_is_an_error_not_a_skipped_command(monkeypatch):
    from tokenstream import cli

    monkeypatch.setattr(cli, "ROLE_COMMANDS", {(cli.app, "nothing"): "gateway.no_such_module:main"})
    monkeypatch.setattr(cli, "TOOL_APPS", {})
    with pytest.raises(ModuleNotFoundError):
        cli._register()
