"""``pallas_kernels.flag_words`` on the CPU: its round-trip kernel lowered for an abstract H200, each word at its
value's address (values on the GPU: tests/gpu ``test_flag_words_round_trip_gpu``)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp

from tests.pallas_kernels.kernel_utils import flag_words_round_trip


def test_flag_words_address_each_value_at_its_registers_offset():
    """A thread's WGMMA-layout registers of an [64, 16] f32 half sit at rows +0 / +8 and columns +0 / +8 of its
    first (the words' rows 128 bytes apart): pairs of words at byte offsets 0, 1024, 64, 1088 from one pointer,
    for each half; the rows' layout's two registers 8 rows apart (16-byte rows of m and l: 0 and 128). The reader
    loads one word a thread for the column and two for the scalars (8 bytes apart), and checks the three in one
    block that reloads only its stale words, each at its own offset."""
    from benchmarks.code_lines import lowered_modules

    module = lowered_modules(flag_words_round_trip(), jax.ShapeDtypeStruct((128, 16), jnp.float32),
                             jax.ShapeDtypeStruct((64,), jnp.float32))[0]
    pairs = re.findall(r"st\.relaxed\.gpu\.global\.v2\.b64 \[\$0\+(\d+)\]", module)
    singles = re.findall(r"st\.relaxed\.gpu\.global\.b64 \[\$0\+(\d+)\]", module)
    assert sorted(map(int, pairs)) == sorted([0, 1024, 64, 1088] * 2)
    assert sorted(map(int, singles)) == [0, 0, 128, 128]
    loads = re.findall(r'"ld\.relaxed\.gpu\.global\.b64 \$0, \[\$1\+(\d+)\];"', module)
    assert sorted(map(int, loads)) == [0, 0, 8]
    assert module.count("again:") == 1
    assert re.search(r"@stale1 ld\.relaxed\.gpu\.global\.b64 w1, \[\$7\+0\];\\0A@stale2 ld\.relaxed\.gpu\.global"
                     r"\.b64 w2, \[\$7\+8\]", module)
