"""The import graph of ``distlock``: no cycle, and every import points to its own layer or one below.

The graph is read from the source with ``ast``, without importing anything, and counts the imports
made inside functions as well as those at module level: a function-level import that closes a
circle is still a circle, one that only breaks later, at run time.
"""

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

import distlock

PACKAGE = Path(distlock.__file__).parent
ROOT = PACKAGE.name

#: The layers, bottom first. A module may import from its own layer and the layers below it, never
#: from one above. A name stands for that module and every module under it (the longest name that
#: matches wins), except the package itself, ``distlock``, which stands for its ``__init__`` only.
LAYERS = [
    # Leaf helpers. The green-thread, offload and deadline helpers of backends/ are here because
    # renewal and the metrics thread use them too.
    ("utilities", ["distlock.conf", "distlock.holder", "distlock.redaction", "distlock.signals",
                   "distlock.validation", "distlock.waiting", "distlock.backends.green", "distlock.backends.offload",
                   "distlock.backends.deadlines", "distlock.backends.redis_servers"]),
    ("exceptions", ["distlock.exceptions"]),
    # The app's own tables: Lock, LockWaiter, TokenSequence, FencingRejection, MetricSample.
    ("tables", ["distlock.models", "distlock.migrations"]),
    # Recorded by every lease, stored in MetricSample.
    ("metrics", ["distlock.metrics"]),
    ("lease", ["distlock.lease", "distlock.renewal"]),
    # Each backend builds the leases it grants.
    ("backends", ["distlock.backends"]),
    ("locks", ["distlock.handler", "distlock.api", "distlock.held", "distlock.hierarchy", "distlock.reentrancy",
               "distlock.inventory", "distlock.audit"]),
    # FencedModel and its queryset, statements, offers and rejection log; querysets is a deprecated path.
    ("fencing", ["distlock.fencing", "distlock.querysets"]),
    ("public API", ["distlock", "distlock.celery"]),
    ("Django integration", ["distlock.apps", "distlock.checks", "distlock.admin", "distlock.views"]),
    ("conformance", ["distlock.conformance"]),
    ("commands", ["distlock.management"]),
]

#: Imports left out of the graph, with the reason: the lazy import of a deprecation shim's module
#: ``__getattr__``, which runs only when a caller uses the old path, and goes away with the shim.
SHIM_IMPORTS = {
    ("distlock.models", "distlock.fencing"): "`from distlock.models import FencedModel` (deprecated)",
    ("distlock.querysets", "distlock.fencing"): "`from distlock.querysets import FencedQuerySet` (deprecated)",
}

#: What Django imports before its app registry is ready (``INSTALLED_APPS`` entry and its AppConfig).
#: Defining a model then raises ``AppRegistryNotReady``, so what these import at module level must not.
IMPORTED_BEFORE_APPS_ARE_READY = ["distlock", "distlock.apps"]
#: Modules that define models (with everything under them).
DEFINES_MODELS = ["distlock.models", "distlock.fencing"]


@dataclass(frozen=True)
class Import:
    """One import statement's edge: ``importer`` imports ``imported``."""

    importer: str
    imported: str
    line: int
    #: The qualified name of the function the import is made in; None at module level (class bodies included).
    function: str | None

    def __str__(self):
        where = f"in {self.function}()" if self.function else "at module level"
        return f"{self.importer} -> {self.imported} (line {self.line}, {where})"


