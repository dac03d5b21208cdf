"""The kit reads nothing outside its own tree: no path into the checkout's sibling `shared`
folder, no design notes kept beside the checkout instead of in docs/.

(a) `git grep` over every tracked file finds no such reference (the pattern is built by
concatenation, so this file does not match itself); (b) at run time tests/conftest.py's audit
hook records any `open` of a path inside that folder and fails the session. Here: that the hook
records such an open (called directly on a made-up path: nothing real is read).
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHARED = ROOT.parent / "shared"
FORBIDDEN = "|".join([r"\.\./" + "shared", "DESIGN" + r"\.md", "DATA" + r"\.md"])


def _git_checkout() -> bool:
    if shutil.which("git") is None:
        return False
    r = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--is-inside-work-tree"],
                       capture_output=True, text=True)
    return r.returncode == 0 and r.stdout.strip() == "true"


def _walk_matches() -> list[str]:
    """Without git (a copied tree): the same search over the kit's text files."""
    import re
    rx = re.compile(FORBIDDEN)
    skip = {".git", ".venv", "models", "runs", "build", "node_modules", "__pycache__"}
    hits = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if d not in skip and not d.endswith(".egg-info")]
        for name in filenames:
            p = Path(dirpath) / name
            if p.suffix not in {".py", ".md", ".toml", ".sh", ".txt", ".cfg", ".json", ".yml", ".yaml"} \
                    and name != "Makefile":
                continue
            try:
                text = p.read_text(errors="replace")
            except OSError:
                continue
            hits += [f"{p.relative_to(ROOT)}:{i}: {line}" for i, line in enumerate(text.splitlines(), 1)
                     if rx.search(line)]
    return hits


def test_no_file_of_the_kit_names_a_path_outside_it():
    if _git_checkout():
        r = subprocess.run(["git", "-C", str(ROOT), "grep", "-nE", FORBIDDEN], capture_output=True, text=True)
        assert r.returncode in (0, 1), r.stderr            # 1: nothing found
        hits = r.stdout.splitlines()
    else:
        hits = _walk_matches()
    assert not hits, "these lines point outside the repository (docs/ holds the design now):\n" + "\n".join(hits)


def test_the_audit_hook_records_an_open_inside_shared(shared_opens, tmp_path):
    recorder = type(shared_opens)(SHARED)               # a fresh one: the session's stays clean
    recorder("open", (str(SHARED / "notes.md"), "r", 0))
    recorder("open", (os.fsencode(SHARED / "sub" / "x.bin"), "rb", 0))
    recorder("open", (str(ROOT / "README.md"), "r", 0))          # inside the kit: fine
    recorder("open", (str(ROOT.parent / "shared-not"), "r", 0))  # a sibling with a longer name: fine
    recorder("open", (3, "r", 0))                                # a file descriptor: not a path
    recorder("exec", (str(SHARED / "notes.md"),))                # another event
    assert recorder.opened == [os.path.realpath(SHARED / "notes.md"), os.path.realpath(SHARED / "sub" / "x.bin")]


def test_the_audit_hook_follows_a_symlink_into_shared(shared_opens, tmp_path):
    target = tmp_path / "shared"
    target.mkdir()
    link = tmp_path / "inside" / "link"
    link.parent.mkdir()
    link.symlink_to(target)
    recorder = type(shared_opens)(target)
    recorder("open", (str(link / "f.txt"), "r", 0))
    assert recorder.opened == [os.path.realpath(target / "f.txt")]


def test_the_session_recorder_is_installed(shared_opens):
    assert Path(shared_opens.root) == Path(os.path.realpath(SHARED))
    assert shared_opens.opened == [], "this session already opened files outside the tree"
