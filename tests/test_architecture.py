"""Architecture rules of the `ragkv` package, checked statically.

The source files are read with `ast` (no package module is imported, no model is loaded), so the
whole file runs in well under a second. Rules:

1. Layering. Every module belongs to exactly one layer, bottom to top:

       base        ragkv.config, ragkv.host_ints, ragkv.outputs
       cache       ragkv.cache
       structured  ragkv.structured
       sampling    ragkv.sampling
       inputs      ragkv.inputs
       model       ragkv.model
       engine      ragkv.engine, ragkv.recompute
       api         ragkv.llm, ragkv.server, ragkv.eval, ragkv.bench, ragkv.entrypoints, ragkv

   (a module belongs to the layer whose prefix matches it longest, on whole dotted components;
   the package root `ragkv` is matched only by itself). A module may import only from its own
   layer or a lower one. Dependencies then run one way: the configuration sits at the bottom and
   is passed down, never reaching up for what uses it; the cache, grammars and sampling know
   nothing of the model; the model side never imports the engine side; and nothing below the
   API layer knows that a server, a CLI or a benchmark exists. Every import counts here,
   including lazy ones inside functions and those under `if TYPE_CHECKING:` (a type-only
   dependency is still a dependency of the design). A module that matches no layer fails the
   test, so a new top-level module is placed deliberately.
2. No import cycles between package modules, counting runtime imports (module level and lazy
   imports in functions) but not those under `if TYPE_CHECKING:`. A cycle makes import order
   matter and the modules impossible to understand or test one at a time; a lazy import that
   only hides a cycle is still a cycle.
3. Size. No module over MAX_MODULE_LINES lines, except the Triton kernel files listed by path in
   KERNEL_FILES (a listed file must exist, so the list stays true); the engine module
   (ENGINE_FILE) stays a thin loop of at most MAX_ENGINE_LINES lines, with the work in the
   scheduler, the cache and the model runner.
4. The project carries its own documentation: no source file, doc page or the README refers to
   an external design document ("DESIGN §1", "DESIGN.md") or points at `../shared`.

Every import of a `ragkv` module must also resolve to a module that exists (a stale import
left by a move would otherwise silently drop out of rules 1 and 2). The helpers are tested on
synthetic inputs below, and the scan must find a plausible number of modules and import edges,
so the rules cannot pass by finding nothing.
"""

from __future__ import annotations

import ast
import functools
import re
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "ragkv"
PACKAGE_DIR = ROOT / PACKAGE

# Layers bottom to top, each with the module prefixes that belong to it.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("base", ("ragkv.config", "ragkv.host_ints", "ragkv.outputs")),
    ("cache", ("ragkv.cache",)),
    ("structured", ("ragkv.structured",)),
    ("sampling", ("ragkv.sampling",)),
    ("inputs", ("ragkv.inputs",)),
    ("model", ("ragkv.model",)),
    ("engine", ("ragkv.engine", "ragkv.recompute")),
    ("api", ("ragkv.llm", "ragkv.server", "ragkv.eval", "ragkv.bench", "ragkv.entrypoints")),
)
# Modules matched by their exact name only (not as a prefix of others).
EXACT_LAYERS: dict[str, str] = {"ragkv": "api", "ragkv.__main__": "api"}
LAYER_RANK = {name: rank for rank, (name, _) in enumerate(LAYERS)}

MAX_MODULE_LINES = 600
KERNEL_FILES = {"ragkv/model/backends/triton_kernels.py"}
ENGINE_FILE = "ragkv/engine/engine.py"
MAX_ENGINE_LINES = 350

DOC_REFERENCE = re.compile(r"\bDESIGN(?:\.md|\s?§)|\.\./shared")


# ---------------------------------------------------------------------------------------------
# Helpers


