"""The decoding engine: prefill, plain decoding and speculative decoding over a batch.

`Engine.step()` is one iteration of continuous batching: sequences that arrived are prefilled
(at most `prefill_chunk` prompt tokens a step, long prompts in chunks over several steps, so that
an arrival stalls the running sequences by a bounded time, as vLLM's chunked prefill does),
then every running sequence advances by one target forward that covers all of them, each with
its own draft (possibly none: a plain decoding step). Verification, EOS, stop strings, max_tokens
and logprobs are all handled inside the step, and each step returns its statistics.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from specfleet_api.enums import Method
from specfleet_api.limits import MAX_DRAFT_NODES
from torch import Tensor

from .costs import StepCostModel
from .graphs import step_graphs
from .k_policies import KPolicy, make_policy
from .kernels.rejection import TreeVerifyBatch, greedy_argmax, rejection_sample
from .kv_cache import BlockTable, PagedKVCache, batch_metadata, move_slots
from .model import Transformer
from .proposers import Capabilities, Proposal, Proposer, TreeShape, default_proposers
from .sampling import SamplingParams, logits_to_probs, sample

log = logging.getLogger("specfleet.engine")

NO_SPECULATION = Method.NONE.value


@dataclass
class StepStats:
    """What one decoding step of one sequence did (gpt-fast's accept_counts, per step)."""

    method: str
    num_draft_tokens: int  # draft nodes verified (rows of the forward beyond the root)
    num_accepted: int
    bonus: bool
    num_emitted: int  # tokens appended to the output (after EOS / stop / max_tokens cuts)
    draft_depth: int = 0  # the deepest draft node verified (a chain: num_draft_tokens); branching
    # actually verified = num_draft_tokens / draft_depth (1.0 for a chain)
    ngram_nodes: int = 0  # a mixed draft's n-gram chain: its nodes verified (`Proposal.ngram`)
    ngram_accepted: int = 0  # and how many of the accepted tokens were on it (the rest: the head's nodes)

    @property
    def draft_positions(self) -> int:
        """Output positions the draft covered: its depth (a chain: its length). alpha counts these,
        not nodes: a tree's siblings are candidates for one position, so a tree's alpha reads like
        a chain's and a switch between them does not look like an acceptance drop."""
        return self.draft_depth or self.num_draft_tokens


@dataclass
class SequenceStats:
    """Accumulated over a request: what vLLM reports as per-request speculative metrics."""

    num_steps: int = 0  # decoding steps (target forwards) after the prefill
    num_drafts: int = 0  # steps that verified at least one draft token
    num_draft_tokens: int = 0  # positions drafted (StepStats.draft_positions): alpha's denominator
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    draft_errors: int = 0
    num_tree_steps: int = 0  # steps whose draft branched (more nodes than depth)
    num_draft_nodes: int = 0  # draft nodes verified (= num_draft_tokens for chains): what drafts cost in rows
    num_ngram_drafts: int = 0  # steps whose mixed draft held an n-gram chain
    num_ngram_accepted: int = 0  # accepted tokens on it (num_accepted_tokens less these: the head's)

    def add(self, s: StepStats) -> None:
        self.num_steps += 1
        if s.num_draft_tokens:
            self.num_drafts += 1
            positions = s.draft_positions
            self.num_tree_steps += s.num_draft_tokens > positions
            self.num_draft_tokens += positions
            self.num_draft_nodes += s.num_draft_tokens
            self.num_accepted_tokens += s.num_accepted
            self.num_ngram_drafts += s.ngram_nodes > 0
            self.num_ngram_accepted += s.ngram_accepted
            if len(self.accepted_per_position) < positions:
                self.accepted_per_position += [0] * (positions - len(self.accepted_per_position))
            for i in range(s.num_accepted):
                self.accepted_per_position[i] += 1

    @property
    def acceptance_rate(self) -> float:
        """alpha: accepted draft tokens / positions drafted."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """tau: tokens produced per decoding step (1.0 for plain decoding)."""
        return (self.num_accepted_tokens + self.num_steps) / self.num_steps if self.num_steps else 0.0


_ids = itertools.count()


class Sequence:
    def __init__(self, prompt: list[int], params: SamplingParams, method: str, k: int,
                 block_table: BlockTable, request_id: str | None = None, k_min: int = 0, k_max: int | None = None,
                 device: torch.device | str = "cpu"):
        self.seq_id = next(_ids)
        self.request_id = request_id or f"seq-{self.seq_id}"
        self.tokens = list(prompt)
        self.prompt_len = len(prompt)
        self.params = params
        self.method = method
        self.k = k  # the most draft tokens a step may verify now (the K policy moves it)
        self.k_min = k_min  # bounds the policy keeps k within; a step verifies at least k_min
        self.k_max = k if k_max is None else k_max  # draft tokens when a draft is there
        self.kstate = None  # the K policy's own state for this sequence
        # seconds (priced by the step-cost model) this request is ahead of the pace the latency
        # guard allows, (1 + max_slowdown) x plain decoding's: `choose_nodes`
        self.latency_credit = 0.0
        self.last_key = 0  # the kind of the last draft (Proposal.key)
        self.block_table = block_table
        self.generator = None
        if not params.greedy:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(params.seed if params.seed is not None else torch.seed())
        self.logprobs: list[float] = []
        self.finish_reason: str | None = None
        self.text: str | None = None
        self.stats = SequenceStats()
        self.prefilled = False

    @property
    def output(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def token_array(self) -> np.ndarray:
        return np.asarray(self.tokens, dtype=np.int64)


@dataclass
class StepTiming:
    """Where one `Engine.step` spent its time, in seconds (what the worker's speedup gauge prices)."""

    prefill: float = 0.0  # the prefill forwards and their first tokens
    decode: float = 0.0  # the decoding part: proposing, the verify forward, verification
    forward: float = 0.0  # of which the verify (or plain decoding) forward
    propose: float = 0.0  # of which proposing
    decode_rows: int = 0  # rows in that forward
    decode_seqs: int = 0  # sequences in it
    emitted: int = 0  # tokens the decoding part appended


@dataclass
class StepOutput:
    seq: Sequence
    new_tokens: list[int]
    stats: StepStats | None  # None for the prefill's first token


def _main_chain(prop: Proposal) -> list[int]:
    """The nodes of a draft's rank-0 path from the root (a chain: all of them)."""
    parents = prop.parent_list()
    chain, at = [], -1
    for i, p in enumerate(parents):
        if p == at:
            chain.append(i)
            at = i
    return chain


class Engine:
    def __init__(
        self,
        model: Transformer,
        tokenizer=None,
        *,
        proposers: dict[str, Proposer] | None = None,
        max_kv_tokens: int = 32768,
        block_size: int = 16,
        eos_token_ids: list[int] | None = None,
        k_policy: str | KPolicy = "adaptive",
        tree_branching: int = 1,
        tree_depth: int = 0,
        tree_choices=None,
        max_slowdown: float | None = None,
        prefill_chunk: int | None = None,
    ):
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1 prompt tokens a step (None: whole prompts), got {prefill_chunk}")
        self.model = model
        # prompt tokens prefilled a step, at most (None: every waiting prompt whole, in one forward)
        self.prefill_chunk = prefill_chunk
        self.tokenizer = tokenizer
        self.proposers: dict[str, Proposer] = default_proposers() if proposers is None else dict(proposers)
        for method, proposer in self.proposers.items():  # what each can do is declared, and served or refused
            caps = proposer.capabilities if hasattr(proposer, "capabilities") else None
            if not isinstance(caps, Capabilities):
                raise TypeError(f"proposer {method!r} declares no Capabilities (proposers/base.py)")
            problems = caps.problems() + caps.layer_problems(model.args.n_layers)
            if problems:
                raise ValueError(f"proposer {method!r}: " + "; ".join(problems))
        self.device = getattr(model, "device", torch.device("cpu"))
        self.cache = PagedKVCache.for_model(model.args, max_kv_tokens, block_size, dtype=model.dtype, device=self.device)
        self.graphs = step_graphs(model, self.cache)  # CUDA graphs of the decode and verify step (graphs.py)
        self.max_len = model.args.max_position_embeddings
        if eos_token_ids is None:
            eos_token_ids = tokenizer.eos_token_ids if tokenizer is not None else model.args.eos_token_ids
        self.eos = set(eos_token_ids)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.default_k = 8
        self.costs = StepCostModel()
        self._draft_failed: set[str] = set()  # methods whose failure was logged
        # max_slowdown: the adaptive policy's latency guard (a fraction; None: off), for a policy named here
        self.k_policy: KPolicy = make_policy(k_policy, self.costs, max_slowdown) if isinstance(k_policy, str) \
            else k_policy
        self.last_timing = StepTiming()
        self._features: Tensor | None = None  # the last target forward's features (`_forward`)
        # caps on the adaptive draft tree: children per node (1: chains) and depth (0: K's bound)
        self.tree_branching, self.tree_depth = tree_branching, tree_depth
        # a static shape under the caps (paths of sibling ranks), or None: ValueError naming a bad path
        self.tree_shape = TreeShape.of(tree_choices, tree_branching, tree_depth)

    def calibrate(self, sizes: list[int] | None = None, context: int = 128, reps: int = 5,
                  long_rows: int = 16, long_reps: int = 3) -> dict[int, float]:
        """Measures the target forward's cost by number of new-token rows and sets the cost curve.

        sizes: the row counts to time (default 1-12, 16, 24, 32); a server passes sizes up to its
        largest batch times (K + 1). Every size is timed once per round, the order alternating, and
        each size's fastest round is kept: a neighbour's load only ever adds time, and a median
        keeps it whenever it hit most rounds of one size (SmolLM2 int8, 2 threads, beside a busy
        process: medians priced 3 rows at 4.2x one row and 7 rows at 5.0x, where the fastest
        rounds gave 1.4x and 2.1x, as alone), and a steep shape prices drafts out for the
        worker's life. Steps of `long_rows` rows or more run long enough that a brief burst of a
        neighbour moves them little, and they decide only at high load: they are timed in the first
        `long_reps` rounds only."""
        sizes = sorted(set(sizes or [*range(1, 13), 16, 24, 32]))
        seq = Sequence([0] * context, SamplingParams(max_tokens=1), NO_SPECULATION, 0, BlockTable(self.cache))
        self._forward([seq], [seq.tokens], "last")
        times: dict[int, list[float]] = {r: [] for r in sizes}
        for rnd in range(reps + 1):  # round 0 warms up
            for rows in (sizes if rnd % 2 else sizes[::-1]):
                if rows >= long_rows and rnd > long_reps:
                    continue
                t = time.perf_counter()
                self._forward([seq], [[0] * rows], "all")
                if rnd:
                    times[rows].append(time.perf_counter() - t)
                seq.block_table.truncate(context)
        seq.block_table.free()
        self.costs.set_curve({r: min(ts) for r, ts in times.items()})
        return self.costs.relative()

    # -- requests -----------------------------------------------------------------------------

    def add(self, prompt: list[int], params: SamplingParams, method: str = "ngram", k: int = 4,
            request_id: str | None = None, *, k_min: int = 0, k_max: int | None = None,
            prior: float | None = None, batch: int = 1) -> Sequence:
        """Queues a request. k: its first K (the K policy moves it within [k_min, k_max], k_max
        defaulting to k); prior: the acceptance its kind of request has shown, if known."""
        if not prompt:
            raise ValueError("prompt must hold at least one token")
        if len(prompt) >= self.max_len:
            raise ValueError(f"prompt is {len(prompt)} tokens; the context holds {self.max_len}")
        if method != NO_SPECULATION and method not in self.proposers:
            raise ValueError(f"unknown speculation method {method!r}; have {sorted(self.proposers) + [NO_SPECULATION]}")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        if method == NO_SPECULATION:
            k = k_min = k_max = 0
        seq = Sequence(prompt, params, method, k, BlockTable(self.cache), request_id, k_min, k_max,
                       self.device)
        if method != NO_SPECULATION:
            self.k_policy.start(seq, prior, batch)
        self.waiting.append(seq)
        return seq

    def abort(self, seq: Sequence, reason: str = "abort") -> None:
        if seq in self.waiting:
            self.waiting.remove(seq)
        if not seq.finished:
            seq.finish_reason = reason
        self._release(seq)

    def _release(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        seq.block_table.free()
        proposer = self.proposers.get(seq.method)
        if proposer is not None:
            proposer.release(seq)

    # -- one iteration ------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        outputs: list[StepOutput] = []
        decoding = [s for s in self.running if not s.finished]
        self.last_timing = timing = StepTiming()
        if self.waiting:
            t = time.perf_counter()
            outputs += self._prefill()
            timing.prefill = time.perf_counter() - t
        if decoding:
            t = time.perf_counter()
            outputs += self._decode(decoding, timing)
            timing.decode = time.perf_counter() - t
        return outputs

    def _forward(self, seqs: list[Sequence], inputs: list[list[int]], logits_rows: str,
                 trees: list[list[int] | None] | None = None) -> Tensor:
        """One target forward over the new tokens of several sequences.

        logits_rows: "last" (one row per sequence) or "all" (every input token); trees: per
        sequence, None or its new tokens' parents (`batch_metadata`). The features proposers of
        these sequences read (`Capabilities.target_layers`) are kept in `self._features` for
        `_hand_features`."""
        tokens, meta, last = batch_metadata([s.block_table for s in seqs], inputs, trees)
        layers = self._feature_layers(seqs)
        with torch.inference_mode():
            rows = last if logits_rows == "last" else None
            if self.graphs is not None and self.graphs.takes(meta):
                out = self.graphs(tokens, meta, rows, layers)
            # features only when asked: a model-like object need not know the argument
            elif layers:
                out = self.model(tokens, meta, self.cache.layers, rows, features=layers)
            else:
                out = self.model(tokens, meta, self.cache.layers, rows)
        if not layers:
            self._features = None
            return out
        logits, self._features = out
        return logits

    def _feature_layers(self, seqs: list[Sequence]) -> tuple[int, ...]:
        """The target layers whose features the proposers of `seqs` read (sorted; () for none)."""
        wanted = {self.proposers[m].capabilities.target_layers for m in {s.method for s in seqs} if m in self.proposers}
        return tuple(sorted({i for layers in wanted for i in layers}))

    def _hand_features(self, seqs: list[Sequence], rows: list[list[int]], starts: list[int]) -> None:
        """Hands each proposer that reads target features (`target_layers`) its sequences' rows of
        the last forward's features: `rows[b]` (rows of the forward, in token order) hold the
        tokens at positions starts[b], starts[b] + 1, ..."""
        feats = self._features
        if feats is None:
            return
        layers = self._feature_layers(seqs)
        dim = feats.shape[1] // len(layers)
        for b, seq in enumerate(seqs):
            proposer = self.proposers.get(seq.method)
            want = proposer.capabilities.target_layers if proposer is not None else ()
            if not want or not rows[b]:
                continue
            picked = feats[rows[b]]
            if want != layers:  # its layers' columns, in its order
                cols = torch.cat([torch.arange(layers.index(i) * dim, (layers.index(i) + 1) * dim) for i in want])
                picked = picked[:, cols.to(picked.device)]
            proposer.observe_features(seq, starts[b], picked)

    def _prefill(self) -> list[StepOutput]:
        """One forward over the waiting prompts, first come first served, within the step's
        `prefill_chunk` tokens: a prompt whose last token is in it gets its first token and
        starts decoding; one cut short keeps its cached part and goes on next step, first."""
        budget = self.prefill_chunk if self.prefill_chunk is not None else sum(len(s.tokens) for s in self.waiting)
        seqs, chunks = [], []
        for seq in self.waiting:
            done = seq.block_table.num_tokens
            n = min(len(seq.tokens) - done, budget)
            if n <= 0:
                break
            seqs.append(seq)
            chunks.append(seq.tokens[done:done + n])
            budget -= n
        logits = self._forward(seqs, chunks, "last")  # [B, V]: each chunk's last row
        cu = [0, *itertools.accumulate(map(len, chunks))]
        self._hand_features(seqs, [list(range(cu[b], cu[b + 1])) for b in range(len(seqs))],
                            [s.block_table.num_tokens - len(c) for s, c in zip(seqs, chunks)])
        whole = [b for b, s in enumerate(seqs) if s.block_table.num_tokens >= len(s.tokens)]  # prompt all in
        self._recycle([seqs[b] for b in whole], [[b] for b in whole], [[seqs[b].tokens[-1]] for b in whole], logits)
        outs = []
        for seq, row in zip(seqs, logits):
            if seq.block_table.num_tokens < len(seq.tokens):
                continue  # more of its prompt next step
            self.waiting.remove(seq)
            seq.prefilled = True
            token = int(sample(row[None], seq.params, seq.generator))
            emitted = self._emit(seq, [token], row[None])
            outs.append(StepOutput(seq, emitted, None))
            if not seq.finished:
                self.running.append(seq)
        return outs

    def _propose(self, seqs: list[Sequence]) -> list[Proposal]:
        """Each sequence's draft chain or tree, as much as its K policy has it verify (possibly none)."""
        proposals: dict[int, Proposal] = {}
        by_method: dict[str, list[Sequence]] = {}
        for seq in seqs:
            by_method.setdefault(seq.method, []).append(seq)
        for method, group in by_method.items():
            if method == NO_SPECULATION:
                for s in group:
                    proposals[s.seq_id] = Proposal([], None)
                continue
            proposer = self.proposers[method]
            caps = proposer.capabilities
            cheap = caps.cheap
            others = len(seqs) - len(group)  # rows the rest of the batch adds

            def cost(rows):
                return self.costs(rows + others)

            # never draft past the context or past max_tokens
            room = [max(0, min(self.max_len - len(s.tokens) - 1, s.params.max_tokens - len(s.output) - 1))
                    for s in group]
            shape = self.tree_shape
            depth = shape.depth if shape is not None else self.tree_depth
            if depth:
                room = [min(r, depth) for r in room]
            ks = self.k_policy.draft_lengths(group, room, cost, cheap, len(seqs))
            results = [Proposal([], None) for _ in group]
            if any(ks):
                branching = shape.branching if shape is not None else self.tree_branching
                try:
                    if branching > 1 and caps.trees:
                        extra = {"shape": shape} if shape is not None and caps.shapes else {}
                        results = proposer.propose(group, ks, [branching] * len(group), **extra)
                    else:
                        results = proposer.propose(group, ks)
                    results = [p.within(shape) for p in results]
                except Exception:  # noqa: BLE001 - a failing draft degrades to plain decoding
                    for s in group:
                        s.stats.draft_errors += 1
                    if method not in self._draft_failed:  # once per method: what broke, not a flood
                        self._draft_failed.add(method)
                        log.warning("the %s proposer failed; its sequences decode plainly this step (this is "
                                    "logged once; the count is each sequence's stats.draft_errors)", method,
                                    exc_info=True)
                bystander = min((s.latency_credit for s in seqs if s.method != method), default=0.0)
                keep = [k[:MAX_DRAFT_NODES] for k in self.k_policy.select_nodes(group, results, cost, cheap, len(seqs),
                                                                                 bystander)]
                results = [p if len(k) == len(p.draft_tokens) else p.subset(k) for p, k in zip(results, keep)]
            for s, p in zip(group, results):
                proposals[s.seq_id] = p
                s.last_key = p.key
        return [proposals[s.seq_id] for s in seqs]

    def _decode(self, seqs: list[Sequence], timing: StepTiming) -> list[StepOutput]:
        t = time.perf_counter()
        proposals = self._propose(seqs)
        timing.propose = time.perf_counter() - t
        inputs = [[s.tokens[-1]] + p.draft_tokens for s, p in zip(seqs, proposals)]
        # rows of a sequence: its last token (the root), then its draft nodes; trees get a mask
        row_parents = [[-1] + [q + 1 for q in p.parent_list()] for p in proposals]
        trees = [rp if p.is_tree else None for rp, p in zip(row_parents, proposals)]
        rows_total = sum(map(len, inputs))
        t = time.perf_counter()
        logits = self._forward(seqs, inputs, "all", trees if any(x is not None for x in trees) else None)
        timing.forward = time.perf_counter() - t  # logits: [sum(1 + n_i), V]
        timing.decode_rows, timing.decode_seqs = rows_total, len(seqs)
        self.costs.observe(rows_total, timing.forward, len(seqs))
        cu = [0, *itertools.accumulate(map(len, inputs))]
        result = self._verify(seqs, proposals, row_parents, logits, cu)
        # the latency guard's account: each request earns (1 + max_slowdown) x plain decoding's
        # step per token it gets and pays this step's price (both priced, so noise cancels)
        pace = (1.0 + (getattr(self.k_policy, "max_slowdown", None) or 0.0)) * self.costs(len(seqs))
        price = self.costs(rows_total)
        paths = [result.path[b, :int(result.num_accepted[b])].tolist() for b in range(len(seqs))]  # root: row 0
        self._recycle(seqs, [[lo + r for r in [0, *path]] for lo, path in zip(cu, paths)],
                      [[inp[r] for r in [0, *path]] for inp, path in zip(inputs, paths)], logits)
        # the root sits at position len(tokens) - 1, the accepted nodes after it
        self._hand_features(seqs, [[lo + r for r in [0, *path]] for lo, path in zip(cu, paths)],
                            [len(s.tokens) - 1 for s in seqs])
        outs = []
        for b, (seq, prop) in enumerate(zip(seqs, proposals)):
            n = len(prop.draft_tokens)
            lo = cu[b]
            path = paths[b]  # rows local to the sequence
            accepted = len(path)
            context = len(seq.tokens)  # the cache held context - 1 positions; the root is the next
            if path != list(range(1, accepted + 1)):  # a tree's branch: compact its K/V into place
                slots = seq.block_table.slots(context - 1, context + n)
                move_slots(self.cache, slots[path], slots[1:accepted + 1])
            seq.block_table.truncate(context + accepted)
            emitted = self._emit(seq, [prop.draft_tokens[r - 1] for r in path] + [int(result.next_token[b])],
                                 logits[[lo + r for r in [0, *path]]])
            timing.emitted += len(emitted)
            seq.latency_credit += pace * len(emitted) - price
            depth = max(prop.depths(), default=0)
            on_ngram = next((i for i, r in enumerate(path) if r > prop.ngram), accepted)  # the chain: rows 1 .. ngram
            stats = StepStats(seq.method if n else NO_SPECULATION, n, accepted, bool(result.bonus[b]), len(emitted),
                              depth, prop.ngram, on_ngram)
            seq.stats.add(stats)
            if seq.method != NO_SPECULATION:
                nodes = [r - 1 for r in path]
                chain = _main_chain(prop)  # rank-0 children from the root: what K and alpha describe
                on_chain = next((i for i, (c, a) in enumerate(zip(chain, nodes)) if c != a), min(len(chain), len(nodes)))
                self.k_policy.observe(seq, seq.last_key, len(chain), on_chain)
                if prop.is_tree:
                    self.k_policy.observe_branches(prop.parent_list(), nodes)
            if not seq.finished and seq.method in self.proposers:
                self.proposers[seq.method].rollback(seq, len(seq.tokens) - 1)
            outs.append(StepOutput(seq, emitted, stats))
        return outs

    def _recycle(self, seqs: list[Sequence], rows: list[list[int]], tokens: list[list[int]], logits: Tensor) -> None:
        """Hands a proposer that asks for them (`capabilities.target_top_k` > 0: Token Recycling)
        the target's top next tokens after each token of its sequences' accepted path (`rows` of
        `logits`, fed `tokens`): the verify forward computed them anyway; one top-k for the batch."""
        tops = {m: p.capabilities.target_top_k for m, p in self.proposers.items()}
        want = [b for b, s in enumerate(seqs) if tops.get(s.method, 0)]
        if not want:
            return
        k = max(tops[seqs[b].method] for b in want)
        flat = [r for b in want for r in rows[b]]
        top = logits[flat].topk(k, dim=-1).indices.cpu().numpy()
        at = 0
        for b in want:
            n = len(rows[b])
            proposer = self.proposers[seqs[b].method]
            proposer.observe_targets(seqs[b], tokens[b], top[at:at + n, :tops[seqs[b].method]])
            at += n

    def _verify(self, seqs: list[Sequence], proposals: list[Proposal], row_parents: list[list[int]], logits: Tensor,
                cu: list[int]):
        """Greedy or multi-draft rejection sampling over the whole batch (kernels/rejection.py)."""
        if not any(p.draft_tokens for p in proposals) and all(s.params.greedy for s in seqs):
            return greedy_argmax(logits, cu)  # plain greedy decoding: nothing to verify
        target, draft, tokens, parents, has_q = [], [], [], [], []
        any_q = any(p.draft_probs is not None for p in proposals)
        for b, (seq, prop) in enumerate(zip(seqs, proposals)):
            rows = logits[cu[b]:cu[b + 1]]
            target.append(rows if seq.params.greedy else logits_to_probs(rows, seq.params))
            tokens += [-1, *prop.draft_tokens]
            parents += row_parents[b]
            has_q += [False] + [prop.draft_probs is not None] * len(prop.draft_tokens)
            if any_q:
                q = prop.draft_probs if prop.draft_probs is not None else rows.new_zeros(len(prop.draft_tokens), rows.shape[1])
                draft += [rows.new_zeros(1, rows.shape[1]), q.to(rows.dtype)]
        batch = TreeVerifyBatch(torch.tensor(cu), torch.tensor(tokens), torch.tensor(parents),
                                torch.tensor([s.params.greedy for s in seqs]), torch.tensor(has_q))
        return rejection_sample(torch.cat(target), torch.cat(draft) if any_q else None, batch,
                                [s.generator for s in seqs])

    def _emit(self, seq: Sequence, tokens: list[int], rows: Tensor) -> list[int]:
        """Appends verified tokens one by one, stopping at EOS, a stop string or max_tokens."""
        emitted = []
        logprobs = torch.log_softmax(rows, dim=-1) if seq.params.logprobs else None
        for j, tok in enumerate(tokens):
            if tok in self.eos and not seq.params.ignore_eos:
                seq.finish_reason = "stop"
                break
            seq.tokens.append(tok)
            emitted.append(tok)
            if logprobs is not None:
                seq.logprobs.append(float(logprobs[j, tok]))
            if seq.params.stop and self._hit_stop_string(seq):
                seq.finish_reason = "stop"
                break
            if len(seq.output) >= seq.params.max_tokens or len(seq.tokens) >= self.max_len:
                seq.finish_reason = "length"
                break
        if seq.finished:
            self._release(seq)
        return emitted

    def _hit_stop_string(self, seq: Sequence) -> bool:
        text = self.tokenizer.decode(seq.output)
        # a stop string can only complete in the tail that the newest token added
        tail_from = max(0, len(text) - len(self.tokenizer.decode(seq.output[-1:])) - max(map(len, seq.params.stop)))
        cut = min((i for i in (text.find(s, tail_from) for s in seq.params.stop) if i >= 0), default=-1)
        if cut < 0:
            return False
        seq.text = text[:cut]
        return True

    # -- scoring ------------------------------------------------------------------------------

    def score(self, context: list[int], tokens: list[int], params: SamplingParams) -> list[float]:
        """Teacher-forced log-probabilities: log p(tokens[i] | context + tokens[:i]) under the
        distribution sampling draws from (temperature, top_k, top_p), -inf where top_k or top_p
        excluded the token; greedy params score the softmax at T=1, as `logprobs` reports it.

        One forward over context + tokens, in blocks of its own that are freed before it
        returns; OutOfBlocks when the cache lacks them. The caller owns the engine meanwhile (no
        `step` may run)."""
        if not context or not tokens:
            raise ValueError("scoring needs at least one context token and one token to score")
        if len(context) + len(tokens) > self.max_len:
            raise ValueError(f"context and tokens are {len(context) + len(tokens)} tokens; "
                             f"the context holds {self.max_len}")
        table = BlockTable(self.cache)
        try:
            ids, meta, _ = batch_metadata([table], [context + tokens])
            rows = torch.arange(len(context) - 1, len(context) + len(tokens) - 1)  # the rows that predict tokens
            with torch.inference_mode():
                logits = self.model(ids, meta, self.cache.layers, rows)  # [N, V]
        finally:
            table.free()
        logp = torch.log_softmax(logits, dim=-1) if params.greedy else torch.log(logits_to_probs(logits, params))
        return logp.gather(1, torch.tensor(tokens, device=logp.device)[:, None]).squeeze(1).tolist()

    # -- convenience --------------------------------------------------------------------------

    def generate(self, prompt: list[int], params: SamplingParams, method: str = "ngram", k: int = 4,
                 request_id: str | None = None, **kw) -> Sequence:
        """Runs one request alone to completion (kw: `add`'s bounds and prior)."""
        seq = self.add(prompt, params, method, k, request_id, **kw)
        while not seq.finished:
            self.step()
        return seq

    def text_of(self, seq: Sequence) -> str:
        if seq.text is not None:
            return seq.text
        return self.tokenizer.decode(seq.output) if self.tokenizer is not None else ""
