"""No module reaches into another object's private fields, and no module imports another's private names.

Why: a leading underscore says "only my own class (or module) reads and
writes this".  Code elsewhere that touches `obj._x` ties itself to how that
object keeps its state, so the owner can no longer change it without
breaking a caller it cannot see.  When another module needs the value, the
owner gives it a public method, property or name.

Checked in every module under `src/stagedspec` and `scripts/`, read with `ast` alone:
- an attribute `x._name` (single leading underscore, not a dunder) whose
  object is anything but the bare name `self` or `cls`;
- `getattr` / `setattr` / `hasattr` / `delattr` with such a name as a
  literal string, on anything but `self` or `cls`;
- `from stagedspec... import _name` (and relative imports of `_name`).

`ALLOWED` lists the few private names of other libraries that have no
public spelling, each with its reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "stagedspec"
REPO = Path(__file__).resolve().parent.parent
ROOT = REPO / "src" / PACKAGE
SCRIPTS = REPO / "scripts"  # the measurement scripts use the library as its users do

# The attribute expression as `ast.unparse` writes it -> why it stays.
ALLOWED = {
    # ATen's own operator names start with an underscore; `torch.ops.aten.<name>`
    # is how PyTorch exposes them, and the packed int4/int8 matmuls have no other entry point.
    "torch.ops.aten._convert_weight_to_int4pack_for_cpu": "ATen's int4 weight packing op; no public alias",
    "torch.ops.aten._weight_int4pack_mm_for_cpu": "ATen's int4 packed matmul op; no public alias",
    "torch.ops.aten._weight_int8pack_mm": "ATen's int8 packed matmul op; no public alias",
    # torch.compile's recompile limit lives only in the dynamo config module.
    "torch._dynamo": "torch.compile's config (cache_size_limit) has no public home",
}

ATTR_FUNCTIONS = {"getattr", "setattr", "hasattr", "delattr"}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _is_own(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def _leaks(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr) and not _is_own(node.value):
            text = ast.unparse(node)
            if text not in ALLOWED:
                found.append((node.lineno, text))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ATTR_FUNCTIONS:
            if (len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
                    and isinstance(node.args[1].value, str) and _is_private(node.args[1].value)
                    and not _is_own(node.args[0])):
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.ImportFrom):
            ours = node.level > 0 or (node.module or "").split(".")[0] == PACKAGE
            if ours:
                for alias in node.names:
                    if _is_private(alias.name):
                        found.append((node.lineno, f"from {'.' * node.level}{node.module or ''} import {alias.name}"))
    return found


def test_no_private_field_or_name_used_outside_its_owner() -> None:
    hits = []
    for path in [*sorted(ROOT.rglob("*.py")), *sorted(SCRIPTS.rglob("*.py"))]:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for line, text in _leaks(tree):
            hits.append(f"{path.relative_to(REPO)}:{line}: {text}")
    assert not hits, "private names used outside their owner (add a public method/name instead):\n" + "\n".join(hits)


def test_allow_list_is_still_needed() -> None:
    """An allowed name that no module uses any more is dropped from the list, so the list stays short."""
    used = set()
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute):
                used.add(ast.unparse(node))
    assert set(ALLOWED) <= used, f"no longer used, drop from ALLOWED: {sorted(set(ALLOWED) - used)}"


def test_checker_sees_each_kind_of_leak() -> None:
    source = (
        "from stagedspec.models.quant import _hidden\n"
        "from .tree import _other\n"
        "def f(model):\n"
        "    model._cache = 1\n"
        "    return getattr(model, '_x'), model.inner._y\n"
        "class A:\n"
        "    def g(self):\n"
        "        return self._fine, self.__dict__, getattr(self, '_ok')\n"
    )
    texts = [text for _, text in _leaks(ast.parse(source))]
    assert sorted(texts) == sorted([
        "from stagedspec.models.quant import _hidden",
        "from .tree import _other",
        "model._cache",
        "getattr(model, '_x')",
        "model.inner._y",
    ]), texts
