"""The `specfleet` command line: one entry point with a subcommand per job.

A thin dispatcher: the engine, the benchmarks and the operator are imported only by the
subcommand that needs them, so `--help` is instant and never loads torch (a test holds it to that);
the choices it offers come from specfleet_api.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specfleet_api import limits
from specfleet_api.engine_config import BUNDLED_EAGLE_HEAD, MIX_METHODS
from specfleet_api.enums import DTYPE_CHOICES, SERVED_METHODS, SERVED_QUANTIZATIONS, Method

DESCRIPTION = """\
specfleet: lossless speculative decoding, managed as a self-correcting fleet.

Run `specfleet up -f deploy/examples/local.yaml --demo` for the local default (what ./dev run does):
the fleet on this machine, a short Spec-Bench workload through its OpenAI API.
"""


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m",
                   help="a .gguf file, a Hugging Face checkpoint folder (safetensors), or smollm2-135m (default)")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="fp32", help="activation and weight dtype")
    p.add_argument("--quantization", choices=SERVED_QUANTIZATIONS, default="none",
                   help="int8: weight-only int8 with per-channel scales")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: all cores)")


def main(argv: list[str] | None = None, prog: str = "specfleet") -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # serve, operator, router, up, status and canary own their flags: hand everything after the
    # subcommand straight over
    if argv and argv[0] == "canary":
        from .canary import main as canary_main

        return canary_main(argv[1:], prog=f"{prog} canary")
    if argv and argv[0] == "serve":
        from specfleet_worker.main import main as serve_main

        return serve_main(argv[1:])
    if argv and argv[0] == "operator":
        from specfleet_operator.main import run as operator_main

        return operator_main(argv[1:])
    if argv and argv[0] == "router":
        from specfleet_router.main import main as router_main

        return router_main(argv[1:])
    if argv and argv[0] == "up":
        from specfleet_local.up import main as up_main

        return up_main(argv[1:])
    if argv and argv[0] == "status":
        from specfleet_local.status import main as status_main

        return status_main(argv[1:])
    if argv and argv[0] == "bench":
        return _bench(argv[1:])
    if argv and argv[0] == "train-draft":
        from specfleet_engine.draft_training import main as train_draft_main

        return train_draft_main(argv[1:])
    parser = argparse.ArgumentParser(prog=prog, description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("demo", help="the main job on the embedded default: a short benchmark on SmolLM2-135M")
    p.add_argument("--per-category", type=int, default=1, help="questions per Spec-Bench category (default 1)")
    p.add_argument("--max-tokens", type=int, default=128)

    p = sub.add_parser("generate", help="generate text for one prompt, with or without speculation")
    _add_engine_args(p)
    p.add_argument("prompt", help="the user message (the chat template is applied)")
    p.add_argument("--method", choices=SERVED_METHODS, default=Method.NGRAM.value)
    p.add_argument("--draft-model", default=None, help="draft model for --method draft-model")
    p.add_argument("--draft-head", default=BUNDLED_EAGLE_HEAD,
                   help="the EAGLE head for --method eagle: a folder from `specfleet train-draft`, or a bundled "
                        "head's name (default %(default)s, for smollm2-135m)")
    p.add_argument("--medusa-heads", default=None, metavar="FOLDER",
                   help="the Medusa heads for --method medusa (required with it): a folder from "
                        "`specfleet train-draft --method medusa` for --model")
    p.add_argument("--ngram-mix", action="store_true",
                   help="with a head or a draft model (--method " + ", ".join(MIX_METHODS)
                        + "): the n-gram chain as the tree's first branch, one forward (draft.ngram.mix)")
    p.add_argument("-k", type=int, default=4, help="draft tokens per step")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=limits.WIRE_DEFAULT_TEMPERATURE,
                   help="0: greedy (the gRPC API's default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)

    p = sub.add_parser("export-hf", help="write a model as a Hugging Face folder (config.json, tokenizer, "
                                         "float32 safetensors) that vLLM and HF transformers load")
    p.add_argument("--model", default="smollm2-135m",
                   help="a .gguf file, a Hugging Face checkpoint folder (safetensors), or smollm2-135m (default)")
    p.add_argument("--out", required=True, metavar="DIR", help="the folder to write (empty or absent)")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier export in --out")

    sub.add_parser("bench", help="Spec-Bench: tokens/s, speedup, tau and alpha by category; "
                                 "`specfleet bench --help` lists its flags", add_help=False)
    sub.add_parser("train-draft", help="train an EAGLE draft head or Medusa heads for a target model "
                                       "(self-distillation, features, training, evaluation); "
                                       "`specfleet train-draft --help`", add_help=False)
    sub.add_parser("serve", help="run the gRPC worker; `specfleet serve --help` lists its flags", add_help=False)
    sub.add_parser("operator", help="run the Kubernetes operator; `specfleet operator --help` lists its flags",
                   add_help=False)
    sub.add_parser("router", help="run the OpenAI-compatible router in front of the workers; "
                                  "`specfleet router --help` lists its flags", add_help=False)
    sub.add_parser("up", help="run one SpecDecodeDeployment's fleet on this machine (Redis, workers, router); "
                              "`specfleet up --help` lists its flags", add_help=False)
    sub.add_parser("status", help="the fleet `specfleet up` runs, as `kubectl get sdd -o wide` shows it; "
                                  "`specfleet status --help` lists its flags", add_help=False)
    sub.add_parser("canary", help="pause, resume, promote or abort a SpecDecodeDeployment's canary "
                                  "(also `kubectl specfleet canary ...`); `specfleet canary --help`", add_help=False)

    args = parser.parse_args(argv)
    try:
        if args.command is None:
            parser.print_help()
            return 0
        if args.command == "demo":
            from specfleet_bench.spec_bench import run_demo

            return run_demo(args.per_category, args.max_tokens)
        if args.command == "generate":
            if args.method == Method.MEDUSA and not args.medusa_heads:
                parser.error("--method medusa needs --medusa-heads FOLDER (`specfleet train-draft --method medusa` "
                             "makes one for your model)")
            if args.ngram_mix and args.method not in MIX_METHODS:
                parser.error(f"--ngram-mix mixes the n-gram chain into a head's or a draft model's tree: --method "
                             f"{args.method} has none (use one of {', '.join(MIX_METHODS)})")
            if args.method == Method.MEDUSA and not Path(args.medusa_heads).is_dir():  # before loading the model
                raise FileNotFoundError(f"--medusa-heads {args.medusa_heads}: no such folder (Medusa heads are a "
                                        "folder from `specfleet train-draft --method medusa`)")
            return _generate(args)
        if args.command == "export-hf":
            from specfleet_engine.hf_export import export_hf

            export_hf(args.model, args.out, overwrite=args.overwrite,
                      progress=lambda line: print(f"specfleet export-hf: {line}", file=sys.stderr))
            return 0
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"specfleet {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 0


# `specfleet bench NAME ...`: the serving-level benchmarks beside Spec-Bench (their own flags)
BENCHES = {"pareto": ("specfleet_bench.pareto", "the throughput-latency front of serving configurations"),
           "select": ("specfleet_bench.method_select", "the loop's choice of draft method per prompt type "
                                                       "against fixed choices, on a real local fleet")}


def _bench(argv: list[str]) -> int:
    if argv and argv[0] in BENCHES:
        import importlib

        module = importlib.import_module(BENCHES[argv[0]][0])
        try:
            return module.main(argv[1:])
        except (ValueError, FileNotFoundError) as e:
            print(f"specfleet bench {argv[0]}: error: {e}", file=sys.stderr)
            return 2
    from specfleet_bench.spec_bench import add_bench_args, run_bench

    parser = argparse.ArgumentParser(
        prog="specfleet bench", description="Spec-Bench: tokens/s, speedup, tau and alpha by category. "
        + "; ".join(f"`specfleet bench {name}`: {what}" for name, (_, what) in BENCHES.items()))
    add_bench_args(parser)
    args = parser.parse_args(argv)
    try:
        return run_bench(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"specfleet bench: error: {e}", file=sys.stderr)
        return 2


def _generate(args) -> int:
    import time

    from specfleet_engine.engine import Engine
    from specfleet_engine.factory import build_engine_parts
    from specfleet_engine.sampling import SamplingParams

    head = args.draft_head if args.method == Method.EAGLE else None
    medusa = args.medusa_heads if args.method == Method.MEDUSA else None
    model, tokenizer, proposers = build_engine_parts(args.model, args.dtype, args.quantization,
                                                     args.draft_model, args.threads, draft_head=head,
                                                     medusa_head=medusa, ngram_mix=args.ngram_mix)
    engine = Engine(model, tokenizer, proposers=proposers)
    if args.method != Method.NONE:
        engine.calibrate(sizes=list(range(1, args.k + 2)))  # adaptive K prices drafts with these costs
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    params.validate()
    t = time.perf_counter()
    seq = engine.generate(tokenizer.chat(args.prompt), params, args.method, args.k)
    dt = time.perf_counter() - t
    print(engine.text_of(seq))
    s = seq.stats
    print(f"\n[{len(seq.output)} tokens in {dt:.2f}s, {len(seq.output) / dt:.1f} tok/s; method {args.method}, "
          f"tau {s.mean_accepted_length:.2f}, alpha {s.acceptance_rate:.2f}"
          + (f", n-gram share {s.num_ngram_accepted / max(1, s.num_accepted_tokens):.0%}" if args.ngram_mix else "")
          + f", finish {seq.finish_reason}]",
          file=sys.stderr)
    return 0


def kubectl_plugin() -> int:
    """`kubectl-specfleet`: kubectl runs it for `kubectl specfleet ...` with the words after `specfleet`."""
    return main(prog="kubectl specfleet")


if __name__ == "__main__":
    sys.exit(main())
