"""The package's own import graph: no import loops, no import from a lower layer to a higher one.

Read from the source with `ast` (nothing is imported, vLLM is not needed). Every `import` and
`from ... import` of a `vllm_kvbm_plugin` module is an edge, wherever it stands: at module level,
inside a function (that is how loops hide) or under a condition. `from pkg import name` is an
edge to the module `pkg.name` when that is a module, else to `pkg` itself. Importing `a.b` also
runs `a/__init__.py`, but that is not counted as an edge from the importer to `a`: a package's
`__init__` re-exporting its own modules is no loop.

Layers, low to high (a module belongs to the layer of its top-level package or module):

0. base: the root package (`__version__`) and `log`; they import nothing of the package.
1. pure core: `hashing`, `reuse`, `tiers`, `events`. No vLLM import anywhere, except
   `events.announcer`, which publishes with vLLM's own publisher and may import vLLM only
   inside functions. `hashing`, `tiers` and `events` import no torch either (`reuse` re-rotates
   K with it), except the tiers' copies between the KV cache and the pool (`tiers.transfer`,
   `tiers.roofline`, and the pool's pinned memory, `tiers.host_memory`): torch and CUDA streams
   without vLLM, so they run on a GPU box that has none.
2. vLLM glue: `compat` (the only module that knows 0.32 from 0.33), `config` (settings).
3. inside vLLM: `patches` (every monkeypatch), `connector` (KVBMConnector), `offloading` (our
   plug-ins of vLLM's OffloadingConnector).
4. front doors: `plugin` (vLLM's entry point), `router`, `cli`.
5. `testing`: helpers for tests, benchmarks and demos; may import anything.

Rules:
- no cycle among modules, and none among the top-level packages either (modules of one layer
  may import each other, but two packages never import each other both ways);
- an import goes to the same layer or a lower one;
- nothing outside `testing` imports `testing`, except a front door inside the function of the
  command that needs it (`vllm-kvbm tiny-model`), so that no user-facing path loads test helpers
  before it is asked to.

An import that must break a rule can be allowed here (`ALLOWED`) with the reason beside it; there
is none today.
"""

import ast
import pathlib

PACKAGE = "vllm_kvbm_plugin"
ROOT = pathlib.Path(__file__).resolve().parents[2] / PACKAGE

LAYERS = {
    PACKAGE: 0, "log": 0,
    "hashing": 1, "reuse": 1, "tiers": 1, "events": 1,
    "compat": 2, "config": 2,
    "patches": 3, "connector": 3, "offloading": 3,
    "plugin": 4, "router": 4, "cli": 4,
    "testing": 5,
}
FRONT_DOOR = 4
PURE = 1
VLLM_INSIDE_FUNCTIONS = {f"{PACKAGE}.events.announcer"}  # the pure-layer modules that may use vLLM, lazily
NO_TORCH = {"hashing", "tiers", "events"}
# copies of KV bytes and the pool they go to: torch, never vLLM
TORCH_COPIES = {f"{PACKAGE}.tiers.transfer", f"{PACKAGE}.tiers.roofline", f"{PACKAGE}.tiers.host_memory"}
ALLOWED: set[tuple[str, str]] = set()  # (importer, imported) edges exempt from the rules, with reasons


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


class Import:
    """One import statement's edge, as the walk found it."""

    def __init__(self, importer: str, target: str, line: int, in_function: bool):
        self.importer, self.target, self.line, self.in_function = importer, target, line, in_function

    def __repr__(self) -> str:
        where = "in a function" if self.in_function else "at module level"
        return f"{self.importer} -> {self.target} (line {self.line}, {where})"


