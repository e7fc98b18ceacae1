"""The package's import graph has no cycle, counting the imports inside functions too.

Why in-function imports count: an import deferred into a function hides a
cycle from Python's import machinery but not from the design.  Two modules
that need each other have no order in which they can be read, tested or
replaced, and the data no longer flows one way (specs -> loaded models ->
drafters -> tree -> verify).  A cycle is broken by moving code to where it
belongs, not by deferring an import.

Imports under `if TYPE_CHECKING:` count as well.  They never run, but a
type hint that names a module above is still a dependency a reader must
follow: the contract of a drafter (`drafters.base`) that names `auto`'s
policy cannot be read, or replaced, without `auto`.  Where a lower module
needs to name something of a higher one, the thing moves down (the loop's
`Oracle` protocol lives in `stagedspec.oracle`, below both the loop and the
drafters) or the higher layer holds it (`auto`'s policy is a member of
`AutoDrafter`, not of every drafter).  The graph is read from the source
with `ast` alone; nothing of the package is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "stagedspec"
ROOT = Path(__file__).resolve().parent.parent / "src" / PACKAGE


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (a package is its `__init__.py`)."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


class _Imports(ast.NodeVisitor):
    """The package's modules one module imports, wherever the import statement sits (TYPE_CHECKING included)."""

    def __init__(self, name: str, is_package: bool, modules: dict[str, Path]) -> None:
        self.name, self.is_package, self.modules = name, is_package, modules
        self.found: set[str] = set()

    def _add(self, target: str) -> None:
        if target in self.modules and target != self.name:
            self.found.add(target)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:  # relative: counted from this module's package
            package = self.name.split(".") if self.is_package else self.name.split(".")[:-1]
            package = package[: len(package) - (node.level - 1)]
            base = ".".join(package + ([base] if base else []))
        for alias in node.names:
            submodule = f"{base}.{alias.name}"
            self._add(submodule if submodule in self.modules else base)


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (module level and inside functions)."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        visitor = _Imports(name, path.name == "__init__.py", modules)
        visitor.visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
        graph[name] = visitor.found
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None: a depth-first search that keeps its path (iterative, no recursion)."""
    done: set[str] = set()
    for start in sorted(graph):
        if start in done:
            continue
        path, on_path = [start], {start}
        stack = [iter(sorted(graph[start]))]
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                stack.pop()
                finished = path.pop()
                on_path.discard(finished)
                done.add(finished)
                continue
            if nxt in on_path:
                return path[path.index(nxt):] + [nxt]
            if nxt not in done:
                path.append(nxt)
                on_path.add(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def test_the_graph_is_read_from_the_sources() -> None:
    """A guard against a vacuous pass: the reader sees both kinds of import it is meant to count."""
    graph = import_graph()
    assert len(graph) > 50
    assert "stagedspec.models.transformer" in graph["stagedspec.models.loading"]  # a module-level import
    assert "stagedspec.models.specs" in graph["stagedspec.models.quant"]  # one inside a function
    assert "stagedspec.oracle" in graph["stagedspec.drafters.base"]  # one under TYPE_CHECKING


def test_find_cycle_names_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set(), "d": {"c"}}) is None


def test_the_package_has_no_import_cycle() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, (
        "import cycle: " + " -> ".join(cycle) + " (imports inside functions count too; move the shared code "
        "into a lower module or pass it in, rather than deferring an import)")


# The layers, lowest first: a module may import its own layer and those below, never one above.  A module is
# in the layer of the longest prefix naming it; one named by none is in the top layer, `app`.
LAYERS: dict[str, tuple[str, ...]] = {
    # the loop and what it is made of: trees, verification, the cache, sampling, the drafter and oracle
    # contracts, the registry of methods
    "core": ("tree", "tree_levels", "verification", "cache", "sampling", "generation", "oracle", "drafters.base",
             "errors", "paths", "heap", "methods"),
    # models and how their passes run: weights, kernels, runners, the machine, the tokenizer, pass costs as data
    "runtime": ("models", "kernels", "runner", "pass_options", "hardware", "threads", "costs", "dtypes",
                "tokenizer", "tokenizer_spm", "measured_cache", "realized_rates", "exactness", "stops"),
    # what proposes tokens: draft models, n-grams, lookup, stages, constraints on rows, and timing them
    "drafters": ("drafters", "stages", "budget", "constraints", "tree_acceptance", "profiling", "draft_weights"),
    # choosing among drafters by measured costs, and what it keeps
    "auto": ("auto", "learned_state", "speculation"),
}
ORDER = ("core", "runtime", "drafters", "auto", "app")


def layer_of(module: str) -> str:
    name = module[len(PACKAGE) + 1:] if module.startswith(PACKAGE + ".") else ""
    best, length = "app", -1
    for layer, prefixes in LAYERS.items():
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > length:
                best, length = layer, len(prefix)
    return best


def test_every_named_layer_holds_modules_and_the_loop_is_core() -> None:
    graph = import_graph()
    held = {layer: [m for m in graph if layer_of(m) == layer] for layer in ORDER}
    assert all(held[layer] for layer in ORDER), {k: len(v) for k, v in held.items()}
    assert layer_of("stagedspec.generation") == "core" and layer_of("stagedspec.drafters.base") == "core"
    assert layer_of("stagedspec.drafters.model") == "drafters" and layer_of("stagedspec.pipeline") == "app"


def test_no_module_imports_a_layer_above_its_own() -> None:
    """core -> runtime -> drafters -> auto -> app (docs/architecture.md), type-only imports included."""
    graph = import_graph()
    up = [f"{a} ({layer_of(a)}) imports {b} ({layer_of(b)})" for a, targets in sorted(graph.items())
          for b in sorted(targets) if ORDER.index(layer_of(b)) > ORDER.index(layer_of(a))]
    assert up == [], "imports against the layers: " + "; ".join(up)
