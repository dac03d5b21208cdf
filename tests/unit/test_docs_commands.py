"""Every command the README and docs/*.md show parses, without running it.

For each shell code block (```sh, ```bash, ```shell, ```console) of README.md and docs/*.md, each
command line (continuations joined, comments and `$ ` prompts dropped) is checked by what it runs:

* `edge-agent`, `edge-hub`, `edge-export` (bare or `.venv/bin/...`, also inside `$(...)`): the
  subcommand exists and click parses every option and argument (`make_context`, nothing invoked).
  Files a command would read need not exist here: `click.Path(exists=True)` is relaxed, and a
  `--config FILE` absent from the repository is dropped (its required options may then be missing).
* `make TARGET`: the Makefile has that target.
* `python -m MODULE`: the module is importable (`importlib.util.find_spec`; a package needs a
  `__main__`);
  `python path/to/script.py`: the file exists.

One test per doc line, so a failure names the file and line to fix.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import re
import shlex
from pathlib import Path

import click
import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_LANGS = {"sh", "bash", "shell", "console"}
CLIS = {"edge-agent": "edge.cli.agent:main", "edge-hub": "server.hub_cli:main",
        "edge-export": "export.export_cli:main"}
PYTHONS = {"python", "python3"}
OPERATORS = {"|", "||", "&&", ";", "&", ">", ">>", "<", "2>", "(", ")"}


def shell_lines(path: Path) -> list[tuple[int, str]]:
    """(first line number, command) for every command line in the file's shell code blocks."""
    out: list[tuple[int, str]] = []
    lang = None          # the open block's language; None outside a block
    pending: list[str] = []
    start = 0
    for no, raw in enumerate(path.read_text().splitlines(), 1):
        stripped = raw.strip()
        if stripped.startswith("```"):
            lang = None if lang is not None else (stripped[3:].strip().split() or [""])[0]
            pending = []
            continue
        if lang not in SHELL_LANGS:
            continue
        line = stripped
        if not pending:
            if lang == "console":
                if not line.startswith("$ "):
                    continue        # output, not a command
            if line.startswith("$ "):
                line = line[2:]
            if not line or line.startswith("#"):
                continue
            start = no
        if line.endswith("\\"):
            pending.append(line[:-1])
            continue
        out.append((start, " ".join([*pending, line])))
        pending = []
    return out


def _cases():
    cases = []
    for path in DOCS:
        for no, line in shell_lines(path):
            rel = path.relative_to(ROOT).as_posix()
            cases.append(pytest.param(rel, no, line, id=f"{rel}:{no}"))
    return cases


CASES = _cases()


def _tokens(line: str) -> list[str]:
    lex = shlex.shlex(line, posix=True, punctuation_chars=";&|<>()")
    lex.whitespace_split = True
    lex.commenters = "#"
    return list(lex)


def _segments(tokens: list[str]) -> list[list[str]]:
    """The simple commands of a pipeline / list, env assignments and sudo dropped."""
    segs, cur = [], []
    for t in tokens:
        if t in OPERATORS or (t and set(t) <= set(";&|<>()")):
            segs.append(cur)
            cur = []
        else:
            cur.append(t)
    segs.append(cur)
    out = []
    for seg in segs:
        while seg and (re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", seg[0]) or seg[0] in ("sudo", "env", "exec")):
            seg = seg[1:]
        if seg:
            out.append(seg)
    return out


def _substitutions(line: str) -> list[str]:
    """The commands inside `$(...)` (not nested)."""
    return re.findall(r"\$\(([^()]*)\)", line)


def _program(word: str) -> str:
    word = word.removeprefix("./")
    for prefix in (".venv/bin/", "$(BIN)/", "$BIN/"):
        word = word.removeprefix(prefix)
    return word


def _make_targets() -> set[str]:
    targets = set()
    for line in (ROOT / "Makefile").read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.-][A-Za-z0-9_. -]*?)\s*:(?![=:])", line)
        if m and "$" not in m.group(1):
            targets.update(m.group(1).split())
    return targets


