"""The package's shape, measured from its code: `python tools/architecture.py [metrics|draw] [--src DIR]`.

metrics  modules, lines, the longest function, the import graph's depth and its loops (import cycles), and the
         imports that cross the layers of pyproject.toml's import-linter contract upwards.
draw     rewrites the generated part of docs/architecture.md (between its `<!-- layers:begin -->` and
         `<!-- layers:end -->` lines): a Mermaid diagram of the layers and the imports between them, and the
         modules of each layer with their lines. GitHub renders the diagram; the text stays readable as it is.

The import graph is grimp's (the library import-linter is built on): every `import` statement in the package,
those inside functions and under `if TYPE_CHECKING:` included (a name imported only for a type annotation still
ties two modules). Depth counts modules along the longest chain of imports, each import cycle taken as one node.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import sys
import tomllib
from collections import defaultdict
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "speedrun"


def layers(pyproject: Path = ROOT / "pyproject.toml") -> list[list[str]]:
    """The layers contract's layers, top first, each a list of its independent members ("a | b")."""
    config = tomllib.loads(pyproject.read_text())["tool"]["importlinter"]
    contract = next(c for c in config["contracts"] if c["type"] == "layers")
    return [[part.strip() for part in re.split(r"[|:]", layer)] for layer in contract["layers"]]


def graph() -> grimp.ImportGraph:
    return grimp.build_graph(PACKAGE, exclude_type_checking_imports=False, cache_dir=None)


def loops(g: grimp.ImportGraph) -> list[list[str]]:
    """The import cycles: strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(g.find_modules_directly_imported_by(v)):
            if w not in index:
                visit(w)
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
            if len(component) > 1:
                found.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10_000))  # one frame per module on the longest path
    try:
        for module in sorted(g.modules):
            if module not in index:
                visit(module)
    finally:
        sys.setrecursionlimit(limit)
    return found


def depth(g: grimp.ImportGraph) -> tuple[int, list[str]]:
    """(modules on the longest import chain, that chain), each import cycle counted as one module."""
    component = {m: m for m in g.modules}
    for cycle in loops(g):
        for m in cycle:
            component[m] = cycle[0]
    edges: dict[str, set[str]] = defaultdict(set)
    for m in g.modules:
        for n in g.find_modules_directly_imported_by(m):
            if component[m] != component[n]:
                edges[component[m]].add(component[n])
    longest: dict[str, list[str]] = {}

    def chain(v: str) -> list[str]:
        if v not in longest:
            longest[v] = [v] + max((chain(w) for w in sorted(edges[v])), key=len, default=[])
        return longest[v]

    best = max((chain(v) for v in sorted(set(component.values()))), key=len)
    return len(best), best


def functions(src: Path) -> list[tuple[int, str]]:
    """(lines, 'module:qualified name') of every function and method, nested ones inside their parent's lines."""
    out = []
    for path in sorted(src.rglob("*.py")):
        module = ".".join(path.relative_to(src.parent).with_suffix("").parts)

        def walk(node: ast.AST, prefix: str) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    out.append((child.end_lineno - child.lineno + 1, f"{module}:{prefix}{child.name}"))
                    walk(child, f"{prefix}{child.name}.")
                elif isinstance(child, ast.ClassDef):
                    walk(child, f"{prefix}{child.name}.")

        walk(ast.parse(path.read_text()), "")
    return sorted(out, reverse=True)


def layer_of(module: str, stack: list[list[str]]) -> int | None:
    for i, members in enumerate(stack):
        if any(module == f"{PACKAGE}.{m}" or module.startswith(f"{PACKAGE}.{m}.") for m in members):
            return i
    return None


