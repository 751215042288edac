"""The import graph of ``src/selfspec``: no circle between modules, and no import from a lower floor to a
higher one (issue 71). Every ``import`` of the package is counted, at module level and inside a function
(a function-local import is a corridor all the same: ``store/artefacts.py`` climbed to the training
entry point inside one to word a refusal, and closed a circle of eight modules), and under
``if TYPE_CHECKING:``. The graph is read from the source with :mod:`ast`; nothing is imported.

A module's floor is its folder under ``src/selfspec/`` (``selfspec.decoding.tree``: ``decoding``), or
its own name for a module beside the folders (``selfspec.train``: ``train``; the package's own
``__init__``: ``selfspec``). A module may import its own floor and the floors below it.

A private name (one with a leading underscore) is used only within its own folder: no module takes
``from selfspec.models.loading import _name``, nor ``loading._name`` off an imported module, from
another folder (issue 71: ``measure/peak.py`` read GGUF files through two of ``models/loading.py``'s
private functions). What one folder needs of another is given a public name.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "selfspec"

#: the floors, lowest first: what a floor may import is on it or below it. This is the one place they
#: are written down (docs/design/contracts.md §1 points here).
FLOORS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # the package itself (its __init__ sets MKL's reproducibility mode) and that mode
    ("ground", ("selfspec", "numerics")),
    # names in a config -> checked values; the one registry style; conf/ itself
    ("config", ("config",)),
    # files, artefacts, assets, locks, a run's record: what lies on disk
    ("store", ("store",)),
    # loading, the layered runtime, its kernels, passes, heads, prompts, the ledger
    ("models", ("models",)),
    # cost profiles, the cost model, peak memory, the speedup
    ("measure", ("measure",)),
    # the methods (one Decoder interface), trees, gates, sampling
    ("decoding", ("decoding",)),
    # the tasks' metrics, then the tasks (data, prompts, scoring)
    ("metrics", ("metrics",)),
    ("tasks", ("tasks",)),
    # where results go: the local file and W&B
    ("tracking", ("tracking",)),
    # the runner: plan, interleaving, timing, aggregation, profiling
    ("evaluation", ("evaluation",)),
    # the job driver and the jobs (they price candidates with evaluation's profiling)
    ("training", ("training",)),
    # tables and plots of recorded runs
    ("reporting", ("reporting",)),
    # the command lines: python -m selfspec.<name>
    ("entry points", ("evaluate", "train", "report", "project")),
    # the memory table: it gathers every job's memory model from the job registry (selfspec.train.JOBS)
    ("memory", ("memory",)),
)

#: (importing module, imported module) -> why the arrow may climb. None today: an entry here needs a
#: reason a reader accepts, not a convenience.
EXCEPTIONS: dict[tuple[str, str], str] = {}


class Import(NamedTuple):
    source: str   # the importing module
    target: str   # the module imported (the deepest module the name resolves to)
    path: Path
    line: int


def _modules() -> dict[str, Path]:
    """Every module of the package, by dotted name (a package by its ``__init__``)."""
    out = {}
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The module ``name`` is or lies in (``selfspec.models.kernels.paths`` -> ``selfspec.models.kernels``)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports(modules: dict[str, Path] | None = None) -> list[Import]:
    """Every import of a module of the package by a module of the package, wherever it stands."""
    modules = modules or _modules()
    found = []
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, level - 1 folders up
                    parts = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    base = ".".join(parts + ([base] if base else []))
                # ``from a import b``: b may be a module of a, else a name in a
                names = [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for name in names:
                if name.split(".")[0] != PACKAGE:
                    continue
                target = _resolve(name, modules)
                if target and target != module:
                    found.append(Import(module, target, path, node.lineno))
    return found


def _folder(module: str) -> str:
    """A module's folder under ``src/selfspec/`` (or its own name beside the folders)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def private_uses(modules: dict[str, Path] | None = None) -> list[str]:
    """Each private name of a module of the package used from another folder, as ``file:line: source
    uses target._name``: imported by name (``from selfspec.models.loading import _name``, relative or
    absolute, wherever the import stands) or read off an imported module (``loading._name``,
    ``selfspec.models.loading._name``). Dunder names are not private."""
    modules = modules or _modules()
    out = []

    def private(name: str) -> bool:
        return name.startswith("_") and not name.endswith("__")

    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        tree = ast.parse(path.read_text(), str(path))
        local: dict[str, str] = {}  # a name bound to a module of the package -> that module
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == PACKAGE and alias.asname and alias.name in modules:
                        local[alias.asname] = alias.name
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    base = ".".join(parts + ([base] if base else []))
                if base.split(".")[0] != PACKAGE:
                    continue
                for alias in node.names:
                    name = f"{base}.{alias.name}"
                    if name in modules:
                        local[alias.asname or alias.name] = name
                    elif private(alias.name) and _folder(_resolve(base, modules) or base) != _folder(module):
                        out.append(f"{_where(Import(module, base, path, node.lineno))}: {module} imports "
                                   f"{base}.{alias.name}")
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and private(node.attr)):
                continue
            owner = local.get(node.value.id) if isinstance(node.value, ast.Name) else None
            if owner is None and ast.unparse(node.value) in modules:
                owner = ast.unparse(node.value)
            if owner is not None and _folder(owner) != _folder(module):
                out.append(f"{_where(Import(module, owner, path, node.lineno))}: {module} uses {owner}.{node.attr}")
    return out


