"""Property-based fuzzing of the bundle reader (edge/engines/loader.py, edge/model/bundle_manifest.py).

A bundle is copied onto a device, so its manifest.json is input. Arbitrary bytes, any JSON
value, and a valid manifest with one field replaced: read_manifest, validate_bundle,
pick_artifact and list_artifacts return or raise BundleError -- never a KeyError, TypeError or
AttributeError, and never touch a file outside the bundle.
"""
from __future__ import annotations

import copy
import hashlib
import json
import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from edge.engines.loader import BundleError, list_artifacts, pick_artifact, read_manifest, validate_bundle

from harness.fuzz import JSON_VALUES, fuzz

WEIGHTS = b"not really a gguf, but sized and hashed"


def _manifest() -> dict:
    f = {"path": "m.q4_0.gguf", "bytes": len(WEIGHTS), "sha256": hashlib.sha256(WEIGHTS).hexdigest()}
    return {"format": "starsun-bundle", "version": 1, "tokenizer": None,
            "artifacts": [{"name": "m.q4_0", "backend": "gguf", "graph": "gguf", "roles": ["draft", "target"],
                           "quant": "Q4_0", "fingerprint": "fp", "kv_fingerprint": "fp",
                           "decoder_fingerprint": None, "tokenizer_fingerprint": None, "config": {},
                           "files": [f], "memory": {}}]}


@pytest.fixture(scope="module")
def bundle_dir():
    with tempfile.TemporaryDirectory() as root:
        d = Path(root) / "bundle"
        d.mkdir()
        (d / "m.q4_0.gguf").write_bytes(WEIGHTS)
        (Path(root) / "secret.txt").write_bytes(WEIGHTS)      # the same bytes, outside the bundle
        yield d


def _write(d: Path, text) -> None:
    (d / "manifest.json").write_bytes(text if isinstance(text, bytes) else json.dumps(text).encode())


def _read_or_refuse(d: Path):
    """Every reader: a value or BundleError (with a message). Returns the manifest when valid."""
    try:
        man = read_manifest(d)
    except BundleError as e:
        assert str(e)
        return None
    for call in (lambda: validate_bundle(d), lambda: validate_bundle(d, deep=False, expect_fingerprint="x"),
                 lambda: pick_artifact(man, role="draft", backend="llamacpp", directory=d),
                 lambda: pick_artifact(man, name="m.q4_0", directory=d),
                 lambda: list_artifacts(d)):
        try:
            call()
        except BundleError as e:
            assert str(e)
    return man


def test_valid_manifest_validates(bundle_dir):
    _write(bundle_dir, _manifest())
    assert validate_bundle(bundle_dir)["artifacts"][0]["name"] == "m.q4_0"


@fuzz(200)
@given(st.binary(max_size=200))
@example(b"[" * 100_000)                       # nested past the recursion limit (was RecursionError)
@example(b"[]")                                # not an object (was AttributeError)
@example(b"\xff\xfe")                          # not UTF-8
def test_arbitrary_bytes(bundle_dir, data):
    _write(bundle_dir, data)
    _read_or_refuse(bundle_dir)


@fuzz(200)
@given(JSON_VALUES)
def test_any_json(bundle_dir, value):
    _write(bundle_dir, value)
    _read_or_refuse(bundle_dir)


def _paths(man: dict):
    """(container, key) of every value in the manifest."""
    out = []

    def walk(v):
        items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, list) else ()
        for k, x in items:
            out.append((v, k))
            walk(x)
    walk(man)
    return out


N_PATHS = len(_paths(_manifest()))


@fuzz(250)
@given(st.integers(0, N_PATHS - 1), st.one_of(JSON_VALUES, st.sampled_from(
    ["../secret.txt", "/etc/hostname", "~/x", "a\\..\\..\\secret.txt", "", "a\0b", -1, 2**70])))
@example(0, "starsun-bundle")
@example(N_PATHS - 1, {})
def test_one_field_replaced(bundle_dir, where, value):
    man = copy.deepcopy(_manifest())
    container, key = _paths(man)[where]
    container[key] = value
    _write(bundle_dir, man)
    _read_or_refuse(bundle_dir)


@pytest.mark.parametrize("path", ["../secret.txt", os.path.join("..", "secret.txt"), "/etc/hostname",
                                  "sub/../../secret.txt"])
def test_a_file_outside_the_bundle_is_refused(bundle_dir, path):
    """The outside file has the recorded size and sha256: only the path check stops it."""
    man = _manifest()
    man["artifacts"][0]["files"][0]["path"] = path
    if path == "/etc/hostname":
        data = Path(path).read_bytes()
        man["artifacts"][0]["files"][0].update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    _write(bundle_dir, man)
    with pytest.raises(BundleError, match="outside the bundle"):
        validate_bundle(bundle_dir)


def test_a_link_out_of_the_bundle_is_refused(bundle_dir):
    link = bundle_dir / "link.gguf"
    link.unlink(missing_ok=True)
    link.symlink_to(bundle_dir.parent / "secret.txt")
    man = _manifest()
    man["artifacts"][0]["files"][0]["path"] = "link.gguf"
    _write(bundle_dir, man)
    try:
        with pytest.raises(BundleError, match="link to outside the bundle"):
            validate_bundle(bundle_dir)
    finally:
        link.unlink()
