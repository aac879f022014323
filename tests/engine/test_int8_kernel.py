"""The few-row CPU kernel (kernels/csrc/int8_linear.cpp, built by kernels/cpu_gemm.py) and its torch fallback in quant.py.

Every path of the kernel this CPU runs (avx512, avx2, portable) is compared with a float64
reference; a path the CPU lacks is skipped, saying so. The first run compiles the kernel (~15 s)
into the cache; later runs load it."""

import platform
import subprocess
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from specfleet_engine import quant
from specfleet_engine.kernels import cpu_gemm
from specfleet_engine.quant import (Int8WeightOnlyLinear, int8_kernel, pack_int8_weight, quantize_int8,
                                    unpack_int8_weight, weight_bytes)

MODEL_SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152)]  # K -> N (SmolLM2-135M)
# N mod 32 and mod 16 all over (the last block's channels, AVX2's half blocks), K odd and even
ODD_SHAPES = [(67, 111), (1, 1), (7, 5), (40, 17), (33, 33), (130, 100), (64, 31), (100, 65), (17, 1000), (300, 57)]
ROWS = [1, 2, 3, 5, 8, 16, 17, 64]
# every row-tile shape of every path: AVX2 1-2 rows whole blocks, 3-6 half blocks, 7+ split in
# tiles of at most 6 (7 = 4 + 3, 13 = 5 + 4 + 4); AVX-512 and portable tiles of at most 12
ALL_ROWS = list(range(1, 18)) + [25, 64]


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux reports them (empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


#: what each path needs from the CPU, in /proc/cpuinfo's words
ISA_FLAGS = {"avx512": {"avx512f"}, "avx2": {"avx2", "fma"}, "portable": set()}


def cpu_has(isa: str) -> bool:
    return isa == "portable" or (platform.machine().lower() in ("x86_64", "amd64") and ISA_FLAGS[isa] <= cpu_flags())


@pytest.fixture(params=cpu_gemm.ISAS)
def isa(request, ops):
    """Each path of the kernel; skipped where the CPU lacks it, a failure where the CPU has it and
    the kernel does not offer it."""
    name = request.param
    if not cpu_has(name):
        pytest.skip(f"this CPU lacks {name} ({' + '.join(sorted(ISA_FLAGS[name]))} not in /proc/cpuinfo)")
    assert name in cpu_gemm.available_isas(), f"the CPU has {name} but the kernel does not offer it"
    return name


_layers = {}


def layer(k, n, bias, backend="kernel"):
    """A quantized nn.Linear (cached: the LM head takes a moment) and its float reference weight."""
    key = (k, n, bias, backend)
    if key not in _layers:
        torch.manual_seed(k * 1000 + n)
        lin = nn.Linear(k, n, bias=bias)
        nn.init.normal_(lin.weight, std=0.05)
        if bias:
            nn.init.normal_(lin.bias, std=0.5)
        q = Int8WeightOnlyLinear(lin, backend=backend)
        w_ref = q.int8_weight().double() * q.scales.double()[:, None]  # what the int8 weight stands for
        b_ref = None if q.bias is None else q.bias.double()
        _layers[key] = q, w_ref, b_ref
    return _layers[key]


def reference(x, w_ref, b_ref):
    y = x.double() @ w_ref.T
    return y if b_ref is None else y + b_ref


def assert_matches(y, ref, rtol):
    """Elementwise |y - ref| <= rtol * (output scale), the scale being the largest |ref|."""
    scale = ref.abs().max().item() or 1.0
    err = (y.double() - ref).abs().max().item()
    assert err <= rtol * scale, f"max error {err:.3g} > {rtol} x {scale:.3g}"


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("k,n", MODEL_SHAPES + ODD_SHAPES, ids=lambda v: str(v))
def test_kernel_matches_float_reference(ops, k, n, bias):
    """The layer as models use it: the active path."""
    q, w_ref, b_ref = layer(k, n, bias)
    assert q.weight_packed is not None and q.weight is None  # the kernel's layout is in use
    for m in ROWS:
        x = torch.randn(m, k)
        y = q(x)
        assert y.shape == (m, n) and y.dtype == torch.float32
        assert_matches(y, reference(x, w_ref, b_ref), 1e-4)


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("k,n", MODEL_SHAPES + ODD_SHAPES, ids=lambda v: str(v))
def test_each_path_matches_float_reference(ops, isa, k, n, bias):
    q, w_ref, b_ref = layer(k, n, bias)
    for m in ALL_ROWS if k * n < 200_000 else ROWS:
        x = torch.randn(m, k)
        y = ops.linear_isa(x, q.weight_packed, q.scales, q.bias, isa)
        assert y.shape == (m, n) and y.dtype == torch.float32
        assert_matches(y, reference(x, w_ref, b_ref), 1e-4)


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("k,n", [(576, 960), (1536, 576), (40, 17), (33, 100), (67, 111)], ids=lambda v: str(v))
def test_each_path_bf16_activations(ops, isa, k, n, bias):
    q, w_ref, b_ref = layer(k, n, bias)
    for m in ROWS:
        x = torch.randn(m, k).to(torch.bfloat16)
        y = ops.linear_isa(x, q.weight_packed, q.scales, q.bias, isa)
        assert y.dtype == torch.bfloat16 and y.shape == (m, n)
        assert_matches(y, reference(x, w_ref, b_ref), 1e-2)  # fp32 math, the output rounded to bf16
        if isa == cpu_gemm.active_isa():
            assert torch.equal(q(x), y)


def test_available_paths_follow_the_cpu(ops):
    """The kernel finds at run time what the CPU has, whatever -march built it: every path the
    CPU's flags allow, best first (this machine's AVX2 included), and nothing else."""
    assert cpu_gemm.available_isas() == [i for i in cpu_gemm.ISAS if cpu_has(i)]
    assert cpu_gemm.active_isa() in cpu_gemm.available_isas()


def test_linear_runs_the_active_path(ops, restore_isa):
    """`linear` and `linear_f32` run exactly what select_isa chose (the paths sum in different
    orders, so their bits tell them apart)."""
    q, _, _ = layer(576, 960, True)
    packed = quant.PackedLinear(nn.Linear(576, 96))
    x = torch.randn(3, 576)
    outs = {}
    for isa in cpu_gemm.available_isas():
        assert cpu_gemm.select_isa(isa) == isa == cpu_gemm.active_isa() == ops.active_isa()
        outs[isa] = ops.linear_isa(x, q.weight_packed, q.scales, q.bias, isa)
        assert torch.equal(q(x), outs[isa])
        assert torch.equal(packed(x), ops.linear_f32_isa(x, packed.weight_packed, 96, packed.bias, isa))
    first = next(iter(outs.values()))
    assert len(outs) == 1 or any(not torch.equal(first, y) for y in outs.values()), \
        "every path gave the same bits: this test cannot tell which one ran"


def test_env_var_caps_the_path(ops, monkeypatch, restore_isa):
    best = cpu_gemm.available_isas()[0]
    for cap in cpu_gemm.ISAS:
        monkeypatch.setenv(cpu_gemm.ISA_ENV, cap)
        expected = next(i for i in cpu_gemm.ISAS[cpu_gemm.ISAS.index(cap):] if cpu_has(i))
        assert cpu_gemm.select_isa() == expected == cpu_gemm.active_isa() == cpu_gemm.kernel_summary()
    monkeypatch.setenv(cpu_gemm.ISA_ENV, "")
    assert cpu_gemm.select_isa() == best  # unset or empty: the best the CPU has
    # read when the kernel loads: a fresh load under SPECFLEET_CPU_ISA=portable runs portable
    monkeypatch.setenv(cpu_gemm.ISA_ENV, "portable")
    for attr, value in [("tried", False), ("ops", None), ("isa", None)]:
        monkeypatch.setattr(cpu_gemm._KernelState, attr, value)
    assert cpu_gemm.int8_kernel() is not None
    assert cpu_gemm.active_isa() == ops.active_isa() == "portable"


def test_env_var_bad_value_is_an_error(ops, monkeypatch, restore_isa):
    monkeypatch.setenv(cpu_gemm.ISA_ENV, "avx3")
    with pytest.raises(ValueError, match=f"{cpu_gemm.ISA_ENV}='avx3' is not a CPU kernel path"):
        cpu_gemm.select_isa()
    for attr, value in [("tried", False), ("ops", None), ("isa", None)]:
        monkeypatch.setattr(cpu_gemm._KernelState, attr, value)
    with pytest.raises(ValueError, match=cpu_gemm.ISA_ENV):  # not a silent fall back to torch
        Int8WeightOnlyLinear(nn.Linear(64, 48))


def test_named_path_errors(ops):
    q, _, _ = layer(40, 17, False)
    x = torch.randn(2, 40)
    with pytest.raises(RuntimeError, match="unknown CPU kernel path 'avx3'"):
        ops.linear_isa(x, q.weight_packed, q.scales, None, "avx3")
    lacking = [i for i in cpu_gemm.ISAS if i not in cpu_gemm.available_isas()]
    for isa in lacking:
        with pytest.raises(RuntimeError, match=f"cannot run the {isa} kernel path"):
            ops.linear_isa(x, q.weight_packed, q.scales, None, isa)
    with pytest.raises(ValueError, match="unknown CPU kernel path"):
        cpu_gemm.select_isa("avx3")


def test_kernel_edge_inputs(ops):
    q, w_ref, b_ref = layer(576, 960, True)
    x = torch.randn(2, 3, 576)  # leading dimensions
    assert_matches(q(x), reference(x.reshape(6, 576), w_ref, b_ref).reshape(2, 3, 960), 1e-4)
    xt = torch.randn(576, 5).t()  # a non-contiguous input
    assert_matches(q(xt), reference(xt, w_ref, b_ref), 1e-4)
    assert q(torch.randn(0, 576)).shape == (0, 960)
    with pytest.raises(RuntimeError):
        ops.linear(torch.randn(2, 575), q.weight_packed, q.scales, None)


def test_pack_roundtrip():
    for n, k in [(1, 1), (31, 7), (32, 64), (100, 33)]:
        w = torch.randint(-127, 128, (n, k), dtype=torch.int8)
        p = pack_int8_weight(w)
        assert p.shape == (-(-n // 32), k, 32)
        assert torch.equal(unpack_int8_weight(p, n), w)
        assert not p[-1, :, n - 32 * (p.shape[0] - 1):].any()  # the padding is zeros


@pytest.mark.parametrize("k,n", [(576, 960), (1536, 576), (40, 17), (33, 100)], ids=lambda v: str(v))
def test_torch_fallback_matches(ops, k, n):
    """backend="torch" (plain [N, K] weight, _weight_int8pack_mm) and a kernel layer forced onto
    torch's op (use_kernel = False) agree with the float reference within bf16 rounding."""
    q, w_ref, b_ref = layer(k, n, True)
    qt, _, _ = layer(k, n, True, backend="torch")
    assert qt.weight is not None and qt.weight_packed is None and not qt.use_kernel
    assert torch.equal(qt.weight, q.int8_weight())
    for m in (1, 5, 17):
        x = torch.randn(m, k)
        ref = reference(x, w_ref, b_ref)
        assert_matches(q(x), ref, 1e-4)
        assert_matches(qt(x), ref, 2e-2)
        assert_matches(qt(x.bfloat16()), ref, 2e-2)
        q.use_kernel = False
        try:
            assert_matches(q(x), ref, 2e-2)
        finally:
            q.use_kernel = True
    assert qt.bf16_scales() is qt.bf16_scales()  # converted once, not per call
    with pytest.raises(RuntimeError):
        qt.use_kernel = True


def test_env_var_disables_kernel_at_construction(monkeypatch):
    monkeypatch.setenv(cpu_gemm.KERNEL_ENV, "torch")
    monkeypatch.setattr(cpu_gemm._KernelState, "warned", False)
    with pytest.warns(RuntimeWarning, match="SPECFLEET_INT8_KERNEL=torch"):
        q = Int8WeightOnlyLinear(nn.Linear(64, 48))
    assert q.weight is not None and q.weight_packed is None
    x = torch.randn(3, 64)
    assert_matches(q(x), reference(x, q.weight.double() * q.scales.double()[:, None], q.bias.double()), 2e-2)


def test_build_failure_falls_back_with_one_warning(monkeypatch, tmp_path):
    for attr, value in [("tried", False), ("ops", None), ("error", None), ("warned", False)]:
        monkeypatch.setattr(cpu_gemm._KernelState, attr, value)
    monkeypatch.setenv("SPECFLEET_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.delenv(cpu_gemm.KERNEL_ENV, raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = quantize_int8(nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 16)))
        y = model(torch.randn(4, 64))
    assert y.shape == (4, 16) and torch.isfinite(y).all()
    assert [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)] == [
        f"int8 CPU kernel unavailable ({cpu_gemm._KernelState.error}); falling back to torch's ops "
        "(int8: torch._weight_int8pack_mm, fp32: MKL's GEMM)"]
    assert "no C++ compiler" in cpu_gemm._KernelState.error
    with pytest.raises(RuntimeError, match="unavailable"):
        Int8WeightOnlyLinear(nn.Linear(8, 8), backend="kernel")


def test_a_build_is_announced_as_a_json_line_in_a_worker_and_plainly_elsewhere(monkeypatch, tmp_path, capsys):
    import io
    import json
    import logging

    from specfleet_worker import logs

    def fake_compiler(cmd, **kw):  # writes the library it was asked for; no 30 s compile
        Path(cmd[cmd.index("-o") + 1]).write_bytes(b"")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(cpu_gemm.subprocess, "run", fake_compiler)
    logger = logging.getLogger("specfleet")
    saved = logger.handlers[:], logger.level, logger.propagate
    try:
        logger.handlers[:] = []
        cpu_gemm._build(tmp_path / "a" / "lib.so")
        assert "compiling the CPU kernels" in capsys.readouterr().err
        buf = io.StringIO()
        logs.configure(stream=buf)
        cpu_gemm._build(tmp_path / "b" / "lib.so")
        assert capsys.readouterr().err == ""
        [line] = buf.getvalue().splitlines()
        assert "compiling the CPU kernels" in json.loads(line)["msg"]
    finally:
        logger.handlers[:], logger.level, logger.propagate = saved
    assert (tmp_path / "a" / "lib.so").exists() and (tmp_path / "b" / "lib.so").exists()


def test_library_name_tracks_cpu_and_source(monkeypatch):
    path = cpu_gemm.kernel_library_path()
    monkeypatch.setattr(cpu_gemm, "_cpu_signature", lambda: "some other CPU")
    assert cpu_gemm.kernel_library_path() != path
    monkeypatch.undo()
    monkeypatch.setenv("CXX", "clang++")
    assert cpu_gemm.kernel_library_path() != path


def test_weight_bytes_counts_int8(ops):
    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok_embeddings = nn.Embedding(10, 64)
            self.wqkv = nn.Linear(64, 96, bias=True)
            self.output = nn.Linear(64, 128, bias=False)

    for backend in ("kernel", "torch"):
        m = quantize_int8(Tiny(), backend=backend)
        assert weight_bytes(m) == (96 * 64 + 96 * 4 + 96 * 4) + (128 * 64 + 128 * 4)


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("k,n", [(576, 960), (1536, 576), (576, 3072)] + ODD_SHAPES, ids=lambda v: str(v))
def test_fp32_packed_linear_matches_nn_linear(ops, isa, k, n, bias):
    """The same kernel over fp32 weights (PackedLinear, what prepare_model uses for fp32), each path."""
    torch.manual_seed(k + n)
    lin = nn.Linear(k, n, bias=bias)
    packed = quant.PackedLinear(lin)
    assert torch.equal(packed.weight(), lin.weight)
    w_ref = lin.weight.double()
    b_ref = None if lin.bias is None else lin.bias.double()
    for m in ALL_ROWS if k * n < 200_000 else ROWS:
        x = torch.randn(m, k)
        if isa == cpu_gemm.active_isa():
            assert_matches(packed(x), reference(x, w_ref, b_ref), 1e-5)
        y = ops.linear_f32_isa(x, packed.weight_packed, n, packed.bias, isa)
        assert_matches(y, reference(x, w_ref, b_ref), 1e-5)
        xb = x.bfloat16()
        yb = ops.linear_f32_isa(xb, packed.weight_packed, n, packed.bias, isa)
        assert yb.dtype == torch.bfloat16
        assert_matches(yb, reference(xb, w_ref, b_ref), 1e-2)


def test_fp32_kernel_rejects_mismatched_shapes(ops):
    packed = quant.PackedLinear(nn.Linear(64, 40))
    with pytest.raises(RuntimeError, match="features"):
        packed(torch.randn(2, 63))
    with pytest.raises(RuntimeError, match="do not match"):
        ops.linear_f32(torch.randn(2, 64), packed.weight_packed, 100, None)


@pytest.mark.slow
def test_paths_chosen_at_run_time_not_by_march(ops, tmp_path):
    """A library built for the oldest x86-64 (no AVX at all in its -march) still holds the AVX2
    and AVX-512 paths and picks what the CPU has when it runs: the dispatch does not hang on
    -march=native (compiles the kernel once more, ~40 s)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("x86-64 only: -march=x86-64 is not a target here")

    so = tmp_path / "generic.so"
    cmd = [("-march=x86-64" if a == "-march=native" else a) for a in cpu_gemm._build_command(cpu_gemm._SOURCES, so)]
    cmd.insert(1, "-DSF_NS=specfleet_int8_generic")  # its ops beside the native library's
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    torch.ops.load_library(str(so))
    generic = torch.ops.specfleet_int8_generic
    assert list(generic.cpu_isas()) == cpu_gemm.available_isas()
    assert generic.active_isa() == cpu_gemm.available_isas()[0]
    q, w_ref, b_ref = layer(67, 111, True)
    for isa in generic.cpu_isas():
        for m in (1, 2, 3, 5, 13):
            x = torch.randn(m, 67)
            assert_matches(generic.linear_isa(x, q.weight_packed, q.scales, q.bias, isa), reference(x, w_ref, b_ref), 1e-4)


def test_fp32_weights_are_packed_only_for_a_simd_path(ops, restore_isa):
    """The portable loops lose to torch's fp32 GEMM, so fp32 linears stay torch's there (int8
    weights keep the kernel); a SIMD path packs them."""
    from specfleet_engine.testing import tiny_model

    for isa in cpu_gemm.available_isas():
        cpu_gemm.select_isa(isa)
        model = tiny_model(seed=1)
        packed = quant.pack_linears(model)
        assert packed == (isa != "portable"), isa
        assert isinstance(model.output, quant.PackedLinear) == packed, isa
    cpu_gemm.select_isa("portable")
    model = tiny_model(seed=1)
    assert quant.pack_linears(model, force=True) and isinstance(model.output, quant.PackedLinear)