def with_packages(found: list[Import]) -> list[Import]:
    """``found`` and, for each import, the packages above its module that Python runs first
    (``import selfspec.decoding.tree`` runs ``selfspec/decoding/__init__.py``), but the importer's own."""
    modules = _modules()
    out = list(found)
    for imp in found:
        parts = imp.target.split(".")
        for i in range(2, len(parts)):
            package = ".".join(parts[:i])
            if package in modules and not (imp.source + ".").startswith(package + "."):
                out.append(imp._replace(target=package))
    return out


def floor_of(module: str) -> str:
    """The floor name of a module (module docstring)."""
    parts = module.split(".")
    part = parts[1] if len(parts) > 1 else parts[0]
    for name, members in FLOORS:
        if part in members:
            return name
    raise KeyError(f"{module}: its folder or name {part!r} is on no floor: add it to tests/test_imports.py FLOORS")


def _where(imp: Import) -> str:
    path = imp.path.relative_to(SRC.parent) if imp.path.is_relative_to(SRC.parent) else imp.path
    return f"{path}:{imp.line}"


def upward(found: list[Import]) -> list[str]:
    """Each import that climbs a floor, as ``file:line: source (floor a) imports target (floor b), above it``."""
    rank = {name: i for i, (name, _) in enumerate(FLOORS)}
    out = []
    for imp in found:
        low, high = floor_of(imp.source), floor_of(imp.target)
        if rank[high] > rank[low] and (imp.source, imp.target) not in EXCEPTIONS:
            out.append(f"{_where(imp)}: {imp.source} (floor {low}) imports {imp.target} (floor {high}, above it)")
    return out


