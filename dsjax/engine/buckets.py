"""Shape buckets: the padded sizes a jitted step may run at.

Each distinct input shape costs one XLA compilation, so every step is padded up to the smallest
bucket that holds it: the number of compilations is len(sizes), known before the first request.
The engine keeps one Buckets for tokens per step and one for sequences per step.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Iterable

_QUANTILE_MULTIPLE = 8  # quantile buckets round up to this, to keep tiles aligned


@dataclasses.dataclass(frozen=True)
class Buckets:
    sizes: tuple[int, ...]  # strictly increasing; the last is the largest size accepted

    def __post_init__(self) -> None:
        sizes = tuple(self.sizes)
        if not sizes:
            raise ValueError("sizes=(): accepted at least one size")
        for size in sizes:
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(f"sizes={sizes}: accepted ints >= 1, got {size!r}")
        object.__setattr__(self, "sizes", tuple(sorted(set(sizes))))

    @classmethod
    def pow2(cls, min_size: int, max_size: int) -> Buckets:
        """Powers of two in [min_size, max_size), then max_size itself (a power of two or not)."""
        if not 1 <= min_size <= max_size:
            raise ValueError(
                f"min_size={min_size}, max_size={max_size}: accepted 1 <= min_size <= max_size"
            )
        size = 1 << (min_size - 1).bit_length()  # smallest power of two >= min_size
        sizes = []
        while size < max_size:
            sizes.append(size)
            size *= 2
        return cls(tuple(sizes) + (max_size,))

    @classmethod
    def quantile(cls, observed_lengths: Iterable[int], num_buckets: int, max_size: int) -> Buckets:
        """Boundaries at the i/num_buckets quantiles (i < num_buckets) of observed sizes, then max_size.

        Each boundary is rounded up to a multiple of 8 and capped at max_size; duplicates merge,
        so there are at most num_buckets sizes.
        """
        observed = sorted(observed_lengths)
        if not observed:
            raise ValueError("observed_lengths is empty: accepted at least one length")
        if observed[0] < 1:
            raise ValueError(f"observed_lengths contains {observed[0]}: accepted lengths >= 1")
        if num_buckets < 1:
            raise ValueError(f"num_buckets={num_buckets}: accepted an int >= 1")
        if max_size < 1:
            raise ValueError(f"max_size={max_size}: accepted an int >= 1")
        sizes = [max_size]
        for i in range(1, num_buckets):
            rank = math.ceil(i * len(observed) / num_buckets)  # nearest-rank quantile, 1-based
            boundary = -(-observed[rank - 1] // _QUANTILE_MULTIPLE) * _QUANTILE_MULTIPLE
            sizes.append(min(boundary, max_size))
        return cls(tuple(sizes))

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def __len__(self) -> int:
        return len(self.sizes)

    def pick(self, n: int) -> int:
        """The smallest bucket >= n."""
        if not 0 <= n <= self.sizes[-1]:
            raise ValueError(
                f"n={n}: accepted 0 to the largest bucket {self.sizes[-1]} (buckets {self.sizes})"
            )
        return self.sizes[bisect.bisect_left(self.sizes, n)]

    def padding_ratio(self, trace: Iterable[int]) -> float:
        """(padded - useful) / padded, summed over a trace of sizes; 0 is no waste."""
        useful = padded = 0
        for n in trace:
            useful += n
            padded += self.pick(n)
        return 0.0 if padded == 0 else (padded - useful) / padded
