"""CUDA graphs for the decode and verify step: a step of few rows per sequence replays a graph
captured once per shape bucket, instead of launching every layer's kernels from Python.

A small model's GPU step is bound by the host: the H200 measurement in docs/gpu.md spent most of a
decode step launching kernels. A graph removes that, but it replays fixed shapes at fixed addresses.
So a step is padded into a bucket, the same scheme vLLM and SGLang use for batch sizes, here over
the four things the step's kernels are shaped by:

- rows: the new tokens of the step, padded to a power of two (at most `MAX_ROWS`). Padding rows
  write their K/V into a scratch block that no sequence owns, and their outputs are dropped;
- seqs: the sequences (the tree-attention grid's first dimension), padded to a power of two.
  A padding sequence has no nodes and no prefix, so its programs exit at once;
- nodes: the largest tree (or run) of one sequence, padded to a power of two (the kernel's tiles);
- prefix: the longest cached prefix, padded to a power of two of at least `MIN_PREFIX` (the
  kernel's prefix splits and the block tables' width).

The inputs (tokens, positions, slot mapping, block tables, prefix lengths, node offsets, the
ancestry mask) live in static buffers that each step fills with a few host-to-device copies;
the graph then runs `Transformer.forward_planned` on them. Every sequence's kernel reads only its
own rows, nodes and prefix, so the padding changes no real row: the output is the eager step's.

Graphs are captured the first time their bucket is seen (the first steps are slower), at most
`MAX_GRAPHS` of them, sharing one memory pool; a step past the cap runs eagerly. Prefills, steps
with a mask but no tree, and sliding-window models keep the eager path.

`SPECFLEET_CUDA_GRAPHS`: "0" turns graphs off; "eager" runs the same padded static-shape step
without capturing, on any device (with SPECFLEET_KERNELS=triton and TRITON_INTERPRET=1 on the CPU:
how the tests check the padding without a GPU). Unset: on for a CUDA model.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import Tensor

from .kernels.tree_attention import TreeBatch, use_triton
from .model import PREFILL_ROWS, AttentionMetadata, AttentionPlan, TreePlan, plan_tree

GRAPHS_ENV = "SPECFLEET_CUDA_GRAPHS"
MAX_ROWS = 256  # the largest row bucket (a batch of 32 sequences verifying 8 drafts each)
MIN_PREFIX = 256  # the smallest prefix bucket (the kernel never splits a prefix under it)
MAX_GRAPHS = 64


def bucket(n: int, least: int = 1) -> int:
    """The power of two >= max(n, least)."""
    n = max(n, least, 1)
    return 1 << (n - 1).bit_length()


@dataclass(frozen=True)
class GraphKey:
    rows: int
    seqs: int
    nodes: int
    prefix: int
    block_size: int
    features: tuple[int, ...]


class _StepGraph:
    """One bucket's static buffers, its planned forward over them, and (on CUDA) its graph."""

    def __init__(self, model, layers: list[tuple[Tensor, Tensor]], key: GraphKey, device: torch.device):
        self.key = key
        T, B = key.rows, key.seqs
        long = dict(dtype=torch.long, device=device)
        i32 = dict(dtype=torch.int32, device=device)
        self.tokens = torch.zeros(T, **long)
        self.positions = torch.zeros(T, **long)
        self.slot_mapping = torch.zeros(T, **long)
        batch = TreeBatch(torch.zeros(B, key.prefix // key.block_size, **i32), torch.zeros(B, **i32),
                          torch.zeros(B + 1, **i32), torch.zeros(T, key.nodes, dtype=torch.int8, device=device),
                          key.nodes, key.prefix)
        self.batch = batch
        meta = AttentionMetadata(self.positions, self.slot_mapping, [0, T], [], [])
        self.plan = AttentionPlan([], None, meta, TreePlan(batch, key.block_size, None, []))
        self.model, self.layers = model, layers
        self.graph = None
        self.out: Tensor | tuple[Tensor, Tensor] | None = None

    def run(self) -> Tensor | tuple[Tensor, Tensor]:
        return self.model.forward_planned(self.tokens, self.plan, self.layers, None, self.key.features)

    def capture(self, pool) -> None:
        """Warms up on a side stream (Triton compiles there), then captures `run` into a graph."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.run()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.out = self.run()

    def replay(self) -> Tensor | tuple[Tensor, Tensor]:
        if self.graph is None:
            return self.run()
        self.graph.replay()
        return self.out


class StepGraphs:
    """The graphed decode and verify step of one model over one paged cache (see the module doc).

    Build it with `step_graphs`; the engine hands it each forward that `takes` accepts."""

    def __init__(self, model, cache, capture: bool = True):
        """model: a `Transformer` on its device; cache: the engine's `PagedKVCache` (one of its
        blocks is kept as the padding rows' scratch); capture: False runs the padded step eagerly."""
        self.model, self.cache = model, cache
        self.device = model.device
        self.capture = capture
        self.scratch_slot = cache.allocator.allocate() * cache.block_size  # never released
        self.cache_slots = cache.layers[0][0].shape[1]
        self.graphs: dict[GraphKey, _StepGraph] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.stats = {"replays": 0, "captures": 0, "eager": 0}

    def takes(self, meta: AttentionMetadata) -> bool:
        """Whether the step can be graphed: at most MAX_ROWS new rows, each sequence fewer than
        PREFILL_ROWS (decode and verify), a mask only where a tree describes it."""
        cu = meta.cu_seqlens
        if cu[-1] == 0 or cu[-1] > MAX_ROWS or any(cu[b + 1] - cu[b] >= PREFILL_ROWS for b in range(meta.num_seqs)):
            return False
        trees = meta.tree_parents or [None] * meta.num_seqs
        return all(m is None or t is not None for m, t in zip(meta.masks, trees))

    def __call__(self, tokens: Tensor, meta: AttentionMetadata, logits_indices: Tensor | None = None,
                 features: tuple[int, ...] = ()) -> Tensor | tuple[Tensor, Tensor]:
        """Same as `model(tokens, meta, cache.layers, logits_indices, features)` for a step `takes`
        accepts; the outputs are the caller's (copied out of the graph's buffers)."""
        host = plan_tree(meta, torch.device("cpu"), self.cache_slots)
        if host is None:  # only when `takes` was not asked
            raise ValueError("this step cannot be graphed: a sequence has a mask but no tree")
        T, hb = meta.cu_seqlens[-1], host.batch
        key = GraphKey(bucket(T), bucket(hb.batch), bucket(hb.max_nodes), bucket(hb.max_prefix, MIN_PREFIX),
                       host.block_size, tuple(features))
        graph = self.graphs.get(key)
        fresh = graph is None
        if fresh:
            if len(self.graphs) >= MAX_GRAPHS:
                self.stats["eager"] += 1
                return self.model(tokens, meta, self.cache.layers, logits_indices, features)
            graph = self.graphs[key] = _StepGraph(self.model, self.cache.layers, key, self.device)
        self._fill(graph, tokens, meta, hb)
        if fresh and self.capture:
            graph.capture(self.pool)
            self.stats["captures"] += 1
        out = graph.replay()
        self.stats["replays"] += 1
        logits, feats = out if features else (out, None)
        if logits_indices is not None:
            logits = logits.index_select(0, logits_indices.to(logits.device, non_blocking=True))
        else:
            logits = logits[:T].clone()
        return logits if feats is None else (logits, feats[:T].clone())

    def _fill(self, graph: _StepGraph, tokens: Tensor, meta: AttentionMetadata, hb: TreeBatch) -> None:
        """The step's inputs into the bucket's buffers: real rows first, padding rows to the scratch
        slot; padding sequences get no nodes and no prefix. Columns past a sequence's own nodes or
        blocks are never read, so they are not cleared."""
        key, T, B = graph.key, meta.cu_seqlens[-1], hb.batch
        slots = torch.full((key.rows,), self.scratch_slot, dtype=torch.long)
        slots[:T] = meta.slot_mapping
        positions = torch.zeros(key.rows, dtype=torch.long)
        positions[:T] = meta.positions
        prefix_lens = torch.zeros(key.seqs, dtype=torch.int32)
        prefix_lens[:B] = hb.prefix_lens
        cu = torch.full((key.seqs + 1,), T, dtype=torch.int32)
        cu[:B + 1] = hb.cu_nodes
        nb = dict(non_blocking=True)
        graph.tokens[:T].copy_(tokens, **nb)
        graph.positions.copy_(positions, **nb)
        graph.slot_mapping.copy_(slots, **nb)
        graph.batch.prefix_lens.copy_(prefix_lens, **nb)
        graph.batch.cu_nodes.copy_(cu, **nb)
        graph.batch.block_tables[:B, :hb.block_tables.shape[1]].copy_(hb.block_tables, **nb)
        graph.batch.ancestry[:T, :hb.ancestry.shape[1]].copy_(hb.ancestry, **nb)


def step_graphs(model, cache) -> StepGraphs | None:
    """The engine's graphed step for `model` over `cache`, or None where it does not apply: graphs
    off (SPECFLEET_CUDA_GRAPHS=0), a model off CUDA (unless "eager"), no Triton tree attention, a
    sliding-window model, or a model without `forward_planned`."""
    choice = os.environ.get(GRAPHS_ENV, "").strip().lower()
    device = getattr(model, "device", torch.device("cpu"))
    if choice == "0" or not hasattr(model, "forward_planned") or model.args.sliding_window is not None:
        return None
    if choice != "eager" and device.type != "cuda":
        return None
    if not use_triton(device):
        return None
    return StepGraphs(model, cache, capture=choice != "eager")
