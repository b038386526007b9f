"""Package-level import graph of ``rl_jax`` and the edges that break its layering.

Reads every module under ``rl_jax/`` with :mod:`ast` (nothing is imported or run) and records
each import of an ``rl_jax`` module: at module level, inside functions (``kind = function``),
and by name in a ``"rl_jax.x.y:attr"`` or ``"rl_jax.x.y"`` string handed to
``importlib.import_module`` (``kind = dynamic``, e.g. a registry of lazily loaded classes).
Edges are then folded to packages (``rl_jax.envs.code`` -> ``envs``; a top-level module such as
``rl_jax/sharding.py`` is its own package).

:data:`LAYERS` lists the packages from the lowest layer up. A package may import packages of its
own layer or lower layers; an import of a higher layer is an *upward edge*. Packages that import
each other (a cycle between packages, whatever their layers) are reported too.

Inside the packages of :data:`SUBLAYERS` (the generator, the transfer service), subpackages are
layered the same way, and subpackages of one layer never import each other. Modules never import
each other in a cycle. Every project name has one home, the module that defines it: it is
imported from there (:func:`imports_from_elsewhere`), and no module imports a project name it
does not use (:func:`re_exports`: a second home kept for others to import from).

Usage::

    python tools/import_graph.py            # edges and every breach above; exit 1 if any
    python tools/import_graph.py --modules  # also the module edges behind the package edges
"""

from __future__ import annotations

import argparse
import ast
import collections
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = "rl_jax"

# Lowest first. Packages within one tuple may import each other (one way: a cycle is reported);
# a package missing here is reported, so that its place is decided when it is added. Data flows
# prompts (data) -> generator -> rollout -> trainer, with environments (envs) scoring
# completions of data's prompts; the orchestrator wires the roles; ``errors`` gathers the
# user-facing error types of every layer for the entry points.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors",),  # the base error types every package's user errors derive from
    ("compile_cache", "cpus", "heap", "metrics", "native", "procs"),
    ("distributed", "sharding"),
    ("data",),
    ("envs", "losses", "models"),
    ("generator", "trainer", "transfer"),
    ("recipe",),  # checks names against the registries below it
    ("rollout",),
    ("orchestrator", "sysmodel"),
    ("cluster",),  # launches the roles on a cluster engine (Ray)
)

# Within a package: its subpackages from the lowest layer up ("" = the package's own modules,
# what its sides share). A module may import its own subpackage and lower layers; subpackages of
# one layer never import each other (the server may import the engine, never the reverse; the
# client neither; the puller never imports the publisher).
SUBLAYERS: dict[str, tuple[tuple[str, ...], ...]] = {
    "generator": (("",), ("engine", "client"), ("server",), ("launcher",)),
    "transfer": (("",), ("transports",), ("publisher", "puller"), ("sglang",)),
}

_MODULE_STRING = re.compile(rf"^({PACKAGE}(?:\.\w+)+)(?::\w+)?$")


def module_name(path: pathlib.Path, root: pathlib.Path = ROOT) -> str:
    """``rl_jax/envs/code.py`` -> ``rl_jax.envs.code``; a package's ``__init__`` -> the package."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_of(module: str) -> str:
    """The first component below ``rl_jax`` (``rl_jax`` itself for the top package)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _resolve(module: str, is_package: bool, level: int, name: str | None) -> str:
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - (level - 1)] if level > 1 else base
    return ".".join(base + ([name] if name else []))


