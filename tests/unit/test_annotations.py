"""Every public function of the package annotates its parameters and its return.

Read from the source with `ast` (nothing is imported). Public: a function at module level, or a
method of a public class (nested public classes too), whose name does not start with `_`, and every
`__init__` of a public class. Every parameter but the first of a method (self, cls; not of a
staticmethod) has an annotation, `*args` and `**kwargs` too, and so has the return (`-> None` on
`__init__`). Nested functions and private names are exempt. mypy (`[tool.mypy]` in pyproject.toml)
checks what the annotations say; this test checks that they are there.
"""

import ast
import pathlib

PACKAGE = "vllm_kvbm_plugin"
ROOT = pathlib.Path(__file__).resolve().parents[2]

Function = ast.FunctionDef | ast.AsyncFunctionDef


def _public_functions(tree: ast.Module) -> list[tuple[str, Function, bool]]:
    """(qualified name, function, is a method) of every public function in a module."""
    found: list[tuple[str, Function, bool]] = []

    def visit(body: list[ast.stmt], prefix: str, in_class: bool) -> None:
        for node in body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                if not node.name.startswith("_") or (in_class and node.name == "__init__"):
                    found.append((prefix + node.name, node, in_class))
            elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                visit(node.body, f"{prefix}{node.name}.", True)
            elif isinstance(node, ast.If | ast.Try):  # definitions under `if TYPE_CHECKING`, `try`
                visit(node.body + node.orelse, prefix, in_class)

    visit(tree.body, "", False)
    return found


def _missing(function: Function, is_method: bool) -> list[str]:
    """The parameters (and "return") a function leaves unannotated."""
    args = function.args
    positional = args.posonlyargs + args.args
    static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in function.decorator_list)
    if is_method and not static:
        positional = positional[1:]
    params = positional + args.kwonlyargs + [a for a in (args.vararg, args.kwarg) if a is not None]
    missing = [a.arg for a in params if a.annotation is None]
    if function.returns is None:
        missing.append("return")
    return missing


def _gaps(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    rel = path.relative_to(ROOT).as_posix()
    return [f"{rel}:{f.lineno} {name}: {', '.join(missing)}"
            for name, f, is_method in _public_functions(tree)
            if (missing := _missing(f, is_method))]


def _sources() -> list[pathlib.Path]:
    return sorted((ROOT / PACKAGE).rglob("*.py"))


def test_every_public_function_is_annotated() -> None:
    gaps = [g for path in _sources() for g in _gaps(path)]
    assert not gaps, "public functions without annotations:\n" + "\n".join(gaps)


def test_the_check_sees_a_gap() -> None:
    """The walk finds what it must: a public method's parameter, a return, *args, a class's
    __init__; and skips self, nested functions, private names and private classes."""
    tree = ast.parse(
        "def f(a: int, *args, **kw: int) -> None: ...\n"
        "def _private(a): ...\n"
        "class C:\n"
        "    def __init__(self, x: int): ...\n"
        "    def m(self, y) -> int:\n"
        "        def nested(z): ...\n"
        "        return 0\n"
        "    @staticmethod\n"
        "    def s(x) -> None: ...\n"
        "    class Inner:\n"
        "        def n(self) : ...\n"
        "class _Hidden:\n"
        "    def m(self, y): ...\n"
    )
    gaps = {name: _missing(f, is_method) for name, f, is_method in _public_functions(tree)}
    assert gaps == {"f": ["args"], "C.__init__": ["return"], "C.m": ["y"], "C.s": ["x"],
                    "C.Inner.n": ["return"]}
