"""The Hugging Face folder a local vLLM server loads, for a model specfleet's loader reads (the
bundled name, a .gguf file): written once by `specfleet export-hf`'s code into specfleet's cache and
reused while the source is the same file.

vLLM loads HF folders only, and an export reads and writes half a gigabyte (20-30 s on a 2-core
machine), so `specfleet up` pays it once per machine rather than at every start. The cache entry is
keyed by the source (its path, size and modification time) and by the exporter's own code, so a
changed model file or a changed export format is exported again, never served stale. The folder is
written beside the entry and renamed into place (`export_hf`), so a start that was stopped halfway
leaves no entry to trust.

`up` stays torch-free (the export needs torch), so it runs this module as a child process:

    python -m specfleet_local.hf_model smollm2-135m      # prints the folder, progress on stderr
"""

from __future__ import annotations

import fcntl
import hashlib
import re
import sys
from collections.abc import Callable
from pathlib import Path


def entry_name(source: str, ident: str) -> str:
    """The cache entry's folder name: the source's name, readable, then a hash of what identifies it.

    >>> entry_name("smollm2-135m", "a")
    'smollm2-135m-ca978112ca1b'
    >>> entry_name("/models/SmolLM2-360M.Q8_0.gguf", "b")
    'smollm2-360m-q8-0-3e23e8160039'
    """
    stem = Path(source.rstrip("/")).name.removesuffix(".gguf")
    slug = re.sub(r"[^a-z0-9]+", "-", stem.lower()).strip("-") or "model"
    return f"{slug}-{hashlib.sha256(ident.encode()).hexdigest()[:12]}"


def cached_export(source: str, progress: Callable[[str], None] = print) -> Path:
    """The HF folder for `source` under specfleet's cache (`cache_root()/hf`), exported now when
    absent or incomplete; its path."""
    from specfleet_engine import hf_export
    from specfleet_engine.kernels.cpu_gemm import cache_root
    from specfleet_engine.loader import resolve_model_path

    path = resolve_model_path(source)
    st = path.stat()
    code = hashlib.sha256(Path(hf_export.__file__).read_bytes()).hexdigest()
    folder = cache_root() / "hf" / entry_name(source, f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{code}")
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f"{folder.name}.lock", "w") as lock:  # two starts at once write it once
        fcntl.flock(lock, fcntl.LOCK_EX)
        if all((folder / f).is_file() for f in hf_export.FILES):
            progress(f"{source}: the export in {folder}")
            return folder
        return hf_export.export_hf(source, folder, overwrite=True, progress=progress)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m specfleet_local.hf_model MODEL (a bundled name or a .gguf file)", file=sys.stderr)
        return 2
    try:
        folder = cached_export(args[0], progress=lambda line: print(line, file=sys.stderr, flush=True))
    except (OSError, ValueError) as e:
        print(f"cannot export {args[0]} as a Hugging Face folder: {e}", file=sys.stderr)
        return 1
    print(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
