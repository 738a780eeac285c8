"""The shape the house keeps as it grows: no function takes a crowd of loose values (they travel as a typed spec),
train() reads in one screen, the in-memory families share their loop instead of holding copies, and a family on
the shared base is its network and its differences."""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "speedrun"
RECIPES = SRC / "recipes"
MAX_PARAMETERS = 12
WINDOW = 6  # lines: a run this long in two families is a copy


def _parameters(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = fn.args
    names = [x.arg for x in a.posonlyargs + a.args]
    bound = 1 if names[:1] in (["self"], ["cls"]) else 0
    return len(names) - bound + len(a.kwonlyargs) + (a.vararg is not None) + (a.kwarg is not None)


def _functions(root: Path):
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield path, node


def _docstring_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                lines.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    return lines


def _code(path: Path) -> list[tuple[int, str]]:
    """(line number, the line with its white space folded) for each line of code: no blank, comment or docstring
    line, no import, no line of punctuation alone."""
    text = path.read_text()
    docs = _docstring_lines(ast.parse(text))
    has_code: set[int] = set()
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type not in skip:
            has_code.update(n for n in range(tok.start[0], tok.end[0] + 1) if n not in docs)
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        folded = " ".join(line.split("#")[0].split()) if "#" in line and "'" not in line and '"' not in line \
            else " ".join(line.split())
        if n in has_code and folded and not folded.startswith(("import ", "from ")) \
                and any(c.isalnum() for c in folded):
            out.append((n, folded))
    return out


def _packages() -> list[Path]:
    """The families (a package per family) and any shared module or package they are written on."""
    return sorted(p for p in RECIPES.iterdir() if p.name != "__pycache__" and (p.is_dir() or p.suffix == ".py"))


def test_no_function_in_src_takes_more_than_twelve_parameters():
    crowded = [f"{path.relative_to(SRC)}:{fn.lineno} {fn.name} ({_parameters(fn)})"
               for path, fn in _functions(SRC) if _parameters(fn) > MAX_PARAMETERS]
    assert crowded == [], "group what travels together into a typed spec: " + "; ".join(crowded)


def test_train_reads_in_one_screen():
    tree = ast.parse((SRC / "run" / "runner.py").read_text())
    (train,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "train"]
    assert train.end_lineno is not None and train.end_lineno - train.lineno + 1 <= 100


def test_a_family_on_the_shared_in_memory_base_is_its_network_and_its_differences():
    lines = sum(len(_code(p)) for p in (RECIPES / "cifar_resnet").glob("*.py"))
    assert lines <= 200, f"recipes/cifar_resnet has {lines} lines of code"


def test_no_two_families_share_a_run_of_six_lines():
    seen: dict[tuple[str, ...], str] = {}
    shared = []
    for package in _packages():
        files = [package] if package.is_file() else sorted(package.glob("*.py"))
        mine: dict[tuple[str, ...], str] = {}
        for path in files:
            code = _code(path)
            for i in range(len(code) - WINDOW + 1):
                run = tuple(line for _, line in code[i:i + WINDOW])
                mine.setdefault(run, f"{path.relative_to(RECIPES)}:{code[i][0]}")
        for run, where in mine.items():
            if run in seen:
                shared.append(f"{where} ~ {seen[run]}")
        for run, where in mine.items():
            seen.setdefault(run, where)
    assert shared == [], "write it once, in the shared base: " + "; ".join(shared[:10])


def test_the_copy_finder_finds_a_copy(tmp_path):
    """The finder above, on a planted copy: six lines of one file standing again in another."""
    body = "\n".join(f"x{i} = compute({i}, y)" for i in range(WINDOW)) + "\n"
    (tmp_path / "a.py").write_text("def f(y):\n" + "".join(f"    {line}\n" for line in body.splitlines()))
    (tmp_path / "b.py").write_text("# another family\ndef g(y):\n" + "".join(f"        {line}\n"
                                                                          for line in body.splitlines()))
    a, b = _code(tmp_path / "a.py"), _code(tmp_path / "b.py")
    runs_a = {tuple(line for _, line in a[i:i + WINDOW]) for i in range(len(a) - WINDOW + 1)}
    runs_b = {tuple(line for _, line in b[i:i + WINDOW]) for i in range(len(b) - WINDOW + 1)}
    assert runs_a & runs_b
