"""Every public function of the product says its types: each parameter but ``self`` and ``cls`` annotated, and its
return. Public: a module-level function, or a method of a public class, whose name has no leading underscore, in
the product's folders (generated protobuf code aside). Functions nested in others are their
enclosing function's business."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from testkit.paths import PRODUCT_FOLDERS, REPO


def product_modules() -> Iterator[Path]:
    for folder in PRODUCT_FOLDERS:
        for path in sorted((REPO / folder).rglob("*.py")):
            if "_pb2" not in path.name:
                yield path


def public_functions(tree: ast.Module) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    """The module's public functions and its public classes' public methods (classes nested in classes too)."""
    bodies = [tree.body]
    while bodies:
        for node in bodies.pop():
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and not node.name.startswith("_"):
                yield node
            elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                bodies.append(node.body)


def missing_hints(function: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    arguments = function.args
    named = [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]
    named += [a for a in (arguments.vararg, arguments.kwarg) if a is not None]
    missing = [a.arg for a in named if a.annotation is None and a.arg not in ("self", "cls")]
    return missing + (["return"] if function.returns is None else [])


def test_the_finder_sees_methods_and_leaves_nested_and_private_functions_out() -> None:
    tree = ast.parse(
        "def shown(a, b: int): ...\n"
        "def _private(a): ...\n"
        "def outer() -> None:\n"
        "    def nested(a): ...\n"
        "class Public:\n"
        "    def method(self, x: int) -> int: ...\n"
        "    def bare(self, *args, **kwargs): ...\n"
        "    class Inner:\n"
        "        async def inner(cls) -> None: ...\n"
        "class _Hidden:\n"
        "    def method(self, x): ...\n"
    )
    found = {f.name: missing_hints(f) for f in public_functions(tree)}
    assert found == {
        "shown": ["a", "return"],
        "outer": [],
        "method": [],
        "bare": ["args", "kwargs", "return"],
        "inner": [],
    }


def test_every_public_function_of_the_product_is_annotated() -> None:
    missing = []
    for path in product_modules():
        for function in public_functions(ast.parse(path.read_text(), str(path))):
            if hints := missing_hints(function):
                missing.append(f"{path.relative_to(REPO)}:{function.lineno} {function.name}: {', '.join(hints)}")
    assert not missing, "public functions without type hints:\n" + "\n".join(missing)