def _imports(module: str, path: pathlib.Path) -> list[Import]:
    """Every import of `module`: targets are full dotted names (ours resolved to modules)."""
    is_package = path.name == "__init__.py"
    out = []

    def resolve(node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)]
        return ".".join(base + ([node.module] if node.module else []))

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                out.extend(Import(module, a.name, child.lineno, in_function) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = resolve(child)
                for a in child.names:
                    full = f"{base}.{a.name}"
                    out.append(Import(module, full if full in MODULES else base, child.lineno, in_function))
            visit(child, inner)

    visit(ast.parse(path.read_text(), str(path)), False)
    return out


IMPORTS = list({(i.importer, i.target, i.line): i for m, p in sorted(MODULES.items()) for i in _imports(m, p)}.values())
OURS = [i for i in IMPORTS if i.target == PACKAGE or i.target.startswith(PACKAGE + ".")]


def unit(module: str) -> str:
    """The top-level package or module of the package that `module` belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else PACKAGE


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node, or a self-loop (Tarjan)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                strong(w)
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
            if len(component) > 1 or v in edges.get(v, ()):
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            strong(v)
    return out


def _edges(key) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for i in OURS:
        if (i.importer, i.target) not in ALLOWED:
            edges.setdefault(key(i.importer), set()).add(key(i.target))
    return edges


def test_every_module_is_in_a_layer():
    assert {unit(m) for m in MODULES} <= set(LAYERS), sorted({unit(m) for m in MODULES} - set(LAYERS))
    unknown = sorted({i.target for i in OURS if i.target not in MODULES})
    assert not unknown, f"imports of modules that do not exist: {unknown}"


def test_no_import_cycle_among_modules():
    cycles = _cycles(_edges(lambda m: m))
    assert not cycles, "import cycles:\n" + "\n".join(
        " <-> ".join(c) + "\n  " + "\n  ".join(map(repr, (i for i in OURS if i.importer in c and i.target in c)))
        for c in cycles)


def test_no_import_cycle_among_packages():
    edges = {u: targets - {u} for u, targets in _edges(unit).items()}
    cycles = _cycles(edges)
    assert not cycles, "packages importing each other:\n" + "\n".join(
        " <-> ".join(c) + "\n  " + "\n  ".join(
            map(repr, (i for i in OURS if unit(i.importer) in c and unit(i.target) in c
                       and unit(i.importer) != unit(i.target))))
        for c in cycles)


def test_no_import_climbs_a_layer():
    climbs = []
    for i in OURS:
        src, dst = LAYERS[unit(i.importer)], LAYERS[unit(i.target)]
        if dst <= src or (i.importer, i.target) in ALLOWED:
            continue
        if unit(i.target) == "testing" and src == FRONT_DOOR and i.in_function:
            continue  # a command that needs test helpers imports them when it runs
        climbs.append(i)
    assert not climbs, "imports from a lower layer to a higher one:\n" + "\n".join(map(repr, climbs))


def test_testing_is_never_imported_at_module_level():
    found = [i for i in OURS if unit(i.target) == "testing" and unit(i.importer) != "testing" and not i.in_function]
    assert not found, found


def test_the_pure_core_imports_no_vllm():
    found = []
    for i in IMPORTS:
        if LAYERS[unit(i.importer)] > PURE:
            continue
        top = i.target.split(".")[0]
        if top == "vllm" and not (i.importer in VLLM_INSIDE_FUNCTIONS and i.in_function):
            found.append(i)
        if top == "torch" and unit(i.importer) in NO_TORCH | {PACKAGE, "log"} and i.importer not in TORCH_COPIES:
            found.append(i)
    assert not found, "the pure core imports vLLM or torch:\n" + "\n".join(map(repr, found))


def test_the_checks_see_what_they_check():
    """The walk finds imports at both levels, and would see the loops this test was written
    against (connector/pic.py <-> patches/pic_blend.py, plugin -> patches -> plugin)."""
    assert any(i.in_function for i in OURS) and any(not i.in_function for i in OURS)
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"a"}}) == [["a"]] and _cycles({"a": {"b"}}) == []
    cli = [i for i in OURS if i.importer == f"{PACKAGE}.cli" and unit(i.target) == "testing"]
    assert cli and all(i.in_function for i in cli)


def test_every_public_class_says_what_it_is():
    """Issue 28's contract: each public class's docstring says what it owns, who calls it, where."""
    missing = [f"{path.relative_to(ROOT.parent)}:{node.lineno} {node.name}"
               for path in sorted(ROOT.rglob("*.py"))
               for node in ast.parse(path.read_text()).body
               if isinstance(node, ast.ClassDef) and not node.name.startswith("_")
               and ast.get_docstring(node) is None]
    assert not missing, "public classes without a docstring:\n" + "\n".join(missing)
