"""Spec-Bench on one machine: tokens/s, speedup over plain decoding, tau and alpha by category.

Every configuration (dtype x quantization x method, and optionally HF transformers' own
`generate`) runs on the same question back to back before the next question starts, so that
the ratios compare runs made under the same machine load. Also measured in the same run: the
greedy agreement of each low-precision model with fp32 (teacher-forced on fp32's outputs),
the weight bytes streamed per second against the machine's memory bandwidth, and whether each
speculative output equals its plain twin token for token.

vLLM's CPU build runs as vllm/none and vllm/ngram (spec_bench_vllm: same prompt ids, greedy, max
tokens, threads and K): a server a configuration, started once (not timed) after our
configurations have run every question, so its ratios compare runs made at another time of the
run. Its greedy outputs are compared with fp32/none's token for token (equal, or where they first
differ).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from specfleet_api.engine_config import BUNDLED_EAGLE_HEAD
from specfleet_api.enums import (
    DTYPE_ALIASES, SERVED_DTYPES, SERVED_K_POLICIES, SERVED_QUANTIZATIONS, Method, Quantization,
)

from .questions import default_questions, load_questions
from .spec_bench_vllm import VllmConfig, require_venv

DEFAULT_CONFIGS = "fp32/none,fp32/ngram,bf16/none,bf16/ngram,int8/none,int8/ngram,hf/plain,hf/lookup"


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--questions", type=Path, default=None,
                   help="Spec-Bench question file (JSON lines: question_id, category, turns); "
                        "default ../shared/data/spec_bench/question.dev.jsonl")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--configs", default=DEFAULT_CONFIGS,
                   help="comma-separated PRECISION/METHOD[@KPOLICY]: precision fp32|bf16|int8, method "
                        "none|ngram|eagle|medusa (+ -tree for trees; eagle and medusa + +ngram for the n-gram's "
                        "chains mixed in), kPolicy " + "|".join(SERVED_K_POLICIES) +
                        " (default: adaptive; fp32/eagle@confidence,fp32/eagle@entropy compare them in one run); "
                        "hf/plain and hf/lookup run HF transformers' generate; vllm/none and vllm/ngram a vLLM "
                        "server (`./dev setup --vllm`; n-gram at -k, else the engine's default K) "
                        "(default: %(default)s)")
    p.add_argument("--per-category", type=int, default=0, help="questions per category (0: all)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("-k", type=int, default=None, help="fixed draft length (default: the engine's adaptive K)")
    p.add_argument("--tree-branching", type=int, default=4, help="children a node may have in METHOD-tree configs")
    p.add_argument("--corpus-tokens", type=int, default=CORPUS_TOKENS,
                   help="the n-gram corpus of METHOD-corpus configs: tokens of the earlier questions each such "
                        "config searches (its own: never another config's answer to the same question)")
    p.add_argument("--recycle", type=int, default=RECYCLE_TOP,
                   help="METHOD-recycle configs: how many of the target's top next tokens to keep and draft")
    p.add_argument("--draft-head", default=BUNDLED_EAGLE_HEAD,
                   help="the EAGLE head of eagle configs: a folder from `specfleet train-draft`, or a bundled "
                        "head's name (default %(default)s)")
    p.add_argument("--medusa-heads", default=None, metavar="FOLDER",
                   help="the Medusa heads of medusa configs (required by them): a folder from "
                        "`specfleet train-draft --method medusa` for --model")
    p.add_argument("--hf-lookup-tokens", type=int, default=10, help="prompt_lookup_num_tokens for hf/lookup")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", type=Path, default=Path("results/bench.json"), help="JSON results")
    p.add_argument("--plot", type=Path, default=Path("results/bench.png"), help="speedup plot (PNG)")


def memory_bandwidth_gbs(mb: int = 512, reps: int = 5) -> float:
    """Read + write bandwidth of a large tensor copy, as STREAM's copy counts it."""
    import torch

    src = torch.ones(mb * 2**20 // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() * 4 / best / 1e9


@dataclass
class Run:
    config: str
    category: str
    question_id: int
    tokens: int
    seconds: float
    steps: int
    drafted: int
    accepted: int
    output: list[int]
    ngram_accepted: int = 0  # mixed drafts: accepted tokens on the n-gram's chain (the rest: the head's)


#: PRECISION names of --configs: the served dtypes' short names, then the served quantizations
PRECISIONS = tuple(a for a, d in DTYPE_ALIASES.items() if d in SERVED_DTYPES) + tuple(
    q for q in SERVED_QUANTIZATIONS if q != Quantization.NONE)
#: METHOD names of --configs (no smaller model shares SmolLM2's tokenizer, so no draft model;
#: eagle drafts with the head at --draft-head, medusa with the heads at --medusa-heads); METHOD + TREE drafts trees (up to --tree-branching
#: children a node), the rest chains;
#: ngram + CORPUS (before any TREE) also searches the config's own earlier questions (--corpus-tokens);
#: ngram [+ CORPUS] + RECYCLE (before any TREE) also drafts the target's own top next tokens (--recycle);
#: eagle or medusa [+ TREE] + MIX mixes the n-gram's chains into the head's drafts (draft.ngram.mix)
METHODS = (Method.NONE.value, Method.NGRAM.value, Method.EAGLE.value, Method.MEDUSA.value)
TREE, CORPUS, RECYCLE, MIX = "-tree", "-corpus", "-recycle", "+ngram"
MIXED_HEADS = (Method.EAGLE.value, Method.MEDUSA.value)  # the METHODS that MIX takes
CORPUS_TOKENS = 16384  # --corpus-tokens' default (and step_breakdown's)
RECYCLE_TOP = 4  # --recycle's default: the target's top next tokens kept after each token
HF_METHODS = ("plain", "lookup")
#: vLLM's CPU build (spec_bench_vllm): plain decoding, and n-gram drafting at our n-gram's K
VLLM, VLLM_METHODS = "vllm", (Method.NONE.value, Method.NGRAM.value)
EXTERNAL = ("hf", VLLM)  # the PRECISIONs of other engines: no model of ours behind them
POLICY = "@"  # METHOD@KPOLICY: the configuration's K policy (speculation.kPolicy), else the engine's adaptive
BASELINE = (PRECISIONS[0], Method.NONE.value)  # fp32 plain decoding: every ratio is taken against it


def precision_parts(prec: str) -> tuple[str, str]:
    """(dtype, quantization) of a --configs precision: a dtype's short name, or a quantization
    of fp32 weights."""
    if prec in SERVED_QUANTIZATIONS:
        return PRECISIONS[0], prec
    return prec, Quantization.NONE.value


def parse_configs(spec: str) -> list[tuple[str, str]]:
    """(precision, method) of each --configs item, fp32/none first.

    >>> parse_configs("fp32/eagle-tree+ngram,int8/ngram-corpus-tree")
    [('fp32', 'none'), ('fp32', 'eagle-tree+ngram'), ('int8', 'ngram-corpus-tree')]
    >>> parse_configs("vllm/none,vllm/ngram")
    [('fp32', 'none'), ('vllm', 'none'), ('vllm', 'ngram')]
    """
    out = []
    for item in spec.split(","):
        prec, _, named = item.strip().partition("/")
        method, at, policy = named.partition(POLICY)
        if at and (policy not in SERVED_K_POLICIES or method == Method.NONE.value or prec in EXTERNAL):
            raise ValueError(f"--configs: {item!r}: @KPOLICY must be one of {', '.join(SERVED_K_POLICIES)}, "
                             "after a speculative method of the engine")
        mixed = method.endswith(MIX)
        chain = method.removesuffix(MIX).removesuffix(TREE)
        base = chain.removesuffix(RECYCLE).removesuffix(CORPUS)
        ok = (prec in PRECISIONS and base in METHODS and (base != Method.NONE.value or base == method)
              and (chain == base or base == Method.NGRAM.value) and (not mixed or base in MIXED_HEADS)) or (
            prec == "hf" and method in HF_METHODS) or (prec == VLLM and method in VLLM_METHODS)
        if not ok:
            raise ValueError(f"--configs: {item!r} is not PRECISION/METHOD ({'|'.join(PRECISIONS)} / "
                             f"{'|'.join(METHODS)}[{CORPUS}][{RECYCLE}][{TREE}], {'|'.join(MIXED_HEADS)}[{TREE}]{MIX}, "
                             f"each [{POLICY}KPOLICY], hf/{'|hf/'.join(HF_METHODS)}, "
                             f"or {VLLM}/{f'|{VLLM}/'.join(VLLM_METHODS)})")
        out.append((prec, named))
    if BASELINE not in out:
        out.insert(0, BASELINE)
    return out


class Runner:
    """Holds one model per precision and runs a question under a configuration."""

    def __init__(self, model_name: str, precisions: set[str], want_hf: bool, max_tokens: int, k: int | None,
                 tree_branching: int = 4, corpus_tokens: int = CORPUS_TOKENS, recycle: int = RECYCLE_TOP,
                 draft_head: str = BUNDLED_EAGLE_HEAD, medusa_heads: str | None = None):
        import torch

        from specfleet_engine.engine import Engine
        from specfleet_engine.factory import prepare_model
        from specfleet_engine.loader import load_tokenizer

        self.tokenizer = load_tokenizer(model_name)
        self.max_tokens, self.k, self.tree_branching, self.corpus_tokens = max_tokens, k, tree_branching, corpus_tokens
        self.recycle, self.draft_head, self.medusa_heads = recycle, draft_head, medusa_heads
        self.proposers: dict[tuple[str, str], object] = {}  # (precision, method): its own n-gram proposer
        self.policies: dict[tuple[str, str], object] = {}  # (precision, kPolicy): its own state, the engine's costs
        self.engines = {}
        for prec in sorted(precisions):
            dtype, quant = precision_parts(prec)
            self.engines[prec] = Engine(prepare_model(model_name, dtype, quant), self.tokenizer, max_kv_tokens=8192)
            self.engines[prec].calibrate()
        self.hf = None
        if want_hf:
            from transformers import AutoModelForCausalLM

            from specfleet_engine.loader import resolve_model_path

            p = resolve_model_path(model_name)
            kw = dict(gguf_file=p.name) if p.suffix == ".gguf" else {}
            self.hf = AutoModelForCausalLM.from_pretrained(str(p.parent if p.suffix == ".gguf" else p),
                                                           dtype=torch.float32, local_files_only=True, **kw).eval()

    def k_of(self, prec: str) -> int:
        """The K a speculative configuration of `prec` drafts: -k, else the engine's default (the
        bound its K policy moves K under); vllm/ngram drafts the fp32 engine's."""
        return self.k if self.k is not None else self.engines[prec].default_k

    def run(self, prec: str, method: str, prompt: list[int],
            hf_lookup: int) -> tuple[list[int], float, int, int, int, int]:
        import torch

        from specfleet_engine.sampling import SamplingParams

        if prec == "hf":
            ids = torch.tensor([prompt])
            kw = dict(prompt_lookup_num_tokens=hf_lookup) if method == "lookup" else {}
            t = time.perf_counter()
            with torch.inference_mode():
                out = self.hf.generate(ids, max_new_tokens=self.max_tokens, do_sample=False,
                                       eos_token_id=self.tokenizer.eos_token_ids, pad_token_id=self.tokenizer.eos_token_ids[0], **kw)
            dt = time.perf_counter() - t
            toks = out[0, len(prompt):].tolist()
            while toks and toks[-1] in self.tokenizer.eos_token_ids:
                toks.pop()  # our engine does not count the EOS token either
            return toks, dt, len(toks), 0, 0, 0
        from specfleet_engine.k_policies import make_policy
        from specfleet_engine.proposers import MixedProposer, NgramProposer

        config = method  # its own n-gram proposer (a corpus never holds another config's answers)
        method, _, policy = method.partition(POLICY)
        engine = self.engines[prec]
        if policy and (prec, policy) not in self.policies:
            self.policies[prec, policy] = make_policy(policy, engine.costs)
        default_policy = engine.k_policy
        mixed, method = method.endswith(MIX), method.removesuffix(MIX)
        engine.tree_branching = self.tree_branching if method.endswith(TREE) else 1
        if method.removesuffix(TREE) == Method.EAGLE and Method.EAGLE.value not in engine.proposers:
            from specfleet_engine.factory import eagle_proposer

            engine.proposers[Method.EAGLE.value] = eagle_proposer(self.draft_head, engine.model)
        if method.removesuffix(TREE) == Method.MEDUSA and Method.MEDUSA.value not in engine.proposers:
            from specfleet_engine.factory import medusa_proposer

            engine.proposers[Method.MEDUSA.value] = medusa_proposer(self.medusa_heads, engine.model)
        recycle = method.removesuffix(TREE).endswith(RECYCLE)
        corpus = method.removesuffix(TREE).removesuffix(RECYCLE).endswith(CORPUS)
        if (prec, config) not in self.proposers:  # a mixed config's: the n-gram side of its mix
            self.proposers[prec, config] = NgramProposer(corpus_tokens=self.corpus_tokens if corpus else 0,
                                                         recycle=self.recycle if recycle else 0)
        engine.proposers[Method.NGRAM.value] = self.proposers[prec, config]
        method = method.removesuffix(TREE).removesuffix(RECYCLE).removesuffix(CORPUS)
        if mixed:  # the head's proposer (its state is per sequence) and this config's n-gram one
            engine.proposers[method + MIX] = MixedProposer(self.proposers[prec, config], engine.proposers[method])
            method += MIX
        params = SamplingParams(max_tokens=self.max_tokens)
        k = self.k_of(prec)
        # -k: that many drafts every step (the K policy may not move it); else the policy's K
        bounds = dict(k_min=k, k_max=k) if self.k is not None and method != "none" else {}
        engine.k_policy = self.policies[prec, policy] if policy else default_policy
        try:
            t = time.perf_counter()
            seq = engine.generate(prompt, params, method, k if method != "none" else 0, **bounds)
            dt = time.perf_counter() - t
        finally:
            engine.k_policy = default_policy
        s = seq.stats
        return seq.output, dt, s.num_steps + 1, s.num_draft_tokens, s.num_accepted_tokens, s.num_ngram_accepted


def teacher_forced_agreement(engine_lp, prompt: list[int], output: list[int]) -> tuple[int, int]:
    """How many of fp32's greedy tokens the other model also ranks first, given fp32's prefix."""
    import torch

    if not output:
        return 0, 0
    from specfleet_engine.sampling import SamplingParams

    ctx = prompt + output[:-1]
    seq = engine_lp.add(ctx, SamplingParams(max_tokens=1), "none")
    logits = engine_lp._forward([seq], [ctx], "all")[len(prompt) - 1:]  # row i predicts output[i]
    engine_lp.abort(seq)
    return int((logits.argmax(-1) == torch.tensor(output)).sum()), len(output)


def agreement_with_baseline(runs: list[Run], name: str) -> dict:
    """How `name`'s greedy outputs compare with fp32/none's on the questions both ran: how many
    are equal token for token, and for each other question the first position where they differ
    (a shorter output differs where it ends).

    >>> runs = [Run(c, "qa", q, 3, 1.0, 3, 0, 0, out) for c, q, out in [("fp32/none", 1, [5, 6, 7]),
    ...     ("vllm/none", 1, [5, 6, 7]), ("fp32/none", 2, [5, 6, 7]), ("vllm/none", 2, [5, 9, 7]),
    ...     ("fp32/none", 3, [5, 6, 7]), ("vllm/none", 3, [5, 6])]]
    >>> agreement_with_baseline(runs, "vllm/none")
    {'equal': 1, 'questions': 3, 'first_difference': {2: 1, 3: 2}}
    """
    from specfleet_router.drift import first_difference

    base = {r.question_id: r.output for r in runs if r.config == "/".join(BASELINE)}
    differ = {}
    theirs = [r for r in runs if r.config == name and r.question_id in base]
    for r in theirs:
        at = first_difference(base[r.question_id], r.output)
        if at is not None:
            differ[r.question_id] = at
    return {"equal": len(theirs) - len(differ), "questions": len(theirs), "first_difference": differ}


def summarize(runs: list[Run], configs: list[tuple[str, str]]) -> dict:
    names = [f"{p}/{m}" for p, m in configs]
    cats = sorted({r.category for r in runs})
    table = {}
    for cat in cats + ["overall"]:
        rows = {}
        sel = [r for r in runs if cat == "overall" or r.category == cat]
        base = [r for r in sel if r.config == "fp32/none"]
        base_tps = sum(r.tokens for r in base) / max(sum(r.seconds for r in base), 1e-9)
        for name in names:
            rs = [r for r in sel if r.config == name]
            tokens, secs = sum(r.tokens for r in rs), sum(r.seconds for r in rs)
            prec = name.split("/")[0]
            same = [r for r in sel if r.config == f"{prec}/none"]
            same_tps = sum(r.tokens for r in same) / max(sum(r.seconds for r in same), 1e-9) if same else None
            tps = tokens / max(secs, 1e-9)
            drafted, accepted, steps = sum(r.drafted for r in rs), sum(r.accepted for r in rs), sum(r.steps for r in rs)
            rows[name] = {
                "tokens": tokens, "seconds": round(secs, 3), "tok_s": round(tps, 2),
                "speedup_vs_fp32_plain": round(tps / base_tps, 3),
                "speedup_vs_same_precision_plain": round(tps / same_tps, 3) if same_tps else None,
                "tau": round(tokens / steps, 3) if steps else None,
                "alpha": round(accepted / drafted, 3) if drafted else None,
            }
            if name.endswith(MIX):  # how much of what was accepted the n-gram's chains drafted
                ngram = sum(r.ngram_accepted for r in rs)
                rows[name]["ngram_share"] = round(ngram / accepted, 3) if accepted else None
            if prec == VLLM:  # another engine: its greedy outputs against ours
                agree = agreement_with_baseline(sel, name)
                rows[name]["equal_to_fp32_plain"], rows[name]["questions"] = agree["equal"], agree["questions"]
        table[cat] = rows
    return table


def tree_vs_chain(table: dict, configs: list[tuple[str, str]]) -> dict:
    """Per precision with both METHOD and METHOD-tree: the tree's speedup over the chain and tau."""
    out = {}
    for prec, method in configs:
        chain = f"{prec}/{method.removesuffix(TREE)}"
        if not method.endswith(TREE) or (prec, method.removesuffix(TREE)) not in configs:
            continue
        tree = f"{prec}/{method}"
        cats = [c for c in table if c != "overall"]
        up = [c for c in cats if (table[c][tree]["tau"] or 0) > (table[c][chain]["tau"] or 0)]
        o = table["overall"]
        out[prec] = {"speedup_tree_vs_chain": round(o[tree]["tok_s"] / o[chain]["tok_s"], 3),
                     "tau_chain": o[chain]["tau"], "tau_tree": o[tree]["tau"], "categories": len(cats),
                     "categories_tau_up": len(up), "categories_tau_not_up": sorted(set(cats) - set(up))}
    return out


def method_per_type(runs: list[Run], configs: list[tuple[str, str]]) -> dict:
    """Per precision with two or more configurations: what routing each category to its fastest
    one (a table chosen with hindsight) would give over the best single configuration, on a
    workload with each category's tokens. It bounds what choosing the draft method per prompt
    type can win on this model and machine at this load.

    >>> runs = [Run(c, cat, 0, 100, t, 0, 0, 0, []) for c, cat, t in [
    ...     ("fp32/none", "a", 1.0), ("fp32/ngram", "a", 2.0), ("fp32/none", "b", 3.0), ("fp32/ngram", "b", 1.0)]]
    >>> method_per_type(runs, [("fp32", "none"), ("fp32", "ngram")])["fp32"]
    {'best_single': 'fp32/ngram', 'per_type_over_best_single': 1.5, 'picks': {'a': 'fp32/none', 'b': 'fp32/ngram'}}
    """
    out = {}
    cats = sorted({r.category for r in runs})
    for prec in dict.fromkeys(p for p, _ in configs if p not in EXTERNAL):
        names = [f"{p}/{m}" for p, m in configs if p == prec]
        if len(names) < 2:
            continue
        per_token = {}  # seconds per token, per (config, category)
        for n in names:
            for c in cats:
                rs = [r for r in runs if r.config == n and r.category == c]
                per_token[n, c] = sum(r.seconds for r in rs) / max(sum(r.tokens for r in rs), 1)
        weight = {c: sum(r.tokens for r in runs if r.config == names[0] and r.category == c) for c in cats}
        single = {n: sum(weight[c] * per_token[n, c] for c in cats) for n in names}
        best = min(names, key=single.get)
        picks = {c: min(names, key=lambda n: per_token[n, c]) for c in cats}
        routed = sum(weight[c] * per_token[picks[c], c] for c in cats)
        out[prec] = {"best_single": best, "per_type_over_best_single": round(single[best] / max(routed, 1e-12), 3),
                     "picks": picks}
    return out


def print_table(table: dict, configs: list[tuple[str, str]], console) -> None:
    from rich.table import Table

    names = [f"{p}/{m}" for p, m in configs]
    t = Table(title="Spec-Bench: tok/s (speedup over fp32 plain; tau; alpha; mixed: share of accepted tokens "
                    "the n-gram drafted; vLLM: questions whose output equals fp32 plain's)")
    t.add_column("category")
    for n in names:
        t.add_column(n, justify="right")
    for cat, rows in table.items():
        cells = []
        for n in names:
            r = rows[n]
            extra = f" τ{r['tau']:.2f} α{r['alpha']:.2f}" if r["alpha"] is not None else ""
            extra += f" ng{r['ngram_share']:.0%}" if r.get("ngram_share") is not None else ""
            extra += f" ={r['equal_to_fp32_plain']}/{r['questions']}" if "questions" in r else ""
            cells.append(f"{r['tok_s']:.1f} ({r['speedup_vs_fp32_plain']:.2f}x){extra}")
        t.add_row(cat, *cells, end_section=cat == list(table)[-2])
    console.print(t)


def markdown_table(table: dict, configs: list[str]) -> str:
    """The same table as Markdown: tok/s (speedup over fp32 plain; tau, alpha; vLLM: =equal/questions)
    per cell."""
    lines = ["| category | " + " | ".join(configs) + " |", "|---" * (len(configs) + 1) + "|"]
    for cat, rows in table.items():
        cells = []
        for n in configs:
            r = rows[n]
            cell = f"{r['tok_s']:.1f} ({r['speedup_vs_fp32_plain']:.2f}x)"
            if r["alpha"] is not None:
                cell += f" τ{r['tau']:.2f} α{r['alpha']:.2f}"
            if r.get("ngram_share") is not None:
                cell += f" ng{r['ngram_share']:.0%}"
            if "questions" in r:
                cell += f" ={r['equal_to_fp32_plain']}/{r['questions']}"
            cells.append(cell)
        name = f"**{cat}**" if cat == "overall" else cat
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(table: dict, configs: list[tuple[str, str]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [f"{p}/{m}" for p, m in configs if f"{p}/{m}" != "fp32/none"]
    cats = list(table)
    fig, ax = plt.subplots(figsize=(max(8, len(cats) * 0.9), 4.5))
    width = 0.8 / max(len(names), 1)
    for i, n in enumerate(names):
        ax.bar([c + i * width for c in range(len(cats))], [table[c][n]["speedup_vs_fp32_plain"] for c in cats],
               width, label=n)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks([c + 0.4 - width / 2 for c in range(len(cats))], cats, rotation=35, ha="right")
    ax.set_ylabel("speedup over fp32 plain decoding")
    ax.set_title("SmolLM2-135M-Instruct on the CPU, Spec-Bench dev, greedy")
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def run_vllm_configs(args, runner: Runner, configs: list[tuple[str, str]], questions: list[dict],
                     prompts: list[list[int]], warm: list[int], console) -> tuple[list[Run], dict]:
    """Each vllm/METHOD configuration on every question, after ours: its server started on the
    model's export (the start not timed, its seconds printed), one warm-up request, the questions
    one at a time on the prompt ids ours decoded, the server stopped. Its runs, and per
    configuration what the results keep of its server and of the seconds the answers report."""
    import torch

    with console.status(f"{args.model} as a HF folder for vLLM"):
        from specfleet_local.hf_model import cached_export

        model_dir = cached_export(args.model, progress=console.print)
    runs: list[Run] = []
    info = {}
    for prec, method in configs:
        name = f"{prec}/{method}"
        log = args.out.with_name(f"{args.out.stem}.{prec}-{method}.log")
        vc = VllmConfig(model_dir, method, runner.k_of(BASELINE[0]), torch.get_num_threads(),
                        runner.tokenizer.eos_token_ids, args.max_tokens, args.model, log)
        console.print(f"{name}: starting vLLM on {model_dir}, cores {vc.cpus}"
                      f"{f', n-gram K {vc.k}' if vc.speculating else ''}; log {log}")
        ready = vc.start(progress=console.print)
        try:
            console.print(f"{name}: vLLM ready after {ready:.0f} s (not timed)")
            vc.run(warm)  # the first request pays one-off costs
            vc.server_seconds = 0.0
            for q, prompt in zip(questions, prompts):
                out, dt, steps, drafted, accepted, ngram = vc.run(prompt)
                runs.append(Run(name, q["category"], q["question_id"], len(out), dt, steps, drafted, accepted, out,
                                ngram))
                console.print(f"{name} q{q['question_id']} {q['category']}: {len(out)} tokens in {dt:.2f} s "
                              f"({len(out) / max(dt, 1e-9):.1f} tok/s)", soft_wrap=True)
        finally:
            vc.stop()
        client_s = sum(r.seconds for r in runs if r.config == name)
        info[name] = vc.summary() | {"client_seconds": round(client_s, 3), "server_seconds": round(vc.server_seconds, 3)}
    return runs, info


def run_bench(args) -> int:
    import torch

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console() if Console().is_terminal else Console(width=240)
    if args.threads:
        torch.set_num_threads(args.threads)
    configs = parse_configs(args.configs)
    if any(m.removesuffix(MIX).removesuffix(TREE) == Method.MEDUSA for _, m in configs) and not getattr(args, "medusa_heads", None):
        raise ValueError("--configs: medusa configs need --medusa-heads FOLDER (`specfleet train-draft --method "
                         "medusa` makes one for --model)")
    vllm_configs = [(p, m) for p, m in configs if p == VLLM]
    ours = [(p, m) for p, m in configs if p != VLLM]
    if vllm_configs:
        require_venv()  # before any model loads: a missing venv names its set-up step
    questions = load_questions(args.questions or default_questions(), args.per_category)
    precisions = {p for p, _ in configs if p not in EXTERNAL}
    console.print(f"[bold]specfleet bench[/]: {len(questions)} questions, configs {', '.join(f'{p}/{m}' for p, m in configs)}, "
                  f"max {args.max_tokens} new tokens, greedy, {torch.get_num_threads()} threads")
    with console.status("loading models"):
        runner = Runner(args.model, precisions, any(p == "hf" for p, _ in configs), args.max_tokens, args.k,
                        getattr(args, "tree_branching", 4), getattr(args, "corpus_tokens", CORPUS_TOKENS),
                        getattr(args, "recycle", RECYCLE_TOP), getattr(args, "draft_head", BUNDLED_EAGLE_HEAD),
                        getattr(args, "medusa_heads", None))
        bandwidth = memory_bandwidth_gbs()
    from specfleet_engine.kernels import cpu_gemm

    cpu_kernel = {"path": cpu_gemm.kernel_summary(), "cpu_runs": cpu_gemm.available_isas()}
    console.print(f"cpu kernel: {cpu_kernel['path']} (this CPU runs: {', '.join(cpu_kernel['cpu_runs']) or 'none'})")
    # warm-up: first calls pay for allocation and kernel selection
    warm = runner.tokenizer.chat("Say hello.")
    for prec, method in ours:
        runner.run(prec, method, warm, args.hf_lookup_tokens)
    prompts = [runner.tokenizer.chat(q["turns"][0]) for q in questions]

    runs: list[Run] = []
    agreement = defaultdict(lambda: [0, 0])
    mismatches = defaultdict(int)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        task = progress.add_task("questions", total=len(questions))
        for q, prompt in zip(questions, prompts):
            outputs = {}
            for prec, method in ours:
                progress.update(task, description=f"q{q['question_id']} {q['category']}: {prec}/{method}")
                out, dt, steps, drafted, accepted, ngram = runner.run(prec, method, prompt, args.hf_lookup_tokens)
                outputs[(prec, method)] = out
                runs.append(Run(f"{prec}/{method}", q["category"], q["question_id"], len(out), dt, steps,
                                drafted, accepted, out, ngram))
            for prec, method in ours:
                if method != "none" and (prec, "none") in outputs and outputs[(prec, method)] != outputs[(prec, "none")]:
                    mismatches[f"{prec}/{method}"] += 1
            for prec in precisions - {BASELINE[0]}:
                a, n = teacher_forced_agreement(runner.engines[prec], prompt, outputs[BASELINE])
                agreement[prec][0] += a
                agreement[prec][1] += n
            progress.advance(task)
            if not console.is_terminal:  # a log file gets a line per question instead of a bar
                done = {n: sum(r.tokens for r in runs if r.config == n) / max(sum(r.seconds for r in runs if r.config == n), 1e-9)
                        for n in (f"{p}/{m}" for p, m in ours)}
                console.print(f"[{len({r.question_id for r in runs})}/{len(questions)}] q{q['question_id']} {q['category']}: "
                              + ", ".join(f"{n} {v:.1f} tok/s" for n, v in done.items()), soft_wrap=True)

    vllm = {}
    if vllm_configs:
        vllm_runs, vllm = run_vllm_configs(args, runner, vllm_configs, questions, prompts, warm, console)
        runs += vllm_runs
        plain = {r.question_id: r.output for r in vllm_runs if r.config == f"{VLLM}/{Method.NONE.value}"}
        for r in vllm_runs:
            if r.question_id in plain and r.output != plain[r.question_id]:
                mismatches[r.config] += 1

    table = summarize(runs, configs)
    print_table(table, configs, console)
    from specfleet_engine.quant import weight_bytes

    roofline = {}
    for prec in sorted(precisions):
        row = table["overall"][f"{prec}/none"] if f"{prec}/none" in table["overall"] else None
        if row:
            wb = weight_bytes(runner.engines[prec].model)
            gbs = wb * row["tok_s"] / 1e9  # plain decoding: one weight pass per token
            roofline[prec] = {"weight_bytes": wb, "streamed_gb_s": round(gbs, 2),
                              "fraction_of_bandwidth": round(gbs / bandwidth, 3)}
            console.print(f"{prec}: {wb / 1e6:.0f} MB of weights per step, {gbs:.1f} GB/s streamed in plain decoding, "
                          f"{gbs / bandwidth:.0%} of the measured {bandwidth:.1f} GB/s copy bandwidth")
    quality = {p: round(a / n, 4) for p, (a, n) in agreement.items() if n}
    for p, v in quality.items():
        console.print(f"{p}: greedy agreement with fp32 (teacher-forced) {v:.4f} over {agreement[p][1]} tokens")
    spec_configs = [f"{p}/{m}" for p, m in configs if p != "hf" and m != "none" and (p, "none") in configs]
    for name in spec_configs:
        console.print(f"{name}: speculative output == plain output on "
                      f"{len(questions) - mismatches[name]}/{len(questions)} questions")
    for name in vllm:
        vllm[name]["agreement_with_fp32_plain"] = agree = agreement_with_baseline(runs, name)
        differ = ", ".join(f"q{q} at token {i}" for q, i in agree["first_difference"].items())
        console.print(f"{name}: output token ids == fp32/none's on {agree['equal']}/{agree['questions']} questions"
                      f"{'; the others first differ: ' + differ if differ else ''}; vLLM ready after "
                      f"{vllm[name]['ready_after_s']:.0f} s; its answers' own seconds {vllm[name]['server_seconds']:.2f} "
                      f"of {vllm[name]['client_seconds']:.2f} s timed here", soft_wrap=True)
    trees = tree_vs_chain(table, configs)
    for prec, t in trees.items():
        console.print(f"{prec}: trees vs chains {t['speedup_tree_vs_chain']:.3f}x overall (tau {t['tau_chain']:.2f} -> "
                      f"{t['tau_tree']:.2f}); tau higher with trees in {t['categories_tau_up']}/{t['categories']} categories")
    per_type = method_per_type(runs, configs)
    for prec, m in per_type.items():
        moved = ", ".join(f"{c}: {n.split('/', 1)[1]}" for c, n in m["picks"].items() if n != m["best_single"])
        console.print(f"{prec}: each category on its fastest configuration would be {m['per_type_over_best_single']:.3f}x "
                      f"the best single one ({m['best_single']}){'; it picks ' + moved if moved else ''}")
    result = {
        "questions": len(questions), "max_tokens": args.max_tokens, "threads": torch.get_num_threads(),
        "cpu_kernel": cpu_kernel,
        "configs": [f"{p}/{m}" for p, m in configs], "table": table, "quality_agreement_vs_fp32": quality,
        "roofline": roofline, "memory_bandwidth_gb_s": round(bandwidth, 2),
        "spec_equals_plain": {n: len(questions) - mismatches[n] for n in spec_configs},
        "trees_vs_chains": trees, "method_per_type": per_type, "vllm": vllm,
        "runs": [r.__dict__ | {"output": None} for r in runs],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    args.out.with_suffix(".md").write_text(markdown_table(table, result["configs"]) + "\n")
    plot(table, configs, args.plot)
    console.print(f"wrote {args.out} and {args.plot}")
    return 0


def run_demo(per_category: int, max_tokens: int) -> int:
    """The main job on the embedded default: a short Spec-Bench run of the main configurations."""
    ns = argparse.Namespace(questions=None, model="smollm2-135m", configs="fp32/none,fp32/ngram,int8/none,int8/ngram",
                            per_category=per_category, max_tokens=max_tokens, k=None, hf_lookup_tokens=10,
                            threads=None, out=Path("results/demo.json"), plot=Path("results/demo.png"))
    return run_bench(ns)
