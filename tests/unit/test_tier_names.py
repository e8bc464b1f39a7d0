"""Adding a tier is a module per side (connector/base.py's contracts) and one TierModule: outside
the tier modules themselves, nothing in connector/ branches on which tiers exist. Read with `ast`
(nothing imported): no `if`, `elif`, conditional expression, comprehension filter, `match` or
comparison there may name a tier below the CPU tier, as a string ("disk", "remote") or as an
attribute or name (`.remote`, `disk_tier`)."""

import ast
import pathlib

CONNECTOR = pathlib.Path(__file__).resolve().parents[2] / "vllm_kvbm_plugin" / "connector"
TIERS = ("disk", "remote")
# the tiers' own modules, and layout.py, where the tier secret is read from the remote store or the
# disk directory for every tier at once (Layout.from_vllm) and the disk directory's geometry lives
OWN = {"disk_scheduler.py", "disk_worker.py", "remote_scheduler.py", "remote_worker.py", "tier_modules.py",
       "layout.py"}


def _names(node: ast.AST) -> list[str]:
    out = []
    for n in ast.walk(node):
        if isinstance(n, ast.Constant) and isinstance(n.value, str):
            out.append(n.value)
        elif isinstance(n, ast.Attribute):
            out.append(n.attr)
        elif isinstance(n, ast.Name):
            out.append(n.id)
    return out


def _tests(tree: ast.AST):
    """Every expression something branches on, or compares."""
    for n in ast.walk(tree):
        if isinstance(n, (ast.If, ast.IfExp, ast.While)):
            yield n.test
        elif isinstance(n, ast.comprehension):
            yield from n.ifs
        elif isinstance(n, ast.Match):
            yield n.subject
        elif isinstance(n, ast.Compare):
            yield n


def branches(source: str) -> list[str]:
    """The lines of `source` that branch on a tier's name."""
    found = set()
    for test in _tests(ast.parse(source)):
        for name in _names(test):
            if any(name == t or name.startswith(t + "_") or name.endswith("_" + t) for t in TIERS):
                found.add((test.lineno, ast.unparse(test)))
    return [f"{line}: {text}" for line, text in sorted(found)]


def test_no_branch_on_a_tier_name_outside_the_tier_modules():
    found = [f"{path.name}:{b}" for path in sorted(CONNECTOR.glob("*.py")) if path.name not in OWN
             for b in branches(path.read_text())]
    assert not found, "branches on a tier's name:\n" + "\n".join(found)


def test_the_check_finds_such_branches():
    lines = {b.split(":")[0] for b in branches('if "remote" in tiers or self.disk_path:\n    pass\n'
                                                'x = [t for t in ts if t.label == "disk"]\n'
                                                'y = a.remote_off and 1\nz = 1 if self.remote else 2\n')}
    assert lines == {"1", "3", "5"}