def module_files(package_dir):
    """Return ``{dotted module name: path}`` of every module under ``package_dir``."""
    package_dir = Path(package_dir)
    modules = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = path.relative_to(package_dir.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def imports(package_dir):
    """Return every ``Import`` between two modules of the package in ``package_dir``, shim imports included."""
    modules = module_files(package_dir)
    package = Path(package_dir).name
    found = []
    for importer, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node, function in _import_nodes(tree):
            for imported in _imported_modules(node, importer, path, package, modules):
                if imported != importer:
                    found.append(Import(importer, imported, node.lineno, function))
    return found


def _import_nodes(tree):
    """Yield ``(import node, qualified name of the enclosing function or None)`` for every import in ``tree``."""
    pending = [(node, (), False) for node in tree.body]
    while pending:
        node, scope, in_function = pending.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node, ".".join(scope) if in_function else None
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            in_function = in_function or not isinstance(node, ast.ClassDef)
            scope = (*scope, node.name)
        pending.extend((child, scope, in_function) for child in ast.iter_child_nodes(node))


def _imported_modules(node, importer, path, package, modules):
    """Return the package's modules that ``node`` imports (``from m import n``: ``m.n`` if a module, else ``m``)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            here = importer.split(".") if path.name == "__init__.py" else importer.split(".")[:-1]
            base = ".".join([*here[:len(here) - node.level + 1], *filter(None, [node.module])])
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
    return {_known_module(name, modules) for name in names if name.split(".")[0] == package}


def _known_module(name, modules):
    """Return ``name``, or its longest prefix that is a module (``import a.b.C`` names a class ``C``)."""
    while name not in modules and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def graph(package_dir):
    """Return the ``Import``s that make the graph: all but the ``SHIM_IMPORTS`` made in a module ``__getattr__``."""
    return [edge for edge in imports(package_dir) if not is_shim_import(edge)]


def is_shim_import(edge):
    """Return True if ``edge`` is one of ``SHIM_IMPORTS``, made where a shim makes it."""
    return (edge.importer, edge.imported) in SHIM_IMPORTS and edge.function == "__getattr__"


def cycles(edges):
    """Return each set of two or more modules that import one another, directly or not (Tarjan's algorithm)."""
    successors = {}
    for edge in edges:
        successors.setdefault(edge.importer, set()).add(edge.imported)
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(module):
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for successor in sorted(successors.get(module, ())):
            if successor not in index:
                visit(successor)
                low[module] = min(low[module], low[successor])
            elif successor in on_stack:
                low[module] = min(low[module], index[successor])
        if low[module] == index[module]:  # ``module`` and what is above it on the stack reach one another
            component = set()
            member = None
            while member != module:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
            if len(component) > 1:
                found.append(component)

    for module in sorted(successors):
        if module not in index:
            visit(module)
    return found


def layer_of(module):
    """Return the index in ``LAYERS`` of ``module``'s layer, or None if no layer names it."""
    best = None
    for position, (_name, members) in enumerate(LAYERS):
        for member in members:
            covers = module == member or (member != ROOT and module.startswith(member + "."))
            if covers and (best is None or len(member) > len(best[1])):
                best = (position, member)
    return None if best is None else best[0]


def upward_imports(edges):
    """Return the ``Import``s whose module sits in a higher layer than the module importing it."""
    return [edge for edge in edges
            if None not in (layer_of(edge.importer), layer_of(edge.imported))
            and layer_of(edge.imported) > layer_of(edge.importer)]


def module_level_closure(edges, start):
    """Return the modules that importing the ``start`` modules runs, following module-level imports only."""
    successors = {}
    for edge in edges:
        if edge.function is None:
            successors.setdefault(edge.importer, set()).add(edge.imported)
    seen, pending = set(start), list(start)
    while pending:
        for successor in successors.get(pending.pop(), ()):
            if successor not in seen:
                seen.add(successor)
                pending.append(successor)
    return seen


def describe_cycles(found, edges):
    lines = []
    for component in found:
        lines.append(f"{len(component)} modules: {', '.join(sorted(component))}")
        lines += [f"  {edge}" for edge in edges if edge.importer in component and edge.imported in component]
    return "\n".join(lines)


# -- the contracts -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def edges():
    """The graph of ``distlock/`` as it is on disk."""
    return graph(PACKAGE)


def test_no_import_cycle(edges):
    found = cycles(edges)
    assert not found, "Import cycles (move what they share down a layer):\n" + describe_cycles(found, edges)


def test_every_import_points_down_the_layers(edges):
    upward = upward_imports(edges)
    assert not upward, "Imports from a higher layer (see LAYERS):\n" + "\n".join(
        f"  {edge}: {LAYERS[layer_of(edge.importer)][0]} -> {LAYERS[layer_of(edge.imported)][0]}" for edge in upward)


def test_every_module_has_a_layer():
    modules = module_files(PACKAGE)
    unplaced = sorted(module for module in modules if layer_of(module) is None)
    assert not unplaced, f"Put these modules in a layer of LAYERS: {unplaced}"
    missing = [member for _name, members in LAYERS for member in members if member not in modules]
    assert not missing, f"LAYERS names modules that do not exist: {missing}"


def test_every_shim_import_is_still_made():
    """An exemption whose shim is gone goes with it, so that it cannot excuse a new import later."""
    exempted = {(edge.importer, edge.imported) for edge in imports(PACKAGE) if is_shim_import(edge)}
    assert exempted == set(SHIM_IMPORTS)


def test_no_model_is_defined_before_the_app_registry_is_ready(edges):
    """Why ``distlock.metrics.recorder`` imports its store inside ``flush()``: the store needs ``MetricSample``."""
    defined = {module for module in module_level_closure(edges, IMPORTED_BEFORE_APPS_ARE_READY)
               if any(module == name or module.startswith(name + ".") for name in DEFINES_MODELS)}
    assert not defined, f"{sorted(defined)} would be imported with the package, before Django has loaded the apps"


def test_the_graph_counts_imports_made_inside_functions(tmp_path):
    """The walker itself: a circle closed by a function-level, relative import is found."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg import b\n")
    (package / "b.py").write_text("def later():\n    from . import a\n")
    edges = graph(package)
    assert [str(edge) for edge in edges if edge.importer == "pkg.b"] == ["pkg.b -> pkg.a (line 2, in later())"]
    assert cycles(edges) == [{"pkg.a", "pkg.b"}]
