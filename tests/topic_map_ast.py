"""The topic map as the code draws it: which role writes and reads which topic, derived statically
(from the syntax tree) from each role's package, to be held against topics/registry.py.

What counts as a write or a read, in a role's package:

writes  publish(producer, SPEC, ...)            producers.publish
        send(target, SPEC, ...)                 processors.faust_app.send
        <producer>.send(SPEC.name, ...)         aiokafka's producer, directly
        <topic object>.send(...)                a faust topic made by topic(app, SPEC) or app.topic(...)
        dead_letter(...)                        producers.dead_letter: ts.deadletter
        typed(stream, specs, TOPIC)             processors.faust_app.typed dead-letters what it cannot decode
        events(consumer, producer, specs)       producers.events does the same
        table(app, SPEC, name)                  a faust table writes its changelog, reads it back (group-less)
reads   @app.agent(TOPIC)                       a faust agent, in group ts-<role> of app = make_app("<role>")
        start_consumer(*SPECS, group=G)         producers.start_consumer subscribed at once
        AIOKafkaConsumer(*NAMES, group_id=G)    the same, made directly
        <consumer>.subscribe([SPEC.name, ...])  in the group its start_consumer / AIOKafkaConsumer named
        TopicPartition(SPEC.name, p)            manual assignment: group-less
        <sampler>.sample(GROUP, SPEC.name)      producers.lag.LagSampler: a group's lag, group-less
        ... in <spec>.readers                   registry-driven: every topic the registry gives the role (ANY)

Topic and group expressions are resolved by tests/topic_map_resolve.py. A site whose topic (or
consumer group) cannot be resolved is reported as unresolved, never dropped.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

from tests.topic_map_resolve import (
    MODEL,
    App,
    Consumer,
    Module,
    Project,
    Scope,
    Str,
    Topics,
    bindings,
    call_name,
)
from topics import registry
from topics.registry import Role, TopicSpec

__all__ = [
    "ANY",
    "MODEL",
    "ROLE_PACKAGES",
    "SHARED",
    "Derived",
    "Flow",
    "compare",
    "derive",
    "registry_flows",
]

ROOT = Path(__file__).resolve().parent.parent
ANY = "*"  # the topic of a registry-driven read

ROLE_PACKAGES: dict[Role, tuple[str, ...]] = {
    Role.GATEWAY: ("gateway",),
    Role.CONVERSATION: ("processors/conversation",),
    Role.SAFETY: ("processors/safety",),
    Role.ROUTER: ("processors/router",),
    Role.WORKER: ("gpu_workers",),
    Role.TOOLS: ("tools",),
    Role.AUDIT: ("audit",),
    Role.OPERATOR: ("tokenstream",),
}
#: Libraries the roles share: what they write on a caller's behalf is attributed to the caller
#: (typed, dead_letter, events); tests check they write nothing else.
SHARED = (
    "producers",
    "processors/faust_app.py",
    "processors/delivery.py",
    "processors/effects.py",
    "processors/cli.py",
    "processors/__init__.py",
)


@dataclass(frozen=True, order=True)
class Flow:
    kind: str  # "writes" | "reads"
    topic: str
    role: Role | None  # None: a shared library, on its caller's behalf
    group: str | None = None

    def __str__(self) -> str:
        group = "" if self.kind == "writes" else f" (group {self.group})" if self.group else " (group-less)"
        return f"{self.role.value if self.role else 'shared'} {self.kind} {self.topic}{group}"


@dataclass
class Derived:
    flows: dict[Flow, list[str]] = field(default_factory=dict)  # flow -> the sites (path:line) seen
    unresolved: list[tuple[str, int, str]] = field(default_factory=list)  # (path, line, source)

    def add(self, flow: Flow, where: str) -> None:
        self.flows.setdefault(flow, []).append(where)


class Sites(ast.NodeVisitor):
    """Every write and read of one module, attributed to `role` (None: a shared library)."""

    def __init__(self, module: Module, role: Role | None, out: Derived) -> None:
        self.module, self.role, self.out = module, role, out
        self.frames: list[dict[str, list[ast.expr]]] = [module.env]
        self.cls: dict[str, list[ast.expr]] = {}
        self.functions: list[str] = []  # the enclosing classes and functions, to say where a site is

    # -- scopes
    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        saved, self.cls = self.cls, {}
        bindings(node, self.cls, self_only=True)
        self.functions.append(node.name)
        self.generic_visit(node)
        self.functions.pop()
        self.cls = saved

    def _function(self, node) -> None:
        frame: dict[str, list[ast.expr]] = {}
        for stmt in node.body if not isinstance(node, ast.Lambda) else [node.body]:
            bindings(stmt, frame)
        for deco in getattr(node, "decorator_list", []):
            self._decorator(deco)
        self.frames.append(frame)
        self.functions.append(getattr(node, "name", "<lambda>"))
        for child in node.body if not isinstance(node, ast.Lambda) else [node.body]:
            self.visit(child)
        self.functions.pop()
        self.frames.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    @property
    def scope(self) -> Scope:
        return Scope(self.module, self.frames, self.cls)

    # -- recording
    def _where(self, node: ast.AST) -> str:
        fn = f" in {'.'.join(self.functions)}" if self.functions else ""
        return f"{self.module.rel}:{node.lineno}{fn}"

    def _unresolved(self, node: ast.AST) -> None:
        source = ast.unparse(node)
        self.out.unresolved.append(
            (self.module.rel, node.lineno, source if len(source) <= 60 else source[:57] + "...")
        )

    def _flow(self, kind: str, value: object | None, node: ast.AST, group: str | None = None) -> None:
        if not isinstance(value, Topics):
            self._unresolved(node)
            return
        for name in value.names:
            self.out.add(Flow(kind, name, self.role, group), self._where(node))

    def _write(self, value: object | None, node: ast.AST) -> None:
        self._flow("writes", value, node)

    def _read(self, value: object | None, node: ast.AST, group: Str | None) -> None:
        if group is None:
            self._unresolved(node)
        else:
            self._flow("reads", value, node, group.value)

    # -- the sites
    def _decorator(self, deco: ast.expr) -> None:
        if isinstance(deco, ast.Call) and call_name(deco) == "agent" and isinstance(deco.func, ast.Attribute):
            app = self.scope.resolve(deco.func.value)
            if not isinstance(app, App) or not deco.args:
                self._unresolved(deco)
                return
            self._read(self.scope.resolve(deco.args[0]), deco, Str(app.group))

    def visit_Compare(self, node: ast.Compare) -> None:
        if any(isinstance(op, ast.In) for op in node.ops) and any(
            isinstance(c, ast.Attribute) and c.attr == "readers" for c in node.comparators
        ):
            self._read(Topics(frozenset({ANY})), node, Str(None))
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        self._call(node)
        self.generic_visit(node)

    def _call(self, node: ast.Call) -> None:
        name, args, scope = call_name(node), node.args, self.scope
        keywords = {k.arg: k.value for k in node.keywords if k.arg}
        bare = isinstance(node.func, ast.Name)
        origin = self.module.imports.get(node.func.id, ("", ""))[0] if bare else ""
        if name == "publish" and len(args) >= 2:
            self._write(scope.resolve(args[1]), node)
        elif name == "send" and bare and len(args) >= 2:
            self._write(scope.resolve(args[1]), node)  # processors.faust_app.send(target, SPEC, event)
        elif name == "send" and not bare:
            target = scope.resolve(node.func.value)
            if isinstance(target, Topics):
                self._write(target, node)  # a faust topic object's own send
            elif args and isinstance(scope.resolve(args[0]), Topics):
                self._write(scope.resolve(args[0]), node)  # producer.send(SPEC.name, ...)
            elif args and isinstance(args[0], ast.Attribute) and args[0].attr == "name":
                self._unresolved(node)
        elif name == "dead_letter":
            self._write(Topics(frozenset({registry.DEAD_LETTER.name})), node)
        elif name == "typed" and bare and len(args) >= 3:
            self._write(scope.resolve(args[2]), node)
        elif name == "events" and bare and origin.startswith("producers"):
            self._write(Topics(frozenset({registry.DEAD_LETTER.name})), node)
        elif name == "table" and bare and len(args) >= 2:
            spec = scope.resolve(args[1])
            self._write(spec, node)
            self._read(spec, node, Str(None))
        elif name in ("start_consumer", "AIOKafkaConsumer"):
            consumer = scope.resolve(node)
            assert isinstance(consumer, Consumer)
            for arg in args:
                self._read(
                    scope.resolve(arg.value if isinstance(arg, ast.Starred) else arg), node, consumer.group
                )
        elif name == "subscribe" and not bare:
            consumer = scope.resolve(node.func.value)
            names = args[0] if args else keywords.get("topics")
            listed = isinstance(names, (ast.List, ast.Tuple, ast.Set))
            if not isinstance(consumer, Consumer) and not listed:
                return  # not a Kafka consumer's subscribe (gateway.fanout.Fanout.subscribe(request_id))
            if not isinstance(consumer, Consumer) or not listed:
                self._unresolved(node)
                return
            for elt in names.elts:
                self._read(scope.resolve(elt), node, consumer.group)
        elif name == "TopicPartition" and args:
            self._read(scope.resolve(args[0]), node, Str(None))
        elif name == "sample" and not bare and len(args) == 2:
            self._read(scope.resolve(args[1]), node, Str(None))


def role_of(rel: str, packages: dict[Role, tuple[str, ...]]) -> Role | None:
    best: tuple[int, Role] | None = None
    for role, prefixes in packages.items():
        for prefix in prefixes:
            if (rel == prefix or rel.startswith(prefix.rstrip("/") + "/")) and (
                best is None or len(prefix) > best[0]
            ):
                best = (len(prefix), role)
    return best[1] if best else None


def derive(
    root: Path = ROOT,
    packages: dict[Role, tuple[str, ...]] = ROLE_PACKAGES,
    only: tuple[str, ...] | None = None,
) -> Derived:
    """Every write and read the code of each role's package makes (or, with `only`, of those paths,
    attributed to no role: the shared libraries)."""
    project, out = Project(root), Derived()
    prefixes = only if only is not None else tuple(p for ps in packages.values() for p in ps)
    for prefix in prefixes:
        base = root / prefix
        for path in sorted([base] if base.is_file() else base.rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            parts = path.relative_to(root).with_suffix("").parts
            module = project.module(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
            assert module is not None, rel
            Sites(module, None if only is not None else role_of(rel, packages), out).visit(module.tree)
    return out


def registry_flows(specs: list[TopicSpec]) -> set[Flow]:
    flows = {Flow("writes", s.name, w.role) for s in specs for w in s.writers}
    return flows | {Flow("reads", s.name, r.role, r.group) for s in specs for r in s.readers}


def compare(code: set[Flow], mapped: set[Flow]) -> tuple[set[Flow], set[Flow]]:
    """(in the code, not in the map; in the map, not in the code). A role whose code reads what the
    registry gives it (ANY) reads, by construction, every topic the map has it read group-less."""
    driven = {f.role for f in code if f.topic == ANY}
    named = {(f.role, f.topic) for f in code if f.kind == "reads"}  # read by name besides (the ledger)
    mapped = {
        Flow("reads", ANY, f.role)
        if f.kind == "reads" and f.role in driven and f.group is None and (f.role, f.topic) not in named
        else f
        for f in mapped
    }
    return code - mapped, mapped - code
