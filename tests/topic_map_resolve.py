"""Resolving the expressions of a role's code to what they name: registry topics (by name),
consumer groups, consumers and faust apps (tests/topic_map_ast.py says what counts as a site).

A topic expression is resolved through the names imported from `topics` (their real values),
inference_topic(...) (the topic of a placeholder model, MODEL), spec_for("<name>"), topic objects
(topic(app, SPEC), app.topic(A.name, ...)), and the assignments of the enclosing functions, class
(self.x) and module, across project modules. What does not resolve is None.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

from topics import registry
from topics.registry import TopicSpec

MODEL = "model"  # the placeholder model of every inference topic and worker group
REGISTRY_MODULES = ("topics", "topics.registry")


@dataclass(frozen=True)
class Topics:
    names: frozenset[str]


@dataclass(frozen=True)
class Str:
    value: str | None


@dataclass(frozen=True)
class Consumer:
    group: Str | None  # None: a group that did not resolve


@dataclass(frozen=True)
class App:
    group: str


def _merge(values: list) -> object | None:
    values = [v for v in values if v is not None]
    topics = [v for v in values if isinstance(v, Topics)]
    if topics:
        return Topics(frozenset().union(*(t.names for t in topics)))
    if values and all(v == values[0] for v in values):
        return values[0]
    return None


def _from_registry(attr: str) -> object | None:
    value = getattr(registry, attr, None)
    if isinstance(value, TopicSpec):
        return Topics(frozenset({value.name}))
    if isinstance(value, str):
        return Str(value)
    return None


def call_name(call: ast.Call) -> str:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def bindings(body: ast.AST, out: dict[str, list[ast.expr]], self_only: bool = False) -> None:
    """name (or self.attr) -> every expression assigned to it anywhere under `body`."""
    for node in ast.walk(body):
        pairs: list[tuple[ast.expr, ast.expr]] = []
        if isinstance(node, ast.Assign):
            pairs = [(t, node.value) for t in node.targets]
        elif isinstance(node, ast.NamedExpr) or (isinstance(node, ast.AnnAssign) and node.value is not None):
            pairs = [(node.target, node.value)]
        elif isinstance(node, (ast.For, ast.AsyncFor)) and isinstance(node.iter, (ast.Tuple, ast.List)):
            pairs = [(node.target, elt) for elt in node.iter.elts]
        while pairs:
            target, value = pairs.pop()
            if isinstance(target, (ast.Tuple, ast.List)):
                if isinstance(value, (ast.Tuple, ast.List)) and len(value.elts) == len(target.elts):
                    pairs += list(zip(target.elts, value.elts))
                continue
            key = _dotted(target)
            if key is None or (self_only and not key.startswith("self.")) or (not self_only and "." in key):
                continue
            out.setdefault(key, []).append(value)


class Project:
    """The modules under `root`, parsed once each."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.modules: dict[str, Module | None] = {}

    def module(self, name: str) -> Module | None:
        if name not in self.modules:
            base = self.root.joinpath(*name.split("."))
            path = next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()), None)
            self.modules[name] = Module(self, path) if path is not None else None
        return self.modules[name]


