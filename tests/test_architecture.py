"""The package's shape, checked: the import-linter contracts in pyproject.toml hold (and fail on a violation),
there are no import loops, the import graph is at most 10 modules deep, no module uses another's private names,
imports sit inside functions only where the contract allows, every family meets the Family protocol, and no file
of the project cites a file that is not in it."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "speedrun"
sys.path.insert(0, str(ROOT / "tools"))
import architecture  # noqa: E402  (tools/architecture.py: the measurements docs/architecture.md shows)

# Imports that stay inside functions, each for a reason: heavy or optional packages imported only when used
# (matplotlib for the report's charts, torchcodec for nvJPEG, scipy.stats for the t-distribution, half a second that
# a single run never needs), a POSIX-only module (fcntl: Windows has none), the public API's lazy names (`import
# speedrun` imports no torch), and the program's lazy commands (`speedrun --help`, `speedrun recipes` and the file
# commands import no torch).
# top-level packages, or modules by their full name (torch.utils.tensorboard imports the tensorboard package)
LAZY_OK = {"matplotlib", "torchcodec", "fcntl", "optuna", "sqlalchemy", "tensorboard", "torch.utils.tensorboard",
           "scipy"}
LAZY_MODULES = {"speedrun/__init__.py", "speedrun/cli/program.py"}


def _lint(cwd: Path, src: Path) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(src), "PATH": "/usr/bin:/bin", "HOME": str(cwd)}
    code = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    return subprocess.run([sys.executable, "-c", code, "--no-cache"], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def test_the_layer_contracts_hold():
    done = _lint(ROOT, ROOT / "src")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "Contracts: 3 kept, 0 broken" in done.stdout


@pytest.mark.parametrize("module, line", [
    ("records/cost.py", "import speedrun.cli.program"),  # a low layer importing the top one
    ("recipes/cifar/data.py", "import speedrun.recipes.imagenet"),  # one family importing another
])
def test_a_violation_fails_the_contract(tmp_path, module, line):
    shutil.copytree(ROOT / "src" / "speedrun", tmp_path / "src" / "speedrun")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / "src" / "speedrun" / module
    target.write_text(target.read_text() + f"\n{line}  # the violation\n")
    done = _lint(tmp_path, tmp_path / "src")
    assert done.returncode != 0 and "BROKEN" in done.stdout, done.stdout[-3000:]


def test_no_import_loops_and_at_most_10_modules_deep():
    g = architecture.graph()
    assert architecture.loops(g) == []
    n, chain = architecture.depth(g)
    assert n <= 10, " -> ".join(chain)


def _modules() -> dict[str, Path]:
    return {".".join(p.relative_to(SRC.parent).with_suffix("").parts).removesuffix(".__init__"): p
            for p in SRC.rglob("*.py")}


def test_no_module_uses_another_modules_private_names():
    modules, found = _modules(), []
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("speedrun"):
                for a in node.names:
                    # a module of the package (speedrun._version) is imported as a module, not a private name
                    if (a.name.startswith("_") and not a.name.startswith("__")
                            and f"{node.module}.{a.name}" not in modules):
                        found.append(f"{name}:{node.lineno} imports {node.module}.{a.name}")
                    if f"{node.module}.{a.name}" in modules:
                        aliases[a.asname or a.name] = f"{node.module}.{a.name}"
            elif isinstance(node, ast.Import):
                aliases.update({a.asname or a.name: a.name for a in node.names if a.name.startswith("speedrun")})
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and isinstance(node.value, ast.Name) and node.value.id in aliases):
                found.append(f"{name}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}")
    assert found == []


def test_imports_inside_functions_only_for_heavy_optional_packages():
    found = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC.parent).as_posix()
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    names = [node.module or "."]
                else:
                    continue
                if rel in LAZY_MODULES and all(n.startswith("speedrun") for n in names):
                    continue
                found += [f"{rel}:{node.lineno} {n}" for n in names
                          if n.split(".")[0] not in LAZY_OK and n not in LAZY_OK]
    assert found == []


def test_every_registered_family_meets_the_protocol():
    from speedrun.recipes import FAMILIES, RECIPES
    from speedrun.recipes.family import Family, FamilyConfig, mismatches

    assert len(FAMILIES) >= 3
    for name, recipe in RECIPES.items():
        family = recipe.module()
        assert mismatches(family) == [], name
        assert isinstance(family, Family), name
        cfg = recipe.make_config()
        assert isinstance(cfg, FamilyConfig), name
        cfg.validate()
        assert family.with_epochs(cfg, 1.0).epochs == 1.0


def test_a_family_missing_a_name_is_named():
    import types

    from speedrun.recipes import cifar
    from speedrun.recipes.family import mismatches

    partial = types.SimpleNamespace(**{k: getattr(cifar, k) for k in cifar.__all__ if k != "warmup"})
    partial.train_run = lambda cfg, data, device, seed: None  # takes none of the keyword arguments the runner passes
    problems = mismatches(partial)
    assert "warmup() is missing" in problems and "train_run() does not take hooks" in problems


CITED_OUTSIDE = re.compile(r"\b(STYLE|REFERENCES|DEVELOPERS)\.md\b")
HISTORY = re.compile(r"\b[Ii]ssue #?\d+\b")


def _project_files() -> list[Path]:
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    files = [ROOT / f for f in tracked] if tracked else list(ROOT.rglob("*.py"))
    return [f for f in files if f.suffix in (".py", ".md", ".toml", ".cfg", "") and f.is_file()
            and "fixtures" not in f.parts and f.name != "test_architecture.py"]


def test_no_file_cites_a_file_outside_the_project_and_no_code_narrates_issues():
    cites, history = [], []
    for f in _project_files():
        text = f.read_text(errors="replace")
        rel = f.relative_to(ROOT).as_posix()
        cites += [f"{rel}:{text[:m.start()].count(chr(10)) + 1}" for m in CITED_OUTSIDE.finditer(text)]
        if f.suffix == ".py":
            history += [f"{rel}:{text[:m.start()].count(chr(10)) + 1}" for m in HISTORY.finditer(text)]
    assert cites == [] and history == []
