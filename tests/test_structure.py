"""The layers point one way, configs are data, and schedule modes are known only to the planner."""
from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys

import pytest

from digen_jax.models.specs import SPECS
from digen_jax.runtime import plan

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Each package of digen_jax and the packages it may import (top-level modules such as model_flops.py
# and grid.py count as their own names). Everything else is a layer violation.
ALLOWED = {
    "models": set(),
    "diffusion": {"models"},
    "data": {"models"},  # the family specs (embedding layouts, text pipelines)
    "rewards": {"models", "data"},
    "rl": {"models", "diffusion"},
    "runtime": {"rl", "model_flops"},
    "app": {"models", "diffusion", "data", "rewards", "rl", "runtime", "model_flops", "grid"},
}


def _imports(path: pathlib.Path) -> set[str]:
    """The modules `path` imports (absolute names, `from a import b` as both a and a.b)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _package_edges() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for path in (ROOT / "digen_jax").rglob("*.py"):
        parts = path.relative_to(ROOT / "digen_jax").with_suffix("").parts
        package = parts[0]
        for name in _imports(path):
            if name.startswith("digen_jax."):
                target = name.split(".")[1]
                is_module = (ROOT / "digen_jax" / target).is_dir() or (ROOT / "digen_jax" / f"{target}.py").exists()
                if is_module and target != package:
                    edges.setdefault(package, set()).add(target)
    return edges


def test_packages_import_only_the_layers_below_them():
    edges = _package_edges()
    wrong = {pkg: sorted(targets - ALLOWED[pkg]) for pkg, targets in edges.items()
             if pkg in ALLOWED and targets - ALLOWED[pkg]}
    assert not wrong, f"imports against the layering: {wrong}"


def test_no_import_cycle_between_packages():
    edges = _package_edges()

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for nxt in edges.get(start, ()):
            if nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt})):
                return True
        return False

    cycles = sorted(pkg for pkg in edges if reaches(pkg, pkg, {pkg}))
    assert not cycles, f"packages on an import cycle: {cycles}"


# The JAX-free modules configs may load from the library: the family specs and the package
# inits that lead to them.
SPEC_MODULES = re.compile(rf"digen_jax(\.models(\.specs|\.family_spec|\.({'|'.join(SPECS)})(\.spec)?)?)?")


def test_configs_import_nothing_from_the_library_but_the_family_specs():
    offending = {str(p.relative_to(ROOT)): sorted(n for n in _imports(p) if n.startswith("digen_jax")
                                                  and not n.startswith("digen_jax.models.specs"))
                 for p in (ROOT / "configs").rglob("*.py")}
    assert not {k: v for k, v in offending.items() if v}
    code = ("import sys, configs.sections, configs.flux; "
            "print([m for m in sys.modules if m.startswith(('jax', 'flax', 'digen_jax'))])")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    loaded = ast.literal_eval(out.stdout.strip())
    assert loaded and not [m for m in loaded if not SPEC_MODULES.fullmatch(m)], loaded


def test_the_simulator_imports_neither_orbax_nor_the_model_zoo():
    code = ("import sys, digen_jax.runtime.simulator, digen_jax.runtime.task_costs; "
            "print([m for m in sys.modules if m.startswith(('orbax', 'flax', 'digen_jax.models', 'digen_jax.app'))])")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def _mode_literals(path: pathlib.Path) -> list[str]:
    """Schedule-mode strings that `path` compares with or lists (messages and docstrings aside)."""
    found = []
    modes = set(plan.MODES)

    def literal(node) -> bool:
        return isinstance(node, ast.Constant) and node.value in modes

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            found += [f"{path.name}:{node.lineno}" for op in operands if literal(op)]
            for op in operands:
                if isinstance(op, (ast.Tuple, ast.List, ast.Set)) and any(literal(e) for e in op.elts):
                    found.append(f"{path.name}:{node.lineno}")
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(literal(e) for e in node.elts):
            found.append(f"{path.name}:{node.lineno}")
        elif isinstance(node, ast.arguments):
            found += [f"{path.name}:{d.lineno}" for d in [*node.defaults, *node.kw_defaults] if d is not None and literal(d)]
        elif isinstance(node, ast.Subscript) and literal(node.slice):
            found.append(f"{path.name}:{node.lineno}")
    return found


@pytest.mark.parametrize("tree", ["digen_jax", "launch", "convert"])
def test_no_mode_string_is_compared_outside_the_planner(tree):
    planner = ROOT / "digen_jax" / "runtime" / "plan.py"
    found = [hit for p in sorted((ROOT / tree).rglob("*.py")) if p != planner for hit in _mode_literals(p)]
    assert not found, f"schedule modes spelled outside the planner: {found}"


def _headings(doc: pathlib.Path) -> set[str]:
    """The section identifiers of a doc: '4' for '## 4. Title', 'A3' for '### A3. Title', '(c)' for '## (c) Title'."""
    ids = set()
    for line in doc.read_text().splitlines():
        if line.startswith("#"):
            first = line.lstrip("#").split()[0] if line.lstrip("#").split() else ""
            ids.add(first.rstrip("."))
    return ids


def test_every_docs_citation_resolves_to_a_section_of_a_file_in_the_repo():
    cite = re.compile(r"docs/(design|algorithms|models)\.md((?: sections?)? ((?:\d+|A\d+|\([a-e]\))(?:(?:, | and |-| or )(?:\d+|A\d+|\([a-e]\)))*))?")
    unresolved = []
    for tree in ("digen_jax", "launch", "configs", "convert", "tests"):
        for path in (ROOT / tree).rglob("*.py"):
            for m in cite.finditer(path.read_text()):
                doc = ROOT / "docs" / f"{m.group(1)}.md"
                if not doc.exists():
                    unresolved.append(f"{path.name}: {m.group(0)}")
                    continue
                if m.group(3):
                    ids = re.findall(r"A\d+|\([a-e]\)|\d+", m.group(3))
                    missing = [i for i in ids if i not in _headings(doc)]
                    unresolved += [f"{path.name}: {m.group(0)} ({i} missing)" for i in missing]
    assert not unresolved, unresolved
    assert not [p for tree in ("digen_jax", "launch", "configs", "convert") for p in (ROOT / tree).rglob("*.py")
                if re.search(r"(?<![/a-z])(DESIGN|ALGORITHMS|MODELS)\.md", p.read_text())]
