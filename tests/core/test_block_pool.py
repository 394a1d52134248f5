"""BlockPool: all-or-nothing allocation, sharing by reference count, idempotent release."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvserve.core import BlockPool


def test_allocate_is_all_or_nothing() -> None:
    pool = BlockPool(num_blocks=5, block_size=4)
    first = pool.allocate("a", 3)
    assert first is not None and len(first) == 3
    assert pool.allocate("b", 3) is None
    assert pool.table("b") == ()
    assert "b" not in pool.owners()
    assert pool.num_free == 2 and pool.num_used == 3
    assert pool.check_whole()


def test_allocate_appends_to_the_owners_table() -> None:
    pool = BlockPool(num_blocks=6, block_size=2)
    first = pool.allocate("a", 2)
    second = pool.allocate("a", 3)
    assert first is not None and second is not None
    assert pool.table("a") == first + second
    assert len(set(pool.table("a"))) == 5
    assert pool.usage == pytest.approx(5 / 6)


def test_share_counts_references_and_frees_with_the_last_owner() -> None:
    pool = BlockPool(num_blocks=4, block_size=2)
    blocks = pool.allocate("a", 2)
    assert blocks is not None
    pool.share("b", blocks)
    assert pool.table("b") == blocks
    assert [pool.refcount(b) for b in blocks] == [2, 2]
    assert pool.release("a") == 0
    assert pool.num_used == 2
    assert [pool.refcount(b) for b in blocks] == [1, 1]
    assert pool.release("b") == 2
    assert pool.num_free == 4
    assert pool.check_whole()


def test_share_refuses_free_unknown_and_duplicate_blocks_without_changing_anything() -> None:
    pool = BlockPool(num_blocks=4, block_size=2)
    held = pool.allocate("a", 1)
    assert held is not None
    free_block = next(b for b in range(4) if pool.refcount(b) == 0)
    with pytest.raises(ValueError):
        pool.share("b", [held[0], free_block])
    with pytest.raises(ValueError):
        pool.share("b", [held[0], 99])
    with pytest.raises(ValueError):
        pool.share("b", [held[0], held[0]])
    with pytest.raises(ValueError):
        pool.share("a", held)
    assert pool.refcount(held[0]) == 1
    assert pool.table("b") == ()
    assert pool.check_whole()


def test_release_is_idempotent() -> None:
    pool = BlockPool(num_blocks=3, block_size=8)
    pool.allocate("a", 2)
    assert pool.release("a") == 2
    assert pool.release("a") == 0
    assert pool.release("never-seen") == 0
    assert pool.num_free == 3
    assert pool.check_whole()


def test_freed_blocks_are_reused_first_in_first_out() -> None:
    pool = BlockPool(num_blocks=4, block_size=1)
    first = pool.allocate("a", 2)
    assert first is not None
    pool.release("a")
    # Never-used blocks were freed "earlier" than a's, so they come first; a's tail next.
    second = pool.allocate("b", 2)
    third = pool.allocate("c", 2)
    assert second is not None and third is not None
    assert set(second).isdisjoint(first)
    assert third == tuple(reversed(first))


def test_blocks_for_rounds_up() -> None:
    pool = BlockPool(num_blocks=1, block_size=32)
    assert [pool.blocks_for(n) for n in (0, 1, 31, 32, 33, 64, 65)] == [0, 1, 1, 1, 2, 2, 3]
    with pytest.raises(ValueError):
        pool.blocks_for(-1)


def test_check_whole_detects_a_broken_refcount() -> None:
    pool = BlockPool(num_blocks=3, block_size=1)
    blocks = pool.allocate("a", 1)
    assert blocks is not None and pool.check_whole()
    pool._refcounts[blocks[0]] += 1  # a reference no table accounts for
    assert not pool.check_whole()


operations = st.lists(
    st.tuples(
        st.sampled_from(["allocate", "share", "release"]),
        st.sampled_from(["a", "b", "c", "d"]),
        st.integers(min_value=0, max_value=6),
    ),
    max_size=40,
)


@given(num_blocks=st.integers(min_value=1, max_value=12), ops=operations)
def test_pool_matches_a_reference_model(num_blocks: int, ops: list[tuple[str, str, int]]) -> None:
    pool = BlockPool(num_blocks=num_blocks, block_size=4)
    model: dict[str, list[int]] = {}
    for op, owner, count in ops:
        held = {b for table in model.values() for b in table}
        if op == "allocate":
            result = pool.allocate(owner, count)
            if count > num_blocks - len(held):
                assert result is None
            else:
                assert result is not None and len(result) == count
                assert held.isdisjoint(result)
                model.setdefault(owner, []).extend(result)
        elif op == "share":
            candidates = sorted(held - set(model.get(owner, [])))[:count]
            pool.share(owner, candidates)
            model.setdefault(owner, []).extend(candidates)
        else:
            table = model.pop(owner, [])
            others = {b for table in model.values() for b in table}
            assert pool.release(owner) == len(set(table) - others)
        assert pool.check_whole()
        held = {b for table in model.values() for b in table}
        assert pool.num_used == len(held)
        assert pool.num_free == num_blocks - len(held)
        for owner_name, table in model.items():
            assert pool.table(owner_name) == tuple(table)
