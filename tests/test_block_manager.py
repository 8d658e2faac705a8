"""Block manager: allocation, ref counts, prefix caching, reservations, sliding windows (no torch)."""

import pytest

from engine.block_manager import BlockManager
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

P = SamplingParams()


def seq(tokens, rid="r"):
    return Sequence(rid, list(tokens), P)


def compute_all(bm, s):
    s.num_computed_tokens = len(s)
    bm.mark_computed(s)


def test_allocate_and_free_returns_everything():
    bm = BlockManager(8, 4)
    s = seq(range(10))
    assert bm.allocate(s)
    assert len(s.block_table) == 3 and bm.num_free_blocks == 5
    bm.free(s)
    assert bm.all_free() and s.block_table == []


def test_allocate_fails_without_side_effects():
    bm = BlockManager(2, 4)
    s = seq(range(9))  # needs 3 blocks
    assert not bm.allocate(s)
    assert bm.all_free() and s.block_table == []


def test_append_slots_grows_by_block():
    bm = BlockManager(3, 4)
    s = seq(range(4))
    assert bm.allocate(s) and len(s.block_table) == 1
    s.token_ids.append(99)
    assert bm.append_slots(s) and len(s.block_table) == 2
    s.token_ids.extend([1, 2, 3, 4, 5, 6, 7])  # 12 tokens fill 3 blocks
    assert bm.append_slots(s) and len(s.block_table) == 3
    s.token_ids.append(8)
    assert not bm.append_slots(s)  # out of blocks
    bm.free(s)
    assert bm.all_free()


def test_prefix_cache_hit_shares_blocks_and_keeps_last_token_uncomputed():
    bm = BlockManager(16, 4)
    a = seq(range(12), "a")
    assert bm.allocate(a)
    compute_all(bm, a)
    b = seq(list(range(8)) + [50, 51, 52], "b")
    assert bm.allocate(b)
    assert b.num_cached_tokens == 8 and b.block_table[:2] == a.block_table[:2]
    assert bm.blocks[a.block_table[0]].ref_count == 2
    # an identical prompt re-uses all but the block holding its last token
    c = seq(range(12), "c")
    assert bm.allocate(c)
    assert c.num_cached_tokens == 8 and c.num_uncomputed_tokens == 4
    for s in (a, b, c):
        bm.free(s)
    assert bm.all_free()


def test_cached_free_blocks_are_revived_then_evicted_lru():
    bm = BlockManager(4, 4)
    a = seq(range(9), "a")
    assert bm.allocate(a)
    compute_all(bm, a)
    bm.free(a)
    assert bm.all_free()
    b = seq(list(range(8)) + [7], "b")
    assert bm.allocate(b) and b.num_cached_tokens == 8
    bm.free(b)
    # a different prompt needing every block evicts the cached ones
    c = seq(range(100, 116), "c")
    assert bm.allocate(c) and c.num_cached_tokens == 0
    bm.free(c)
    d = seq(range(9), "d")
    assert bm.allocate(d) and d.num_cached_tokens == 0
    bm.free(d)
    assert bm.all_free()


def test_hash_collision_is_checked_against_tokens(monkeypatch):
    import engine.block_manager as mod
    monkeypatch.setattr(mod, "chain_hash", lambda prev, toks: 7)  # everything collides
    bm = BlockManager(8, 2)
    a = seq([1, 2, 3], "a")
    assert bm.allocate(a)
    compute_all(bm, a)
    b = seq([5, 6, 7], "b")
    assert bm.allocate(b) and b.num_cached_tokens == 0
    bm.free(a), bm.free(b)
    assert bm.all_free()


def test_prefix_caching_disabled():
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    a = seq(range(9), "a")
    assert bm.allocate(a)
    compute_all(bm, a)
    b = seq(range(9), "b")
    assert bm.allocate(b) and b.num_cached_tokens == 0
    bm.free(a), bm.free(b)
    assert bm.all_free()


def test_reserve_adopt_release():
    bm = BlockManager(8, 4)
    ids = bm.reserve(10)
    assert len(ids) == 3 and bm.num_free_blocks == 5
    assert bm.reserve(100) is None and bm.num_free_blocks == 5
    s = seq(list(range(10)) + [1], "s")
    bm.adopt(s, ids, 10)
    assert s.num_computed_tokens == 10 and s.block_hashes  # 2 full blocks registered
    bm.free(s)
    other = bm.reserve(4)
    bm.release(other)
    assert bm.all_free()


def test_reserve_cached_takes_the_blocks_a_finished_sequence_left_and_shares_them():
    """The decode role: K/V this pool received (adopted) or computed stays findable after the
    sequence frees it; a reservation for tokens starting the same way takes those blocks (one
    more reference while a running sequence holds them) and fresh ones for the rest, the block
    with the last token always fresh (the prefill replica always pushes it)."""
    bm = BlockManager(8, 4)
    first = seq(list(range(10)) + [42], "first")           # 10 tokens of K/V arrive, then one decoded
    ids, cached = bm.reserve_cached(list(range(10)))
    assert cached == 0 and len(ids) == 3
    bm.adopt(first, ids, 10)
    first.num_computed_tokens = 11
    bm.mark_computed(first)                                # blocks 0-1 full and hashed, block 2 not yet
    table, cached = bm.reserve_cached(list(range(10)) + [42, 7, 8])   # running: shared
    assert cached == 2 and table[:2] == first.block_table[:2] and table[2] not in first.block_table
    assert [bm.blocks[b].ref_count for b in table] == [2, 2, 1, 1]
    second = seq(list(range(10)) + [42, 7, 8, 9], "second")
    bm.adopt(second, table, 13)
    bm.free(first)
    assert bm.blocks[table[0]].ref_count == 1
    bm.free(second)
    # all free now, still cached: the same 8 tokens (two full blocks) take only the first, the
    # block with the last token must come over the wire
    again, cached = bm.reserve_cached(list(range(8)))
    assert cached == 1 and again[0] == table[0] and again[1] != table[1]
    bm.release(again)
    assert bm.all_free()