class Module:
    def __init__(self, project: Project, path: Path) -> None:
        self.project, self.path = project, path
        self.rel = path.relative_to(project.root).as_posix()
        self.tree = ast.parse(path.read_text(), str(path))
        self.imports: dict[str, tuple[str, str | None]] = {}  # local name -> (module, attribute or None)
        for node in ast.walk(self.tree):  # lazy imports inside functions count too
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for alias in node.names:
                    self.imports[alias.asname or alias.name] = (node.module, alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:  # import topics; import topics.registry as r
                    local = alias.asname or alias.name.partition(".")[0]
                    self.imports[local] = (alias.name if alias.asname else local, None)
        self.env: dict[str, list[ast.expr]] = {}
        for stmt in self.tree.body:
            if not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                bindings(stmt, self.env)

    def global_value(self, name: str, depth: int) -> object | None:
        if name in self.env:
            return _merge([Scope(self, [self.env], {}).resolve(v, depth + 1) for v in self.env[name]])
        return self.imported(name, depth)

    def imported(self, name: str, depth: int) -> object | None:
        if name not in self.imports:
            return None
        mod, attr = self.imports[name]
        if attr is None:
            return None
        if mod in REGISTRY_MODULES:
            return _from_registry(attr)
        other = self.project.module(mod)
        return other.global_value(attr, depth + 1) if other is not None else None


class Scope:
    """Where an expression is resolved: its functions' bindings (innermost last), its class's."""

    def __init__(
        self, module: Module, frames: list[dict[str, list[ast.expr]]], cls: dict[str, list[ast.expr]]
    ) -> None:
        self.module, self.frames, self.cls = module, frames, cls

    def lookup(self, key: str, depth: int) -> object | None:
        if key.startswith("self."):
            return _merge([self.resolve(v, depth + 1) for v in self.cls.get(key, [])])
        for frame in reversed(self.frames):
            if key in frame:
                return _merge([self.resolve(v, depth + 1) for v in frame[key]])
        return self.module.imported(key, depth)

    def resolve(self, node: ast.expr | None, depth: int = 0) -> object | None:
        if node is None or depth > 12:
            return None
        if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, str)):
            return Str(node.value)
        if isinstance(node, ast.JoinedStr):
            return Str("".join(v.value if isinstance(v, ast.Constant) else MODEL for v in node.values))
        if isinstance(node, ast.Await):
            return self.resolve(node.value, depth + 1)
        if isinstance(node, ast.BoolOp):
            return _merge([self.resolve(v, depth + 1) for v in node.values])
        if isinstance(node, ast.IfExp):
            return _merge([self.resolve(node.body, depth + 1), self.resolve(node.orelse, depth + 1)])
        if isinstance(node, ast.Name):
            return self.lookup(node.id, depth)
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id == "self":
                return self.lookup(f"self.{node.attr}", depth)
            if isinstance(node.value, ast.Name) and self.module.imports.get(node.value.id) in (
                (m, None) for m in REGISTRY_MODULES
            ):
                return _from_registry(node.attr)  # import topics.registry as r; r.TOKENS
            if node.attr == "name":
                value = self.resolve(node.value, depth + 1)
                return value if isinstance(value, Topics) else None
            return None
        if isinstance(node, ast.Call):
            return self._call(node, depth)
        return None

    def _call(self, call: ast.Call, depth: int) -> object | None:
        name, args = call_name(call), call.args
        keywords = {k.arg: k.value for k in call.keywords if k.arg}
        if name == "inference_topic":
            return Topics(frozenset({registry.inference_topic(MODEL).name}))
        if name == "worker_group":
            return Str(registry.worker_group(MODEL))
        if name in ("processor_group", "make_app") and args and isinstance(args[0], ast.Constant):
            group = registry.processor_group(args[0].value)
            return App(group) if name == "make_app" else Str(group)
        if name == "spec_for" and args and isinstance(args[0], ast.Constant):
            return Topics(frozenset({registry.spec_for(args[0].value).name}))
        if name == "topic" and isinstance(call.func, ast.Name) and len(args) >= 2:
            return self.resolve(args[1], depth + 1)  # processors.faust_app.topic(app, SPEC)
        if name == "topic" and isinstance(call.func, ast.Attribute):
            return _merge([self.resolve(a, depth + 1) for a in args])  # app.topic(A.name, B.name, ...)
        if name == "table" and len(args) >= 2:
            return self.resolve(args[1], depth + 1)
        if name == "setdefault" and len(args) == 2:
            return self.resolve(args[1], depth + 1)
        if name == "start_consumer":
            return Consumer(self._str(keywords.get("group"), depth))
        if name == "AIOKafkaConsumer":
            group = keywords.get("group_id")
            return Consumer(Str(None) if group is None else self._str(group, depth))
        return None

    def _str(self, node: ast.expr | None, depth: int) -> Str | None:
        value = self.resolve(node, depth + 1)
        return value if isinstance(value, Str) else None