@dataclass(frozen=True)
class Import:
    importer: str  # dotted module name
    target: str  # dotted module name of the package module imported
    path: str  # importer's file, relative to the repository root
    line: int
    type_checking: bool  # inside an `if TYPE_CHECKING:` block

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def module_name(relpath: str) -> str:
    """`ragkv/a/b.py` -> `ragkv.a.b`; `ragkv/a/__init__.py` -> `ragkv.a`."""
    parts = list(Path(relpath).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(
    module: str,
    layers: Iterable[tuple[str, Iterable[str]]] = LAYERS,
    exact: Mapping[str, str] = EXACT_LAYERS,
) -> str | None:
    """The layer whose prefix matches `module` longest (whole dotted components), else None."""
    if module in exact:
        return exact[module]
    best: tuple[int, str] | None = None
    for layer, prefixes in layers:
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                length = prefix.count(".") + 1
                if best is None or length > best[0]:
                    best = (length, layer)
    return None if best is None else best[1]


def _is_type_checking(test: ast.expr) -> bool:
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def _resolve_base(module: str, is_package: bool, node: ast.ImportFrom) -> str | None:
    """The absolute dotted name `from <node.module> import ...` refers to, in `module`."""
    if node.level == 0:
        return node.module
    package = module if is_package else module.rpartition(".")[0]
    parts = package.split(".") if package else []
    if node.level - 1 > len(parts) - 1:
        return None  # beyond the top-level package
    parts = parts[: len(parts) - (node.level - 1)]
    if node.module:
        parts.append(node.module)
    return ".".join(parts)


def _in_package(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def imports_in(
    source: str,
    module: str,
    is_package: bool,
    is_module: Callable[[str], bool],
    package: str = PACKAGE,
) -> list[tuple[str, int, bool]]:
    """(target module, line, under TYPE_CHECKING) for every import of a `package` module in
    `source` (the code of `module`), anywhere in the file. `from PKG import NAME` imports the
    submodule PKG.NAME when `is_module(PKG.NAME)`, else PKG itself."""
    found: list[tuple[str, int, bool]] = []

    def record(node: ast.stmt, type_checking: bool) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _in_package(alias.name, package):
                    found.append((alias.name, node.lineno, type_checking))
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_base(module, is_package, node)
            if base is None or not _in_package(base, package):
                return
            targets = []
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                targets.append(sub if alias.name != "*" and is_module(sub) else base)
            for target in dict.fromkeys(targets):
                found.append((target, node.lineno, type_checking))

    def walk(node: ast.AST, type_checking: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    visit(stmt, True)
                for stmt in child.orelse:
                    visit(stmt, type_checking)
            else:
                visit(child, type_checking)

    def visit(node: ast.AST, type_checking: bool) -> None:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            record(node, type_checking)
        walk(node, type_checking)

    walk(ast.parse(source), False)
    return found


def strongly_connected_components(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Tarjan's algorithm; every node of `graph` and of its edges appears in one component."""
    nodes = sorted(set(graph) | {t for targets in graph.values() for t in targets})
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            components.append(sorted(component))

    for node in nodes:
        if node not in index:
            connect(node)
    return components


def find_cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """One shortest cycle per tangle (strongly connected component of more than one module, or a
    module importing itself), as [m0, m1, ..., mk] with the edge mk -> m0 closing it; m0 is the
    tangle's first module by name."""
    cycles = []
    for component in strongly_connected_components(graph):
        start = component[0]
        if len(component) == 1:
            if start in graph.get(start, ()):
                cycles.append([start])
            continue
        members = set(component)
        parent: dict[str, str] = {}
        queue = deque([start])
        while queue:
            node = queue.popleft()
            for target in sorted(graph.get(node, ())):
                if target == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    cycles.append(path[::-1])
                    queue.clear()
                    break
                if target in members and target not in parent:
                    parent[target] = node
                    queue.append(target)
    return sorted(cycles)


@dataclass(frozen=True)
class Scan:
    modules: dict[str, str]  # dotted name -> path relative to the repository root
    known: frozenset[str]  # modules plus package directories (namespace packages too)
    imports: tuple[Import, ...]


@functools.lru_cache(maxsize=1)
def scan_package() -> Scan:
    files = sorted(p for p in PACKAGE_DIR.rglob("*.py") if "__pycache__" not in p.parts)
    modules = {module_name(p.relative_to(ROOT).as_posix()): p.relative_to(ROOT).as_posix()
               for p in files}
    known = set(modules)
    for name in modules:
        parts = name.split(".")
        known.update(".".join(parts[:i]) for i in range(1, len(parts)))
    imports = []
    for name, relpath in modules.items():
        source = (ROOT / relpath).read_text(encoding="utf-8")
        is_package = relpath.endswith("/__init__.py")
        for target, line, type_checking in imports_in(source, name, is_package, known.__contains__):
            imports.append(Import(name, target, relpath, line, type_checking))
    return Scan(modules, frozenset(known), tuple(imports))


def runtime_graph(imports: Iterable[Import]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for imp in imports:
        if not imp.type_checking and imp.target != imp.importer:
            graph.setdefault(imp.importer, set()).add(imp.target)
    return graph


def _fail(title: str, offenders: list[str]) -> str:
    return f"{title} ({len(offenders)}):\n  " + "\n  ".join(offenders)


# ---------------------------------------------------------------------------------------------
# The rules


def test_every_module_has_a_layer() -> None:
    scan = scan_package()
    unassigned = [f"{path}: {name} matches no layer prefix (assign it a layer in LAYERS)"
                  for name, path in sorted(scan.modules.items()) if layer_of(name) is None]
    assert not unassigned, _fail("modules without a layer", unassigned)


def test_imports_go_down_the_layers() -> None:
    scan = scan_package()
    upward = []
    for imp in scan.imports:
        source, target = layer_of(imp.importer), layer_of(imp.target)
        if source is None or target is None:
            continue  # reported by test_every_module_has_a_layer / the resolution test
        if LAYER_RANK[target] > LAYER_RANK[source]:
            kind = " (under TYPE_CHECKING)" if imp.type_checking else ""
            upward.append(f"{imp.where}: {imp.importer} ({source}) imports "
                          f"{imp.target} ({target}){kind}")
    assert not upward, _fail("imports from a higher layer", upward)


def test_package_imports_resolve() -> None:
    scan = scan_package()
    missing = [f"{imp.where}: {imp.importer} imports {imp.target}, which does not exist"
               for imp in scan.imports if imp.target not in scan.known]
    assert not missing, _fail("imports of missing ragkv modules", missing)


def test_no_import_cycles() -> None:
    scan = scan_package()
    runtime = [imp for imp in scan.imports if not imp.type_checking]
    graph = runtime_graph(runtime)
    cycles = {cycle[0]: cycle for cycle in find_cycles(graph)}
    problems = []
    for component in strongly_connected_components(graph):
        if len(component) == 1:
            continue
        members = set(component)
        cycle = cycles[component[0]]
        edges = sorted({f"{imp.where}: {imp.importer} -> {imp.target}" for imp in runtime
                        if imp.importer in members and imp.target in members
                        and imp.importer != imp.target})
        text = f"cycle {cycle + [cycle[0]]}"
        if len(component) > len(cycle):
            text += f"\n    within the tangle {component}"
        text += "\n    imports inside it:\n      " + "\n      ".join(edges)
        problems.append(text)
    assert not problems, _fail("import cycles", problems)


def _line_count(relpath: str) -> int:
    return len((ROOT / relpath).read_text(encoding="utf-8").splitlines())


def test_modules_stay_small() -> None:
    scan = scan_package()
    offenders = [f"{path}: listed in KERNEL_FILES but does not exist"
                 for path in sorted(KERNEL_FILES) if not (ROOT / path).is_file()]
    for path in sorted(scan.modules.values()):
        lines = _line_count(path)
        if path not in KERNEL_FILES and lines > MAX_MODULE_LINES:
            offenders.append(f"{path}: {lines} lines > {MAX_MODULE_LINES}")
    assert not offenders, _fail("oversized modules", offenders)


def test_engine_stays_thin() -> None:
    assert (ROOT / ENGINE_FILE).is_file(), f"{ENGINE_FILE} does not exist"
    lines = _line_count(ENGINE_FILE)
    assert lines <= MAX_ENGINE_LINES, f"{ENGINE_FILE}: {lines} lines > {MAX_ENGINE_LINES}"


def _doc_files() -> list[Path]:
    files = [p for p in PACKAGE_DIR.rglob("*.py") if "__pycache__" not in p.parts]
    files += (ROOT / "docs").rglob("*.md")
    # The tests and benchmarks are the project's too (this file names the pattern it seeks).
    files += [p for p in (ROOT / "tests").glob("*.py") if p.name != Path(__file__).name]
    files += (ROOT / "benchmarks").glob("*.py")
    if (ROOT / "README.md").is_file():
        files.append(ROOT / "README.md")
    return sorted(files)


def test_no_external_design_references() -> None:
    offenders = []
    for path in _doc_files():
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if DOC_REFERENCE.search(line):
                offenders.append(f"{path.relative_to(ROOT).as_posix()}:{number}: {line.strip()}")
    assert not offenders, _fail("references to an external design document", offenders)


# ---------------------------------------------------------------------------------------------
# The checks themselves


def test_scan_finds_the_package() -> None:
    scan = scan_package()
    edges = {(imp.importer, imp.target) for imp in scan.imports}
    assert len(scan.modules) > 40, f"only {len(scan.modules)} modules found under {PACKAGE_DIR}"
    assert len(edges) > 100, f"only {len(edges)} import edges found"
    assert "ragkv" in scan.modules and scan.modules["ragkv"] == "ragkv/__init__.py"
    assert any(imp.target == "ragkv.cache.kv_pool" for imp in scan.imports)


def test_module_name() -> None:
    assert module_name("ragkv/__init__.py") == "ragkv"
    assert module_name("ragkv/cache/__init__.py") == "ragkv.cache"
    assert module_name("ragkv/cache/kv_pool.py") == "ragkv.cache.kv_pool"


def test_layer_of_longest_whole_component_prefix() -> None:
    assert layer_of("ragkv.cache.kv_pool") == "cache"
    assert layer_of("ragkv.cache") == "cache"
    assert layer_of("ragkv.cachex") is None
    assert layer_of("ragkv.config") == "base"
    assert layer_of("ragkv.recompute") == "engine"
    assert layer_of("ragkv.engine.recompute") == "engine"
    assert layer_of("ragkv") == "api"
    assert layer_of("ragkv.nowhere") is None  # the root is matched exactly, not as a prefix
    synthetic = (("low", ("p", "p.a.b")), ("high", ("p.a",)))
    assert layer_of("p.a.b.c", synthetic, {}) == "low"
    assert layer_of("p.a.bc", synthetic, {}) == "high"
    assert layer_of("p.x", synthetic, {}) == "low"
    assert layer_of("q", synthetic, {}) is None


def _targets(source: str, module: str, is_package: bool = False,
             known: Iterable[str] = ()) -> list[tuple[str, int, bool]]:
    return imports_in(source, module, is_package, set(known).__contains__)


def test_imports_resolve_relative_and_absolute() -> None:
    known = {"ragkv.cache", "ragkv.cache.kv_pool", "ragkv.model", "ragkv.model.triton_ops",
             "ragkv.model.x", "ragkv.config"}
    source = "\n".join([
        "import torch",
        "import ragkv.cache.kv_pool as kp",
        "from ..cache import kv_pool",
        "from . import triton_ops",
        "from .x import Y",
        "from . import not_a_module",
        "from .. import config, LLM",
        "from ragkv import SamplingParams",
        "from ragkv.cache.kv_pool import KVPool",
        "from triton import language",
        "import ragkvx",
    ])
    assert _targets(source, "ragkv.model.llama", known=known) == [
        ("ragkv.cache.kv_pool", 2, False),
        ("ragkv.cache.kv_pool", 3, False),
        ("ragkv.model.triton_ops", 4, False),
        ("ragkv.model.x", 5, False),
        ("ragkv.model", 6, False),
        ("ragkv.config", 7, False),
        ("ragkv", 7, False),
        ("ragkv", 8, False),
        ("ragkv.cache.kv_pool", 9, False),
    ]
    # In a package's __init__, `.` is the package itself.
    assert _targets("from .x import Y\nfrom .. import config", "ragkv.model", True, known) == [
        ("ragkv.model.x", 1, False), ("ragkv.config", 2, False)]
    # Beyond the top-level package: not a ragkv import.
    assert _targets("from ... import x", "ragkv.model.llama", known=known) == []


def test_imports_mark_type_checking_and_count_lazy_imports() -> None:
    source = "\n".join([
        "import typing",
        "from typing import TYPE_CHECKING",
        "if TYPE_CHECKING:",
        "    from .a import A",
        "else:",
        "    from .b import B",
        "if typing.TYPE_CHECKING:",
        "    import ragkv.c",
        "def f():",
        "    from .d import D",
        "    if TYPE_CHECKING:",
        "        from .e import E",
        "class K:",
        "    def g(self):",
        "        import ragkv.f",
    ])
    assert _targets(source, "ragkv.m") == [
        ("ragkv.a", 4, True), ("ragkv.b", 6, False), ("ragkv.c", 8, True),
        ("ragkv.d", 10, False), ("ragkv.e", 12, True), ("ragkv.f", 15, False)]


def test_find_cycles() -> None:
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert find_cycles({"c": {"a"}, "a": {"b"}, "b": {"c"}, "d": {"a"}}) == [["a", "b", "c"]]
    # The shortest cycle through the tangle's first module, one entry per tangle.
    graph = {"a": {"b", "x"}, "x": {"y"}, "y": {"a"}, "b": {"a"}, "p": {"q"}, "q": {"p"}}
    assert find_cycles(graph) == [["a", "b"], ["p", "q"]]
    assert find_cycles({"s": {"s"}}) == [["s"]]
    assert sorted(map(sorted, strongly_connected_components(graph))) == [
        ["a", "b", "x", "y"], ["p", "q"]]


def test_runtime_graph_skips_type_checking_and_self_imports() -> None:
    imports = [Import("a", "b", "a.py", 1, False), Import("b", "a", "b.py", 1, True),
               Import("a", "a", "a.py", 2, False)]
    assert runtime_graph(imports) == {"a": {"b"}}
    assert find_cycles(runtime_graph(imports)) == []


def test_doc_reference_pattern() -> None:
    for text in ("see DESIGN §1", "(DESIGN §1-§3)", "DESIGN.md §2", "DESIGN§4",
                 "../shared/notes.md"):
        assert DOC_REFERENCE.search(text), text
    for text in ("DESIGNER", "design §1", "shared memory", "a ./shared dir"):
        assert not DOC_REFERENCE.search(text), text