def test_reserve_cached_counts_revived_blocks_and_changes_nothing_when_short():
    bm = BlockManager(4, 4)
    s = seq(list(range(12)) + [1], "s")
    ids, _ = bm.reserve_cached(list(range(12)))
    bm.adopt(s, ids, 12)
    bm.free(s)                                             # 3 cached free blocks, 1 empty
    assert bm.reserve_cached(list(range(8)) + [9] * 12) is None   # 2 hits + 3 fresh > 4 blocks
    assert bm.num_free_blocks == 4
    table, cached = bm.reserve_cached(list(range(8)) + [9] * 8)   # 2 hits + 2 fresh
    assert cached == 2 and bm.num_free_blocks == 0
    bm.release(table)
    off = BlockManager(4, 4, enable_prefix_caching=False)
    ids, _ = off.reserve_cached(list(range(12)))
    s = seq(list(range(12)) + [1], "s")
    off.adopt(s, ids, 12)
    off.free(s)
    assert off.reserve_cached(list(range(12)))[1] == 0


def test_double_free_is_caught():
    bm = BlockManager(4, 4)
    ids = bm.reserve(4)
    bm.release(ids)
    with pytest.raises(AssertionError):
        bm.release(ids)


def test_a_sliding_window_gives_back_the_blocks_it_has_passed():
    """Window 6, blocks of 4: the query at position p reads keys p - 5 .. p, so a block goes back
    once the next query is 6 past its last key; it stays in the prefix cache while free, and
    `free` drops only the rest of the table."""
    bm = BlockManager(8, 4, window=6)
    s = seq(range(10))
    assert bm.allocate(s) and bm.num_free_blocks == 5
    s.num_computed_tokens = 9            # next query 9: keys 4 .. 9, block 0 (keys 0-3) passed
    bm.mark_computed(s)
    assert s.num_released_blocks == 1 and bm.num_free_blocks == 6
    s.num_computed_tokens = 10           # next query 10: keys 5 .. 10, block 1 still read
    bm.mark_computed(s)
    assert s.num_released_blocks == 1
    for _ in range(4):                   # decode to 14 tokens, 13 computed: keys 8 .. 13
        s.token_ids.append(7)
        assert bm.append_slots(s)
        s.num_computed_tokens += 1
        bm.mark_computed(s)
    assert s.num_released_blocks == 2 and len(s.block_table) == 4 and bm.num_free_blocks == 6
    # the passed blocks are still cached: the same prompt finds them (and holds them until its
    # own first step has passed them too)
    again = seq(range(10), "again")
    assert bm.allocate(again) and again.num_cached_tokens == 8 and again.block_table[:2] == s.block_table[:2]
    bm.free(s)
    bm.free(again)
    assert bm.all_free() and s.num_released_blocks == 0


def test_without_a_window_or_for_a_held_prefill_sequence_nothing_is_given_back():
    for bm, hold in ((BlockManager(8, 4), False), (BlockManager(8, 4, window=2), True)):
        s = Sequence("r", list(range(16)), P, hold_blocks=hold)
        assert bm.allocate(s)
        compute_all(bm, s)
        assert s.num_released_blocks == 0 and bm.num_free_blocks == 4
        bm.free(s)
        assert bm.all_free()
    # without prefix caching the window still gives blocks back
    bm = BlockManager(8, 4, enable_prefix_caching=False, window=2)
    s = seq(range(16))
    assert bm.allocate(s)
    compute_all(bm, s)                   # next query 16: keys 15, 16: blocks 0-2 passed
    assert s.num_released_blocks == 3 and bm.num_free_blocks == 7 and not bm._hash_to_block
    bm.free(s)
    assert bm.all_free()


def test_a_cache_salt_shares_cached_prefixes_only_with_its_own():
    """vLLM's cache_salt: a salted request's blocks chain from its salt, so requests of another salt,
    or none, find none of them (no timing tells them a prompt was seen), and those of the same salt do."""
    bm = BlockManager(32, 4)
    first = Sequence("s1", list(range(12)), SamplingParams(cache_salt="tenant-1"))
    assert bm.allocate(first)
    compute_all(bm, first)
    hits = {}
    for salt in (None, "tenant-2", "tenant-1"):
        s = Sequence(str(salt), list(range(12)) + [99], SamplingParams(cache_salt=salt))
        assert bm.allocate(s)
        hits[salt] = s.num_cached_tokens
        bm.free(s)
    assert hits == {None: 0, "tenant-2": 0, "tenant-1": 12}
    assert bm.reserve_cached(list(range(12)) + [99], SamplingParams(cache_salt="tenant-1").cache_key)[1] == 3