def imports_of(path: pathlib.Path, root: pathlib.Path = ROOT) -> list[tuple[str, str]]:
    """``(imported rl_jax module, kind)`` for every import in the file at ``path``."""
    module = module_name(path, root)
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[tuple[str, str]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        kind = "function" if in_function else "module"
        if isinstance(node, ast.Import):
            found.extend((alias.name, kind) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = (_resolve(module, path.name == "__init__.py", node.level, node.module)
                      if node.level else node.module or "")
            found.append((target, kind))
            # ``from rl_jax.envs import sandbox`` imports the submodule too.
            found.extend((f"{target}.{alias.name}", kind) for alias in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            match = _MODULE_STRING.match(node.value)
            if match:
                found.append((match[1], "dynamic"))
        inner = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                 ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(tree, False)
    return found


def collect(root: pathlib.Path = ROOT) -> dict[tuple[str, str], set[str]]:
    """``(importing module, imported module) -> kinds`` over every module of the package."""
    modules = {module_name(p, root): p for p in sorted((root / PACKAGE).rglob("*.py"))}
    edges: dict[tuple[str, str], set[str]] = collections.defaultdict(set)
    for source, path in modules.items():
        for target, kind in imports_of(path, root):
            # Keep the longest prefix that names a real module (drops imported attributes).
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target.startswith(PACKAGE + ".") and target != source:
                edges[(source, target)].add(kind)
    return edges


def package_edges(edges: dict[tuple[str, str], set[str]]) -> dict[tuple[str, str], set[str]]:
    """Module edges folded to packages, self-edges dropped."""
    folded: dict[tuple[str, str], set[str]] = collections.defaultdict(set)
    for (source, target), kinds in edges.items():
        a, b = package_of(source), package_of(target)
        if a != b:
            folded[(a, b)] |= kinds
    return folded


def subpackage_of(module: str, packages: set[str]) -> str:
    """``rl_jax.generator.engine.core`` -> ``engine``; ``""`` for a package's own modules
    (``rl_jax.generator.types``); ``packages``: the modules that are packages."""
    parts = module.split(".")
    if len(parts) >= 4 or (len(parts) == 3 and module in packages):
        return parts[2]
    return ""


def sublayer_edges(edges: dict[tuple[str, str], set[str]]) -> list[str]:
    """``importer -> imported (sub -> sub)`` for every module edge inside a package of
    :data:`SUBLAYERS` that goes up its sub-layers or sideways between subpackages of one layer,
    and for modules in a subpackage the package's :data:`SUBLAYERS` entry does not place."""
    modules = {m for edge in edges for m in edge}
    packages = {m for m in modules if any(o.startswith(m + ".") for o in modules)}
    found = []
    for (source, target), kinds in sorted(edges.items()):
        package = package_of(source)
        if package not in SUBLAYERS or package_of(target) != package:
            continue
        layers = SUBLAYERS[package]
        a, b = subpackage_of(source, packages), subpackage_of(target, packages)
        la = next((i for i, layer in enumerate(layers) if a in layer), None)
        lb = next((i for i, layer in enumerate(layers) if b in layer), None)
        if la is None or lb is None:
            found.append(f"{source} -> {target} (subpackage {a if la is None else b!r} is not "
                         f"in SUBLAYERS[{package!r}])")
        elif a != b and lb >= la:
            found.append(f"{source} -> {target} ({a or package} -> {b or package}, "
                         f"{', '.join(sorted(kinds))})")
    return found


def layer_of(package: str) -> int | None:
    """Index of the layer holding ``package``, or None if :data:`LAYERS` does not place it."""
    return next((i for i, layer in enumerate(LAYERS) if package in layer), None)


def upward_edges(folded: dict[tuple[str, str], set[str]]) -> list[tuple[str, str]]:
    """Package edges from a lower layer of :data:`LAYERS` to a higher one."""
    return [(a, b) for a, b in sorted(folded) if None not in (layer_of(a), layer_of(b))
            and layer_of(a) < layer_of(b)]


def cycles(folded: dict[tuple[str, str], set[str]]) -> list[list[str]]:
    """Strongly connected sets of two or more nodes (packages or modules; Tarjan's algorithm)."""
    graph: dict[str, list[str]] = collections.defaultdict(list)
    for a, b in folded:
        graph[a].append(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(set(graph) | {b for _, b in folded}):
        if v not in index:
            strongconnect(v)
    return found


def _top_level_names(tree: ast.Module) -> tuple[set[str], dict[str, tuple[str, str]]]:
    """Names a module defines at its top level (in ``if``/``try``/``with`` blocks too), and
    ``name -> (module, original name)`` for those it imports with ``from ... import``."""
    defined: set[str] = set()
    imported: dict[str, tuple[str, str]] = {}

    def walk(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                defined.update(n.id for t in targets for n in ast.walk(t)
                               if isinstance(n, ast.Name))
            elif isinstance(node, ast.Import):
                defined.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                for a in node.names:
                    imported[a.asname or a.name] = (node.module or "", a.name)
            for block in ("body", "orelse", "finalbody"):
                if isinstance(node, (ast.If, ast.Try, ast.With)) and hasattr(node, block):
                    walk(getattr(node, block))
            for handler in getattr(node, "handlers", []):
                walk(handler.body)

    walk(tree.body)
    return defined, imported


def imports_from_elsewhere(files: list[pathlib.Path], root: pathlib.Path = ROOT) -> list[str]:
    """``file:line: from M import name (defined in H)`` for every import in ``files`` of a
    project name from a module that is not its home: every name has one home, the module that
    defines it, and is imported from there (a submodule may be imported from its package)."""
    modules = {module_name(p, root): p for p in sorted((root / PACKAGE).rglob("*.py"))}
    cache: dict[str, tuple[set[str], dict[str, tuple[str, str]]]] = {}

    def names(module: str) -> tuple[set[str], dict[str, tuple[str, str]]]:
        if module not in cache:
            cache[module] = _top_level_names(ast.parse(modules[module].read_text()))
        return cache[module]

    def home(module: str, name: str, depth: int = 0) -> str | None:
        if f"{module}.{name}" in modules or module not in modules or depth > 20:
            return module if f"{module}.{name}" in modules else None
        defined, imported = names(module)
        if name in defined:
            return module
        if name in imported and imported[name][0].startswith(PACKAGE + "."):
            return home(*imported[name], depth + 1)
        return module if name in imported else None  # a third-party name: not ours to place

    found = []
    for path in files:
        source = module_name(path, root) if path.is_relative_to(root / PACKAGE) else ""
        tree = ast.parse(path.read_text(), filename=str(path))
        bound: dict[str, str] = {}  # local name -> the project module it names
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname and alias.name in modules:
                        bound[alias.asname] = alias.name
            if not isinstance(node, ast.ImportFrom):
                continue
            target = (_resolve(source, path.name == "__init__.py", node.level, node.module)
                      if node.level else node.module or "")
            if target != PACKAGE and not target.startswith(PACKAGE + "."):
                continue
            for alias in node.names:
                where = home(target, alias.name)
                if where != target:
                    place = f"defined in {where}" if where else "undefined"
                    found.append(f"{path.relative_to(root)}:{node.lineno}: from {target} "
                                 f"import {alias.name} ({place})")
                if f"{target}.{alias.name}" in modules:
                    bound[alias.asname or alias.name] = f"{target}.{alias.name}"
        # ``module.name`` through a module bound above: the name's home must be that module.
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and node.value.id in bound and isinstance(node.ctx, ast.Load) \
                    and not node.attr.startswith("__"):
                target = bound[node.value.id]
                where = home(target, node.attr)
                if where != target:
                    place = f"defined in {where}" if where else "undefined"
                    found.append(f"{path.relative_to(root)}:{node.lineno}: {target}."
                                 f"{node.attr} ({place})")
    return found


def re_exports(root: pathlib.Path = ROOT) -> list[str]:
    """``file:line: name (from M)`` for every project name a module of the package imports and
    never uses: kept only to be imported from there, a second home."""
    found = []
    for path in sorted((root / PACKAGE).rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        for node in ast.walk(tree):
            if not (isinstance(node, ast.ImportFrom) and node.module
                    and node.module.startswith(PACKAGE)):
                continue
            for alias in node.names:
                name = alias.asname or alias.name
                if name not in used:
                    found.append(f"{path.relative_to(root)}:{node.lineno}: {name} "
                                 f"(from {node.module})")
    return found


def project_files(root: pathlib.Path = ROOT) -> list[pathlib.Path]:
    """The Python files of the package and of what uses it here (tests, benchmarks, launchers,
    tools, recipes)."""
    return sorted(p for d in (PACKAGE, "tests", "benchmarks", "launch", "tools", "configs")
                  for p in (root / d).rglob("*.py") if ".venv" not in p.parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modules", action="store_true", help="print module-level edges too")
    args = parser.parse_args(argv)
    edges = collect()
    folded = package_edges(edges)

    def detail(a: str, b: str) -> str:
        behind = sorted(f"{s} -> {t} ({', '.join(sorted(k))})" for (s, t), k in edges.items()
                        if package_of(s) == a and package_of(t) == b)
        return "".join(f"\n      {line}" for line in behind)

    print("package edges (importer -> imported [kinds]):")
    for (a, b), kinds in sorted(folded.items()):
        print(f"  {a} -> {b} [{', '.join(sorted(kinds))}]" + (detail(a, b) if args.modules
                                                              else ""))
    packages = sorted({p for edge in folded for p in edge})
    unplaced = [p for p in packages if layer_of(p) is None]
    upward = upward_edges(folded)
    found = cycles(folded)
    print("upward edges:" + ("" if upward else " none"))
    for a, b in upward:
        print(f"  {a} -> {b}{detail(a, b)}")
    print("package cycles:" + ("" if found else " none"))
    for component in found:
        print("  " + " <-> ".join(component))
    if unplaced:
        print("packages missing from LAYERS: " + ", ".join(unplaced))
    inside = sublayer_edges(edges)
    print("sub-layer edges (up, or between subpackages of one layer):" + ("" if inside
                                                                          else " none"))
    for line in inside:
        print("  " + line)
    module_cycles = cycles(edges)
    print("module cycles:" + ("" if module_cycles else " none"))
    for component in module_cycles:
        print("  " + " <-> ".join(component))
    elsewhere = imports_from_elsewhere(project_files()) + re_exports()
    print("names imported from outside their home, or kept to be:" + ("" if elsewhere
                                                                       else " none"))
    for line in elsewhere:
        print("  " + line)
    return 1 if upward or found or unplaced or inside or module_cycles or elsewhere else 0


if __name__ == "__main__":
    sys.exit(main())
