import pytest

from dsjax.engine.buckets import Buckets


def test_pow2_sizes():
    assert Buckets.pow2(1, 8).sizes == (1, 2, 4, 8)
    assert Buckets.pow2(16, 512).sizes == (16, 32, 64, 128, 256, 512)
    assert Buckets.pow2(8, 100).sizes == (8, 16, 32, 64, 100)  # max is kept even off the ladder
    assert Buckets.pow2(3, 8).sizes == (4, 8)  # min rounds up to a power of two
    assert Buckets.pow2(5, 5).sizes == (5,)
    assert len(Buckets.pow2(1, 256)) == 9
    with pytest.raises(ValueError, match="min_size=9, max_size=8"):
        Buckets.pow2(9, 8)


def test_pick_smallest_bucket_holding_n():
    b = Buckets.pow2(8, 64)
    assert [b.pick(n) for n in (0, 1, 8, 9, 16, 17, 63, 64)] == [8, 8, 8, 16, 16, 32, 64, 64]
    assert b.max_size == 64
    with pytest.raises(ValueError, match="n=65: accepted 0 to the largest bucket 64"):
        b.pick(65)


def test_sizes_are_sorted_and_validated():
    assert Buckets((32, 8, 16, 8)).sizes == (8, 16, 32)
    with pytest.raises(ValueError, match="accepted ints >= 1, got 0"):
        Buckets((0, 8))
    with pytest.raises(ValueError, match="at least one size"):
        Buckets(())


def test_quantile_boundaries():
    observed = list(range(1, 101))  # 1..100
    # Quartiles by nearest rank: 25, 50, 75 -> rounded up to multiples of 8: 32, 56, 80; then max.
    assert Buckets.quantile(observed, num_buckets=4, max_size=128).sizes == (32, 56, 80, 128)
    # Boundaries above max are capped and merge with it.
    assert Buckets.quantile([500, 600, 700, 800], num_buckets=4, max_size=256).sizes == (256,)
    # Identical observations collapse to one boundary.
    assert Buckets.quantile([10] * 50, num_buckets=5, max_size=64).sizes == (16, 64)
    assert Buckets.quantile([3, 900], num_buckets=1, max_size=1024).sizes == (1024,)
    with pytest.raises(ValueError, match="num_buckets=0"):
        Buckets.quantile([1], num_buckets=0, max_size=8)
    with pytest.raises(ValueError, match="empty"):
        Buckets.quantile([], num_buckets=2, max_size=8)


def test_padding_ratio():
    b = Buckets((8, 16))
    # padded 8 + 16 + 16 = 40, useful 8 + 9 + 16 = 33.
    assert b.padding_ratio([8, 9, 16]) == pytest.approx(7 / 40)
    assert b.padding_ratio([8, 16]) == 0.0
    assert b.padding_ratio([]) == 0.0
    # Quantile buckets fit a skewed trace better than powers of two.
    trace = [40] * 90 + [200] * 10
    assert Buckets.quantile(trace, 2, 256).padding_ratio(trace) < Buckets.pow2(8, 256).padding_ratio(trace)
