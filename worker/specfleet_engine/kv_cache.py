"""A paged KV cache: fixed-size blocks, per-sequence block tables, reference-counted blocks.

Blocks can be shared by reference count (`BlockTable.fork`) and are copied on write when a shared,
partly filled block is appended to. Rolling back rejected draft positions only moves the
sequence's length and frees blocks that became empty: no data moves.

**No engine path shares blocks today**: the engine never forks a table, so every sequence owns its
blocks (reference count 1) and the copy on write never runs outside tests/engine/test_kv_cache.py.
A draft tree is not forked either: its nodes are rows of the one sequence, and the accepted path's
K/V are compacted into place (`move_slots`). A future path that shares blocks (a prompt prefix
shared across requests) must also copy on write before `move_slots` writes into a block: only
`append_slots` copies (the partly filled last block it appends to).
"""

from __future__ import annotations

import heapq

import torch
from torch import Tensor

from .kernels.tree_attention import tree_mask
from .model import AttentionMetadata


class OutOfBlocks(RuntimeError):
    """No free KV block is left; the caller should wait, preempt or refuse the request."""


class BlockAllocator:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        # a min-heap: the lowest free block goes first, so a sequence's blocks tend to be
        # consecutive and its context can be read as one view instead of a gather
        self._free = list(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise OutOfBlocks(f"all {self.num_blocks} KV blocks are in use")
        block = heapq.heappop(self._free)
        self.ref_counts[block] = 1
        return block

    def share(self, block: int) -> int:
        assert self.ref_counts[block] > 0, f"block {block} is free"
        self.ref_counts[block] += 1
        return block

    def release(self, block: int) -> None:
        assert self.ref_counts[block] > 0, f"block {block} released twice"
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            heapq.heappush(self._free, block)


class PagedKVCache:
    """K and V tensors of every layer, [n_kv_heads, num_blocks * block_size, head_dim] each."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, num_blocks: int,
                 block_size: int = 16, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        shape = (n_kv_heads, num_blocks * block_size, head_dim)
        self.layers = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(n_layers)
        ]
        self.device = torch.device(device)

    @classmethod
    def for_model(cls, args, max_tokens: int, block_size: int = 16, dtype=torch.float32, device="cpu"):
        num_blocks = -(-max_tokens // block_size)
        return cls(args.n_layers, args.n_kv_heads, args.head_dim, num_blocks, block_size, dtype, device)

    def copy_block(self, src: int, dst: int) -> None:
        bs = self.block_size
        for k, v in self.layers:
            k[:, dst * bs:(dst + 1) * bs] = k[:, src * bs:(src + 1) * bs]
            v[:, dst * bs:(dst + 1) * bs] = v[:, src * bs:(src + 1) * bs]


class BlockTable:
    """One sequence's view of the cache: its blocks and how many positions hold valid K/V."""

    def __init__(self, cache: PagedKVCache):
        self.cache = cache
        self.blocks: list[int] = []
        self.num_tokens = 0

    def fork(self) -> BlockTable:
        """A new table sharing every block (copy on write later)."""
        child = BlockTable(self.cache)
        child.blocks = [self.cache.allocator.share(b) for b in self.blocks]
        child.num_tokens = self.num_tokens
        return child

    def append_slots(self, n: int) -> Tensor:
        """Reserves n new positions after num_tokens; returns their cache slots [n]."""
        bs = self.cache.block_size
        alloc = self.cache.allocator
        start, end = self.num_tokens, self.num_tokens + n
        # copy on write: the partly filled last block may be shared
        if start % bs and self.blocks and alloc.ref_counts[self.blocks[-1]] > 1:
            old = self.blocks[-1]
            new = alloc.allocate()
            self.cache.copy_block(old, new)
            alloc.release(old)
            self.blocks[-1] = new
        needed = -(-end // bs) - len(self.blocks)
        if needed > alloc.num_free:
            raise OutOfBlocks(f"need {needed} KV blocks, {alloc.num_free} free")
        for _ in range(needed):
            self.blocks.append(alloc.allocate())
        self.num_tokens = end
        return self.slots(start, end)

    def slots(self, start: int = 0, end: int | None = None) -> Tensor:
        end = self.num_tokens if end is None else end
        first = self.contiguous_start()
        if first is not None:  # one run of slots: one op, not six (a decoding step asks twice)
            return torch.arange(first + start, first + end)
        pos = torch.arange(start, end)
        table = torch.tensor(self.blocks, dtype=torch.long)
        return table[pos // self.cache.block_size] * self.cache.block_size + pos % self.cache.block_size

    def contiguous_start(self) -> int | None:
        """The first slot if the blocks are consecutive (the context is one run of slots)."""
        if not self.blocks:
            return None
        b0 = self.blocks[0]
        if self.blocks[-1] - b0 != len(self.blocks) - 1 or any(b != b0 + i for i, b in enumerate(self.blocks)):
            return None
        return b0 * self.cache.block_size

    def truncate(self, n: int) -> None:
        """Rolls back to the first n positions (rejected drafts); frees blocks left empty."""
        assert 0 <= n <= self.num_tokens, (n, self.num_tokens)
        keep = -(-n // self.cache.block_size)
        for b in self.blocks[keep:]:
            self.cache.allocator.release(b)
        del self.blocks[keep:]
        self.num_tokens = n

    def free(self) -> None:
        self.truncate(0)


def batch_metadata(tables: list[BlockTable], inputs: list[list[int]],
                   parents: list[list[int] | None] | None = None) -> tuple[Tensor, AttentionMetadata, Tensor]:
    """Reserves cache slots for each sequence's new tokens and describes the batch for a forward.

    parents: per sequence, None for a causal run of new tokens, or a tree over them: each new
    token's parent among them (-1: the cached prefix), in topological order. A tree node sits at
    position prefix + its depth - 1 and attends to the prefix, its ancestors and itself; its K/V
    go to the next slots in row order (verification compacts the accepted path afterwards).
    Returns the flat tokens [T], the metadata, and the row of each sequence's last token [B]."""
    tokens, positions, slots, cu, ctx, starts, masks = [], [], [], [0], [], [], []
    trees = parents if parents is not None else [None] * len(tables)
    for bt, new, tree in zip(tables, inputs, trees):
        start = bt.num_tokens
        slots.append(bt.append_slots(len(new)))
        if tree is None:
            positions.append(torch.arange(start, start + len(new)))
            masks.append(None)
        else:
            mask = tree_mask(tree)
            positions.append(start - 1 + mask.sum(dim=1))  # depth = ancestors + itself
            masks.append(torch.cat([torch.ones(len(new), start, dtype=torch.bool), mask], dim=1))
        tokens += new
        cu.append(cu[-1] + len(new))
        ctx.append(bt.slots())
        starts.append(bt.contiguous_start())
    meta = AttentionMetadata(torch.cat(positions), torch.cat(slots), cu, ctx, masks, starts,
                             list(trees) if parents is not None else None)
    return torch.tensor(tokens), meta, torch.tensor(cu[1:]) - 1


def move_slots(cache: PagedKVCache, src: Tensor, dst: Tensor) -> None:
    """Copies the K/V at slots src to slots dst in every layer (src read before dst is written)."""
    src, dst = src.to(cache.device), dst.to(cache.device)
    for k, v in cache.layers:
        k.index_copy_(1, dst, k.index_select(1, src))
        v.index_copy_(1, dst, v.index_select(1, src))
