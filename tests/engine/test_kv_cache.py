import pytest
import torch

from specfleet_engine.kv_cache import BlockTable, OutOfBlocks, PagedKVCache


def make_cache(num_blocks=8, block_size=4):
    return PagedKVCache(n_layers=1, n_kv_heads=1, head_dim=2, num_blocks=num_blocks, block_size=block_size)


def test_append_allocates_blocks_and_maps_slots():
    cache = make_cache()
    bt = BlockTable(cache)
    slots = bt.append_slots(6)
    assert len(bt.blocks) == 2 and cache.allocator.num_used == 2
    assert slots.tolist() == [bt.blocks[0] * 4 + i for i in range(4)] + [bt.blocks[1] * 4 + i for i in range(2)]
    assert bt.slots().tolist() == slots.tolist()


def test_truncate_rolls_back_and_frees_empty_blocks():
    cache = make_cache()
    bt = BlockTable(cache)
    bt.append_slots(9)  # 3 blocks
    bt.truncate(5)
    assert bt.num_tokens == 5 and len(bt.blocks) == 2 and cache.allocator.num_used == 2
    bt.truncate(4)
    assert len(bt.blocks) == 1
    bt.free()
    assert cache.allocator.num_used == 0 and bt.num_tokens == 0


def test_fork_shares_blocks_and_copies_on_write():
    cache = make_cache()
    parent = BlockTable(cache)
    slots = parent.append_slots(6)
    cache.layers[0][0][:, slots] = torch.arange(6.0)[None, :, None]
    child = parent.fork()
    assert child.blocks == parent.blocks
    assert cache.allocator.ref_counts[parent.blocks[1]] == 2
    child.append_slots(1)  # writes into the shared, partly filled block: copy first
    assert child.blocks[0] == parent.blocks[0] and child.blocks[1] != parent.blocks[1]
    k = cache.layers[0][0]
    assert torch.equal(k[:, child.slots(0, 6)], k[:, parent.slots()])
    parent.free()
    child.free()
    assert cache.allocator.num_used == 0


def test_out_of_blocks_is_a_clear_error():
    cache = make_cache(num_blocks=2)
    bt = BlockTable(cache)
    with pytest.raises(OutOfBlocks, match="need 3 KV blocks, 2 free"):
        bt.append_slots(12)
    assert cache.allocator.num_used == 0


def test_contiguous_start_detects_consecutive_blocks():
    cache = make_cache()
    a, b = BlockTable(cache), BlockTable(cache)
    a.append_slots(4)
    b.append_slots(4)
    a.append_slots(4)  # a's second block comes after b's: not consecutive
    assert b.contiguous_start() == b.blocks[0] * 4
    assert a.contiguous_start() is None
