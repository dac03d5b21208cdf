"""`python -m benchmarks`: every benchmark script, by group, with the question it answers."""
from __future__ import annotations

import ast
from pathlib import Path

HERE = Path(__file__).resolve().parent


def scripts() -> list[tuple[str, str]]:
    """(module, its docstring's first paragraph) for every script: a group's .py files, lib/ excluded."""
    out = []
    for path in sorted(HERE.glob("*/*.py")):
        if path.parent.name == "lib" or path.name.startswith("_"):
            continue
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        out.append((f"benchmarks.{path.parent.name}.{path.stem}", " ".join(doc.split("\n\n")[0].split())))
    return out


def main() -> None:
    print("Run from the repository root: .venv/bin/python -m MODULE [--help]\n")
    group = None
    for module, first in scripts():
        g = module.split(".")[1]
        if g != group:
            print(("\n" if group else "") + f"{g}/")
            group = g
        print(f"  {module:40} {first}")
    print("\nResults and the figures of record: benchmarks/results/README.md")


if __name__ == "__main__":
    main()
