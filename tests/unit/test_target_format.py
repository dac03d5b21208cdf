"""export/target_format.py: the target's GGUF stored as another format, written once and reused."""
from __future__ import annotations

from pathlib import Path

import pytest

import export.gguf
from export.target_format import FORMATS, NATIVE, converted_path, target_gguf


@pytest.fixture
def fetched(tmp_path, monkeypatch):
    """A fake fetched model: STARSUN_MODELS points at tmp_path, the GGUF is a placeholder file."""
    from edge.model.fetch import model_path
    monkeypatch.setenv("STARSUN_MODELS", str(tmp_path))
    path = model_path("qwen2.5-coder-1.5b")
    path.write_bytes(b"GGUF placeholder")
    return path


@pytest.fixture
def quantiser(monkeypatch):
    """llama.cpp's quantiser replaced by one that writes a small file and counts its calls."""
    calls = []

    def fake(src, out, ftype, threads=0, requantize=False):
        calls.append((Path(src), Path(out), ftype, requantize))
        Path(out).write_bytes(b"converted " + ftype.encode())
        return Path(out)
    monkeypatch.setattr(export.gguf, "quantize_with_llamacpp", fake)
    return calls


def test_native_is_the_fetched_file_and_runs_no_quantiser(fetched, quantiser):
    assert target_gguf("qwen2.5-coder-1.5b") == fetched
    assert target_gguf("qwen2.5-coder-1.5b", NATIVE) == fetched
    assert target_gguf(str(fetched), NATIVE) == fetched            # a path works like a name
    assert quantiser == []


def test_unknown_format_is_a_clear_error(fetched, quantiser):
    with pytest.raises(ValueError, match="unknown target format .Q5_K.*native, F16, BF16, Q8_0, Q4_0"):
        target_gguf("qwen2.5-coder-1.5b", "Q5_K")
    assert quantiser == [] and FORMATS == ("native", "F16", "BF16", "Q8_0", "Q4_0")


def test_converted_once_then_reused(fetched, quantiser, capsys):
    out = target_gguf("qwen2.5-coder-1.5b", "F16")
    assert out == fetched.with_name("qwen2.5-coder-1.5b-instruct-f16.gguf") == converted_path(fetched, "F16")
    assert out.read_bytes() == b"converted F16" and not out.with_suffix(".tmp").exists()
    assert quantiser == [(fetched, out.with_suffix(".tmp"), "F16", True)]   # requantize: the source is Q4_K_M
    err = capsys.readouterr().err
    assert "writing qwen2.5-coder-1.5b-instruct-f16.gguf (F16, once)" in err and "done:" in err
    assert target_gguf("qwen2.5-coder-1.5b", "F16") == out                 # cached: no second conversion
    assert len(quantiser) == 1
    assert target_gguf("qwen2.5-coder-1.5b", "Q8_0").name == "qwen2.5-coder-1.5b-instruct-q8_0.gguf"
    assert len(quantiser) == 2


def test_a_failed_conversion_leaves_no_model_behind(fetched, monkeypatch):
    def broken(src, out, ftype, threads=0, requantize=False):
        Path(out).write_bytes(b"half")
        raise export.gguf.GGUFExportError("quantiser failed")
    monkeypatch.setattr(export.gguf, "quantize_with_llamacpp", broken)
    with pytest.raises(export.gguf.GGUFExportError):
        target_gguf("qwen2.5-coder-1.5b", "F16")
    assert not converted_path(fetched, "F16").exists()


def test_only_a_gguf_can_be_converted(tmp_path, quantiser):
    hf_dir = tmp_path / "hf-model"
    hf_dir.mkdir()
    assert target_gguf(hf_dir) == hf_dir
    with pytest.raises(ValueError, match="needs a GGUF file"):
        target_gguf(hf_dir, "F16")
    assert quantiser == []