def metrics(src: Path) -> dict:
    g = graph()
    files = sorted(src.rglob("*.py"))
    lines = sum(len(p.read_text().splitlines()) for p in files)
    n, chain = depth(g)
    longest = functions(src)[0]
    try:
        stack = layers()
    except (OSError, KeyError, StopIteration):
        stack = []
    upward = sorted((a, b) for a in g.modules for b in g.find_modules_directly_imported_by(a)
                    if layer_of(a, stack) is not None and layer_of(b, stack) is not None
                    and layer_of(b, stack) < layer_of(a, stack))
    return {"modules": len(files), "lines": lines, "longest_function": f"{longest[1]} ({longest[0]} lines)",
            "depth": n, "longest_chain": " -> ".join(chain), "loops": loops(g), "upward_imports": upward}


def _module_lines(src: Path) -> dict[str, int]:
    return {".".join(p.relative_to(src.parent).with_suffix("").parts).removesuffix(".__init__"):
            len(p.read_text().splitlines()) for p in src.rglob("*.py")}


def draw(src: Path) -> str:
    """The generated Markdown: the Mermaid diagram of the layers and a table of their modules."""
    g, stack = graph(), layers()
    sizes = _module_lines(src)

    def member(module: str) -> str | None:
        for members in stack:
            for m in members:
                if module == f"{PACKAGE}.{m}" or module.startswith(f"{PACKAGE}.{m}."):
                    return m
        return None

    between: dict[tuple[str, str], int] = defaultdict(int)
    for a in g.modules:
        for b in g.find_modules_directly_imported_by(a):
            ma, mb = member(a), member(b)
            if ma and mb and ma != mb:
                between[ma, mb] += 1
    node = {m: re.sub(r"\W", "_", m) for members in stack for m in members}
    out = ["```mermaid", "flowchart TD"]
    for i, members in enumerate(stack):
        out.append(f'  subgraph L{i}["layer {i + 1}"]')
        out.append("    direction LR")
        for m in members:
            count = sum(n for mod, n in sizes.items() if mod == f"{PACKAGE}.{m}" or mod.startswith(f"{PACKAGE}.{m}."))
            out.append(f'    {node[m]}["{m}<br/>{count} lines"]')
        out.append("  end")
    for (a, b), n in sorted(between.items()):
        out.append(f"  {node[a]} -->|{n}| {node[b]}")
    out += ["```", "", "| layer | member | modules (lines) |", "|---|---|---|"]
    for i, members in enumerate(stack):
        for m in members:
            mods = sorted((mod, n) for mod, n in sizes.items()
                          if mod == f"{PACKAGE}.{m}" or mod.startswith(f"{PACKAGE}.{m}."))
            listed = ", ".join(f"`{mod.removeprefix(PACKAGE + '.')}` ({n})" for mod, n in mods)
            out.append(f"| {i + 1} | `{m}` | {listed} |")
    facts = metrics(src)
    out += ["", f"{facts['modules']} modules, {facts['lines']} lines; the longest import chain passes "
                f"{facts['depth']} modules; {len(facts['loops'])} import loops; "
                f"{len(facts['upward_imports'])} imports that run back up a layer. Arrows: imports between "
                "members, with their count."]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("metrics", "draw"), nargs="?", default="metrics")
    parser.add_argument("--src", default=str(ROOT / "src" / PACKAGE), help="the package's folder")
    parser.add_argument("--doc", default=str(ROOT / "docs" / "architecture.md"), help="draw: the file to rewrite")
    args = parser.parse_args(argv)
    src = Path(args.src)
    if args.action == "metrics":
        for key, value in metrics(src).items():
            print(f"{key}: {value}")
        return 0
    doc = Path(args.doc)
    text = doc.read_text()
    begin, end = "<!-- layers:begin -->", "<!-- layers:end -->"
    if text.count(begin) != 1 or text.count(end) != 1:
        print(f"{doc} needs one line {begin} and, after it, one line {end}", file=sys.stderr)
        return 2
    head, rest = text.split(begin)
    doc.write_text(head + begin + "\n" + draw(src) + "\n" + end + rest.split(end, 1)[1])
    print(f"rewrote the generated part of {os.path.relpath(doc)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
