"""The target's GGUF in another storage format: moved to export/target_format.py (the demo in
server/ uses it too, and server/ does not import benchmarks/); these names stay for the benchmarks."""
from export.target_format import FORMATS, NATIVE, converted_path, target_gguf

__all__ = ["FORMATS", "NATIVE", "converted_path", "target_gguf"]
