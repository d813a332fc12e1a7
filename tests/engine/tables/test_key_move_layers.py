"""The order a sink moves one statement's key changes in (``runs.layers``): no row is moved onto a
key before the row holding it left it, whatever order the capture listed them in."""

from __future__ import annotations

from airflow_provider_lr.engine.tables.runs import MAX_LAYERS, layers


def moved_in_layers(olds: list[int], news: list[int]) -> dict[int, int]:
    """Each row (by its old key) at its new key, applied layer by layer as ``runs._moves`` does: a row
    moves only onto a key no row holds then; the others stay (deleted and upserted by the sink)."""
    order = layers([(k,) for k in olds], [(k,) for k in news]) or [0] * len(olds)
    held = {k: k for k in olds}  # key -> the row (its old key) there
    for layer in range(max(order, default=0) + 1):
        for i in [i for i, x in enumerate(order) if x == layer]:
            if held.get(olds[i]) == olds[i] and news[i] not in held:
                del held[olds[i]]
                held[news[i]] = olds[i]
    return held


def test_a_chain_listed_in_any_order_moves_every_row_and_a_swap_or_a_too_long_chain_gets_one_layer():
    assert moved_in_layers([3, 2, 1], [4, 3, 2]) == {4: 3, 3: 2, 2: 1}  # the source's order
    assert moved_in_layers([1, 2, 3], [2, 3, 4]) == {4: 3, 3: 2, 2: 1}  # listed the other way round
    assert layers([(1,), (2,), (5,)], [(2,), (1,), (1,)]) == [0, 0, 1]  # a swap (layer 0), and a row onto it after
    assert layers([(1,), (2,)], [(10,), (20,)]) == []  # no move waits for another: one statement
    assert layers([(1,), (1,)], [(2,), (3,)]) == []  # a key old twice (a deferrable key): as before
    long = list(range(MAX_LAYERS + 1))
    assert layers([(k,) for k in long], [(k + 1,) for k in long]) == []
    short = list(range(MAX_LAYERS - 1))
    assert layers([(k,) for k in short], [(k + 1,) for k in short]) == list(reversed(short))
