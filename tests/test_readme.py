"""README.md and docs/*.md against the program: a README that drifts from the command line fails here.

- README.md stays short (at most 200 lines) and shows every command.
- Every `speedrun ...` command in a shell block of README.md or docs/*.md (also after `torchrun ... -m speedrun`
  or `python -m speedrun`) is accepted by the command's own argument parser.
- Every relative link resolves, and README.md links every docs/*.md.
- docs/cli.md names only options that exist, each under the command that has it, and names every option of every
  command.
- The cheapest README commands run.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import re
import shlex
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

# The grammar of `speedrun`, without running anything. (When the package moves it to speedrun.cli.program.parser, this
# import moves with it.)
from speedrun.cli.parser import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
CLI_DOC = DOCS / "cli.md"
MAX_README_LINES = 200
SHELL_BLOCKS = {"bash", "sh", "shell", "console"}
SHELL_OPERATORS = set("();<>|&")
ALWAYS_ALLOWED = {"-h", "--help"}
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def _docs() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


def _code_blocks(path: Path) -> list[tuple[str, int, list[str]]]:
    """(info string, line number of the block's first line, lines) of every fenced code block."""
    blocks, current = [], None
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.lstrip().startswith("```"):
            if current is None:
                current = (line.lstrip()[3:].strip().lower(), number + 1, [])
            else:
                blocks.append(current)
                current = None
        elif current is not None:
            current[2].append(line)
    assert current is None, f"{path.name}: a code block is not closed"
    return blocks


def _speedrun_words(command: str) -> list[list[str]]:
    """The words after `speedrun` of each speedrun command in one shell command line (comments, `&&`, `|`, `>` and
    the like cut away): `speedrun ...`, `VAR=x speedrun ...`, `python -m speedrun ...`, `torchrun ... -m speedrun ...`."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    segments: list[list[str]] = [[]]
    for token in lexer:
        if set(token) <= SHELL_OPERATORS:
            segments.append([])
        else:
            segments[-1].append(token)
    found = []
    for words in segments:
        while words and re.fullmatch(r"[A-Za-z_]\w*=.*", words[0]):  # VAR=value before the command
            words = words[1:]
        if words[:1] == ["speedrun"]:
            found.append(words[1:])
        else:
            for i in range(len(words) - 1):
                if words[i] == "-m" and words[i + 1] == "speedrun":
                    found.append(words[i + 2:])
                    break
    return found


def _shell_commands(path: Path) -> list[tuple[str, list[str]]]:
    """(where: FILE:LINE and the line, words after `speedrun`) for every speedrun command in the file's shell blocks,
    with backslash continuations joined."""
    commands = []
    for info, first, lines in _code_blocks(path):
        if info not in SHELL_BLOCKS:
            continue
        i = 0
        while i < len(lines):
            number, text = first + i, lines[i]
            while text.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                text = text.rstrip()[:-1] + " " + lines[i]
            i += 1
            for words in _speedrun_words(text):
                commands.append((f"{path.relative_to(ROOT)}:{number}: {text.strip()}", words))
    return commands


def _parse(words: list[str]) -> tuple[bool, str]:
    """(accepted, what the parser said): argparse's refusal is SystemExit(2); --help and --version exit 0."""
    said = io.StringIO()
    with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
        try:
            build_parser().parse_args(words)
        except SystemExit as exit_:
            return exit_.code in (0, None), said.getvalue()
    return True, said.getvalue()


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:  # argparse keeps no public list of its subparsers
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _command_tree(parser=None, path: tuple[str, ...] = ()) -> dict[tuple[str, ...], argparse.ArgumentParser]:
    """Every command path (`()`, `("train",)`, `("data", "prepare")`, ...) and its parser."""
    parser = build_parser() if parser is None else parser
    tree = {path: parser}
    for name, sub in _subcommands(parser).items():
        tree.update(_command_tree(sub, (*path, name)))
    return tree


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {s for action in parser._actions for s in action.option_strings if s.startswith("--")} - ALWAYS_ALLOWED


def _resolve(words: list[str], tree) -> tuple[str, ...]:
    """The longest command path the words start with: `train [RECIPE] --x` -> ("train",)."""
    path: tuple[str, ...] = ()
    for word in words:
        if (*path, word) not in tree:
            break
        path = (*path, word)
    return path


def _flags_by_command(text: str, tree) -> tuple[dict, list]:
    """docs/cli.md's `--flags`, each with the command it is documented under: the inline `speedrun CMD ...` span it
    is in, else the synopsis line (a code-block line `speedrun CMD ...` and its indented continuations), else the
    section (a heading `` `speedrun CMD` ``; a level-2 heading of anything else ends it; deeper headings that name
    no command stay in it). Returns ({path: [(line, flag)]}, [(line, flag) outside any command])."""
    by_command, unplaced = defaultdict(list), []
    section, line_command, in_block = None, None, False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            in_block, line_command = not in_block, None
            continue
        if in_block:
            if line.startswith("speedrun "):
                line_command = _resolve(line.split()[1:], tree)
            elif not (line.startswith(" ") and line_command is not None):
                line_command = None
        elif line.startswith("#"):
            heading = re.match(r"^(#+)\s+`speedrun ([^`]*)`", line)
            if heading:
                section = _resolve(heading.group(2).split(), tree)
            elif len(line) - len(line.lstrip("#")) == 2:
                section = None
        rest = line
        if not in_block:
            for span in re.findall(r"`speedrun ([^`]*)`", line):
                path = _resolve(span.split(), tree)
                by_command[path] += [(number, flag) for flag in FLAG.findall(span)]
            rest = re.sub(r"`speedrun [^`]*`", " ", line)
        where = line_command if in_block and line_command is not None else section
        for flag in FLAG.findall(rest):
            (by_command[where] if where is not None else unplaced).append((number, flag))
    return by_command, unplaced


# 1. Short.

def test_readme_is_at_most_200_lines():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; move reference material to docs/"


# 2. Every command shown is one the program accepts.

COMMANDS = [command for path in [README, *_docs()] for command in _shell_commands(path)]


@pytest.mark.parametrize("where, words", COMMANDS, ids=[where.split(": ")[0] for where, _ in COMMANDS])
def test_every_shown_command_is_accepted_by_the_parser(where, words):
    accepted, said = _parse(words)
    assert accepted, f"the parser refuses {where}\n{said.strip()}"


def test_the_readme_shows_every_command_and_the_ci_test_command():
    shown = {words[0] for _, words in _shell_commands(README) if words}
    assert len(_shell_commands(README)) >= 20  # the extraction itself still finds the README's commands
    assert set(_subcommands(build_parser())) <= shown, "README.md shows no example of " + ", ".join(
        sorted(set(_subcommands(build_parser())) - shown))
    text = README.read_text(encoding="utf-8")
    assert "pip install -e '.[test]' && python -m pytest -q -m \"not slow\"" in text  # the quick subset first
    assert "The whole suite, `python -m pytest -q`" in text  # and the whole, which .ci/run runs, named
    assert text.count("<!-- records:begin -->") == 1 and text.count("<!-- records:end -->") == 1
    assert text.index("<!-- records:begin -->") < text.index("<!-- records:end -->")


def test_the_extraction_finds_commands_where_the_shell_would():
    line = ("SPEEDRUN_DB=x.db speedrun results --limit 2 | head -3 && torchrun --standalone -m speedrun train "
            "cifar10-94 --runs 25  # a comment --not-a-flag; python -m speedrun recipes")
    assert _speedrun_words(line) == [["results", "--limit", "2"], ["train", "cifar10-94", "--runs", "25"]]
    assert _speedrun_words("pip install -e . && python -m speedrun recipes > out.txt") == [["recipes"]]
    assert not _parse(["train", "--epoch", "3"])[0]  # a refused command is caught, not raised
    assert _parse(["train", "--help"])[0]


def test_the_python_example_parses_and_names_what_speedrun_exports():
    import speedrun

    blocks = [lines for info, _, lines in _code_blocks(README) if info == "python"]
    assert blocks, "README.md has no Python example"
    for lines in blocks:
        tree = ast.parse("\n".join(lines))
        used = {node.attr for node in ast.walk(tree)
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "speedrun"}
        assert {"train", "load"} <= used
        assert all(hasattr(speedrun, name) for name in used), used


# 3. Links, and docs/cli.md against the parser.

@pytest.mark.parametrize("path", [README, *_docs()], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path):
    text = path.read_text(encoding="utf-8")
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        assert (path.parent / target.split("#")[0]).exists(), f"{path.name} links {target}, which does not exist"


def test_the_readme_links_every_docs_file():
    linked = {(ROOT / target.split("#")[0]).resolve()
              for target in re.findall(r"\]\(([^)\s]+)\)", README.read_text(encoding="utf-8"))}
    for name in ("cli.md", "failures.md", "results.md", "architecture.md"):
        assert (DOCS / name).exists(), f"docs/{name} is missing"
    missing = [doc.name for doc in _docs() if doc.resolve() not in linked]
    assert not missing, f"README.md does not link docs/{', docs/'.join(missing)}"


def test_cli_doc_names_only_options_that_exist_under_their_command():
    tree = _command_tree()
    by_command, unplaced = _flags_by_command(CLI_DOC.read_text(encoding="utf-8"), tree)
    wrong = [f"docs/cli.md:{line}: {flag} is not an option of `speedrun {' '.join(path)}`"
             for path, flags in by_command.items() for line, flag in flags
             if flag not in _options(tree[path]) | ALWAYS_ALLOWED]
    everywhere = set().union(*map(_options, tree.values())) | ALWAYS_ALLOWED
    wrong += [f"docs/cli.md:{line}: {flag} is no option of any command" for line, flag in unplaced
              if flag not in everywhere]
    assert not wrong, "\n".join(wrong)


def test_cli_doc_names_every_option_of_every_command():
    tree = _command_tree()
    by_command, _ = _flags_by_command(CLI_DOC.read_text(encoding="utf-8"), tree)
    assert len(tree) >= 12 and ("data", "prepare") in tree and ("results", "import") in tree
    missing = [f"`speedrun {' '.join(path)}` {flag}" for path, parser in sorted(tree.items())
               for flag in sorted(_options(parser)) if flag not in {f for _, f in by_command.get(path, [])}]
    assert not missing, "docs/cli.md does not document: " + ", ".join(missing)


def test_the_flag_attribution_is_by_command():
    tree = _command_tree()
    text = "\n".join(["## `speedrun bench`", "`--vary` and `--runs`; as for `speedrun train --smoke`",
                      "### More", "`--db`", "## Elsewhere", "`--quiet`", "```text",
                      "speedrun data prepare SRC DST [--quality Q]", "    [--on-error skip|stop]", "```"])
    by_command, unplaced = _flags_by_command(text, tree)
    assert sorted(by_command[("bench",)]) == [(2, "--runs"), (2, "--vary"), (4, "--db")]
    assert by_command[("train",)] == [(2, "--smoke")]
    assert by_command[("data", "prepare")] == [(8, "--quality"), (9, "--on-error")]
    assert unplaced == [(6, "--quiet")]


# 4. The cheapest README commands run.

def test_speedrun_recipes_lists_every_recipe():
    """`main(["recipes"])`, in a fresh interpreter: runs.print_recipes binds sys.stdout when it is defined, so in
    this process its lines go to whatever stream was sys.stdout when speedrun.run.runner was first imported."""
    from speedrun.recipes import RECIPES

    code = "import sys; from speedrun.cli.program import main; sys.exit(main(['recipes']))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    listed = {line.split()[0] for line in done.stdout.splitlines() if line.strip()}
    assert set(RECIPES) <= listed, f"not listed: {sorted(set(RECIPES) - listed)}"


def test_the_readme_results_command_runs(tmp_path, capfd):
    from speedrun.cli.program import main

    example = next(words for _, words in _shell_commands(README) if words[:1] == ["results"])
    assert main([*example, "--db", str(tmp_path / "results.db")]) == 0
    assert "no stored result matches" in capfd.readouterr().err  # an empty database: a note, exit 0