@contextlib.contextmanager
def _files_need_not_exist(command: click.Command):
    """click.Path(exists=True) relaxed while parsing: the docs name files made elsewhere."""
    relaxed = [p.type for p in command.params if isinstance(p.type, click.Path) and p.type.exists]
    for t in relaxed:
        t.exists = False
    try:
        yield
    finally:
        for t in relaxed:
            t.exists = True


def _drop_missing_config(args: list[str]) -> tuple[list[str], bool]:
    """`--config FILE` where FILE is not in the repository: dropped (True: options may be missing)."""
    out, dropped, i = [], False, 0
    while i < len(args):
        a = args[i]
        if a == "--config" and i + 1 < len(args):
            if not (ROOT / args[i + 1]).is_file():
                dropped, i = True, i + 2
                continue
        elif a.startswith("--config=") and not (ROOT / a.split("=", 1)[1]).is_file():
            dropped, i = True, i + 1
            continue
        out.append(a)
        i += 1
    return out, dropped


def check_cli(prog: str, args: list[str]) -> None:
    module, attr = CLIS[prog].split(":")
    command = getattr(importlib.import_module(module), attr)
    name, rest = prog, list(args)
    while isinstance(command, click.Group):
        # the group's own options (e.g. edge-hub -v) come before the subcommand
        with command.make_context(name, rest, resilient_parsing=False) as ctx:
            remaining = [*getattr(ctx, "_protected_args", []), *ctx.args]
            if not remaining:
                pytest.fail(f"{prog}: no subcommand")
            sub = command.get_command(ctx, remaining[0])
        if sub is None:
            pytest.fail(f"{name}: no such command {remaining[0]!r} (has: {', '.join(command.list_commands(ctx))})")
        name, command, rest = f"{name} {remaining[0]}", sub, remaining[1:]
    rest, config_dropped = _drop_missing_config(rest)
    if config_dropped and not any("--config" in p.opts for p in command.params):
        pytest.fail(f"{name}: No such option '--config'.")
    with _files_need_not_exist(command):
        try:
            command.make_context(name, rest, resilient_parsing=False)
        except click.exceptions.Exit:
            pass                                   # --help and other eager exits
        except click.MissingParameter as e:
            if not config_dropped:
                pytest.fail(f"{name}: {e.format_message()}")
        except click.UsageError as e:              # NoSuchOption, BadParameter, extra arguments, ...
            pytest.fail(f"{name}: {e.format_message()}")


def check_simple(seg: list[str]) -> None:
    while len(seg) > 1 and seg[-1] == "...":      # "and the rest, as above"
        seg = seg[:-1]
    prog = _program(seg[0])
    if prog in CLIS:
        check_cli(prog, seg[1:])
    elif prog == "make":
        known = _make_targets()
        for word in seg[1:]:
            if word.startswith("-") or "=" in word or word == "...":
                continue
            assert word in known, f"make: no target {word!r} in the Makefile"
    elif prog in PYTHONS:
        args = seg[1:]
        if len(args) >= 2 and args[0] == "-m":
            spec = importlib.util.find_spec(args[1])
            assert spec is not None, f"python -m {args[1]}: no such module"
            if spec.submodule_search_locations is not None:      # a package runs its __main__
                assert importlib.util.find_spec(f"{args[1]}.__main__") is not None, \
                    f"python -m {args[1]}: a package without __main__"
        elif args and args[0].endswith(".py"):
            assert (ROOT / args[0]).is_file(), f"python {args[0]}: no such file"


@pytest.mark.parametrize("doc, line_no, line", CASES)
def test_doc_command_parses(doc, line_no, line, capsys):
    for inner in _substitutions(line):
        for seg in _segments(_tokens(inner)):
            check_simple(seg)
    for seg in _segments(_tokens(re.sub(r"\$\([^()]*\)", "SUBST", line))):
        check_simple(seg)


def test_docs_have_commands():
    """The scan finds the README's two commands, so an empty parametrisation cannot pass silently."""
    lines = [line for _, line in shell_lines(ROOT / "README.md")]
    assert any(line.startswith("make demo") for line in lines)
    assert any(line.startswith("make test") for line in lines)
