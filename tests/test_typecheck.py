"""The type check CI runs (pyproject.toml's [tool.mypy], .ci/run): mypy finds no error in recipes/ and run/; its
check of the families against the Family protocol (recipes/conformance.py) covers every registered family, and
fails a family whose answer has the wrong type, naming the answer."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from speedrun.recipes import FAMILIES, cifar

ROOT = Path(__file__).resolve().parents[1]
# The settings of pyproject.toml's [tool.mypy], given on the command line where its `files` are not what is checked.
FLAGS = ["--ignore-missing-imports", "--follow-imports=silent", "--python-version", "3.10"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """One cache for the module's runs: the first reads torch's types (about 15 s on a CPU), the second reuses them."""
    return tmp_path_factory.mktemp("mypy-cache")


def _mypy(args: list[str], cwd: Path, cache: Path, mypypath: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "MYPYPATH"}
    if mypypath is not None:
        env["MYPYPATH"] = mypypath
    return subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(cache), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_mypy_as_configured_finds_no_error(cache):
    done = _mypy([], ROOT, cache)  # the files and settings of pyproject.toml, as CI runs it
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "no issues found" in done.stdout


def test_every_registered_family_is_checked_against_the_protocol():
    tree = ast.parse((ROOT / "src" / "speedrun" / "recipes" / "conformance.py").read_text())
    checked = {node.value.id for node in ast.walk(tree) if isinstance(node, ast.AnnAssign)
               and ast.unparse(node.annotation).startswith("Family[") and isinstance(node.value, ast.Name)}
    assert checked == set(FAMILIES)


def _reexport(names: list[str]) -> str:
    return f"from speedrun.recipes.cifar import {', '.join(names)}  # noqa: F401\n"


def test_a_family_answering_with_the_wrong_type_fails_the_check(tmp_path, cache):
    # Two families that are the cifar one by re-export: one as it is, one whose run_steps answers with a str (named
    # imports, not `import *`: mypy keeps an imported name's type over a later definition of the same name).
    names = list(cifar.__all__)
    (tmp_path / "fake_ok.py").write_text(_reexport(names))
    (tmp_path / "fake_bad.py").write_text(_reexport([n for n in names if n != "run_steps"]) + "\n\n"
                                          "def run_steps(cfg, num_train) -> str:\n"
                                          "    return 'many'\n")
    for name in ("fake_ok", "fake_bad"):
        (tmp_path / f"check_{name}.py").write_text("from speedrun.recipes.family import Family\n"
                                                   f"import {name}\n\n"
                                                   f"family: Family = {name}\n")
    done = _mypy([*FLAGS, "check_fake_ok.py", "check_fake_bad.py"], tmp_path, cache,
                 mypypath=os.pathsep.join([str(tmp_path), str(ROOT / "src")]))
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    errors = [line for line in out.splitlines() if ": error:" in line]
    assert len(errors) == 1 and errors[0].startswith("check_fake_bad.py:4:"), out  # the re-export alone conforms
    assert 'member(s) of Module "fake_bad" have conflicts' in out, out
    assert "def run_steps(cfg: Any, num_train: int) -> int" in out and "-> str" in out, out  # expected, got
    assert "missing following" not in out, out  # every other member found: the family was read, not taken as Any


def test_a_family_whose_data_lacks_what_the_runner_reads_fails_the_check(tmp_path, cache):
    """A family's data type must be TrainingData (family.py's Family[Cfg, Data]): data without num_train, which the
    runner counts steps with, is refused by the type check, not found missing in the middle of a run."""
    names = [n for n in cifar.__all__ if n != "load_data"]
    (tmp_path / "fake_data.py").write_text(
        _reexport(names) + "\n\nclass Loose:\n    name = 'x'\n    num_classes = 10\n    classes = ['a']\n\n\n"
        "def load_data(dataset, *, data_dir, image_size, log, smoke=False) -> Loose:\n    return Loose()\n")
    (tmp_path / "check_fake_data.py").write_text("from typing import Any\n\nfrom speedrun.recipes.family import Family\n"
                                                 "import fake_data\n\n"
                                                 "family: Family[Any, fake_data.Loose] = fake_data\n")
    done = _mypy([*FLAGS, "check_fake_data.py"], tmp_path, cache,
                 mypypath=os.pathsep.join([str(tmp_path), str(ROOT / "src")]))
    out = done.stdout + done.stderr
    assert done.returncode == 1 and "check_fake_data.py:6: error" in out, out
    assert 'Type argument "Loose" of "Family" must be a subtype of "TrainingData"' in out, out