def circles(found: list[Import]) -> list[str]:
    """Each circle of modules (a strongly connected component of the graph, Tarjan), with the imports
    that run between its modules."""
    graph: dict[str, set[str]] = defaultdict(set)
    for imp in found:
        graph[imp.source].add(imp.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:  # recursion depth: the longest import chain, well under the limit
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
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
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    out = []
    for component in components:
        inside = sorted({f"{_where(imp)}: {imp.source} -> {imp.target}" for imp in found
                         if imp.source in component and imp.target in component})
        out.append(f"a circle of {len(component)} modules ({', '.join(component)}):\n    " + "\n    ".join(inside))
    return out


def test_every_module_is_on_a_floor():
    """A new folder (or a module beside the folders) is placed on a floor before it is imported."""
    unplaced = []
    for module in _modules():
        try:
            floor_of(module)
        except KeyError as err:
            unplaced.append(str(err))
    assert not unplaced, "\n".join(unplaced)
    members = [m for _, floor in FLOORS for m in floor]
    assert len(members) == len(set(members)), "a folder on two floors"


def test_the_imports_are_read(tmp_path):
    """The reader sees every kind of import (a guard against a reader that finds nothing and so passes
    everything): at module level, inside a function, under ``if TYPE_CHECKING:``, ``from a import
    module``, ``from a import name``, relative, and none of another package's."""
    (tmp_path / "pkg").mkdir()
    files = {
        "selfspec.pkg": "from . import low\n",
        "selfspec.pkg.low": "import os\nimport selfspec.pkg.mid\n",
        "selfspec.pkg.mid": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from selfspec.pkg import top\n",
        "selfspec.pkg.top": "def f():\n    from selfspec.pkg.low import name\n    from .mid import other\n",
    }
    modules = {}
    for name, text in files.items():
        path = tmp_path / "pkg" / ("__init__.py" if name == "selfspec.pkg" else f"{name.rsplit('.', 1)[1]}.py")
        path.write_text(text)
        modules[name] = path
    found = {(imp.source, imp.target, imp.line) for imp in imports(modules)}
    assert found == {("selfspec.pkg", "selfspec.pkg.low", 1), ("selfspec.pkg.low", "selfspec.pkg.mid", 2),
                     ("selfspec.pkg.mid", "selfspec.pkg.top", 3), ("selfspec.pkg.top", "selfspec.pkg.low", 2),
                     ("selfspec.pkg.top", "selfspec.pkg.mid", 3)}
    assert [c.split(":")[0] for c in circles(imports(modules))] == \
        ["a circle of 3 modules (selfspec.pkg.low, selfspec.pkg.mid, selfspec.pkg.top)"]
    climb = Import("selfspec.store.runinfo", "selfspec.models.kernels", SRC / "selfspec" / "store" / "runinfo.py", 33)
    assert upward([climb]) == ["src/selfspec/store/runinfo.py:33: selfspec.store.runinfo (floor store) imports "
                               "selfspec.models.kernels (floor models, above it)"]
    assert upward([climb._replace(source="selfspec.decoding.tree")]) == []
    assert len(imports()) > 300


def test_no_import_climbs_a_floor():
    """No module imports a floor above its own (:data:`FLOORS`; the exceptions, each with its reason,
    in :data:`EXCEPTIONS`)."""
    found = upward(imports())
    assert not found, "imports that climb a floor:\n" + "\n".join(found)


def test_no_circle_of_imports():
    """No module imports, directly or through others, a module that imports it (counting the
    packages an import runs first: :func:`with_packages`)."""
    found = circles(with_packages(imports()))
    assert not found, "\n".join(found)


def test_private_uses_are_read(tmp_path):
    """The private-name reader sees each way across a folder (a guard against one that finds nothing):
    ``from a import _x`` (absolute, relative, in a function), ``module._x`` off ``from a import module``,
    ``import a.module as m`` and the dotted name; not a private name within its own folder, nor a dunder."""
    for folder in ("low", "high"):
        (tmp_path / folder).mkdir()
    files = {
        "selfspec.low.base": "_hidden = 1\n",
        "selfspec.low.peer": "from selfspec.low.base import _hidden\n",
        "selfspec.high.user": ("from selfspec.low.base import _hidden\n"
                               "from ..low import base\n"
                               "import selfspec.low.base as b\n"
                               "import selfspec.low.base\n"
                               "def f():\n"
                               "    from ..low.base import _hidden as h\n"
                               "    return base._hidden, b._hidden, selfspec.low.base._hidden, base.__doc__\n"),
    }
    modules = {}
    for name, text in files.items():
        _, folder, leaf = name.split(".")
        path = tmp_path / folder / f"{leaf}.py"
        path.write_text(text)
        modules[name] = path
    found = [line.split(": ", 1)[1] for line in private_uses(modules)]
    assert sorted(found) == sorted(["selfspec.high.user imports selfspec.low.base._hidden"] * 2
                                   + ["selfspec.high.user uses selfspec.low.base._hidden"] * 3)


def test_no_private_name_is_used_across_folders():
    """What a folder takes from another it takes by a public name (module docstring)."""
    found = private_uses()
    assert not found, "private names used from another folder:\n" + "\n".join(found)


def test_every_exception_is_still_needed():
    """An exception whose import is gone is taken out of :data:`EXCEPTIONS`."""
    found = {(imp.source, imp.target) for imp in imports()}
    assert not [pair for pair in EXCEPTIONS if pair not in found]
