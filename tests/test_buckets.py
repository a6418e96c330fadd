"""Buckets: derived defaults, padding, overrides, the fixed page-table width."""
import pytest

from serving.core.buckets import Buckets


def test_default_derivation():
    b = Buckets.derive(max_num_seqs=48, max_num_batched_tokens=1000, max_model_len=2048,
                       page_size=16)
    assert b.tokens == (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1000)
    assert b.requests == (1, 2, 4, 8, 16, 32, 48)
    assert b.pages == (1, 2, 4, 8, 16, 32, 64, 128)


def test_exact_powers_are_not_repeated():
    b = Buckets.derive(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=100,
                       page_size=8)
    assert (b.tokens, b.requests, b.pages) == ((1, 2, 4, 8, 16, 32, 64), (1, 2, 4),
                                               (1, 2, 4, 8, 13))
    tiny = Buckets.derive(max_num_seqs=1, max_num_batched_tokens=5, max_model_len=3,
                          page_size=4)
    assert (tiny.tokens, tiny.requests, tiny.pages) == ((1, 2, 4, 5), (1,), (1,))


def test_padding_picks_the_smallest_bucket_and_raises_above_the_last():
    b = Buckets.derive(max_num_seqs=48, max_num_batched_tokens=1000, max_model_len=2048,
                       page_size=16)
    assert [b.pad_tokens(n) for n in (1, 3, 8, 9, 512, 513, 1000)] == [1, 4, 8, 16, 512, 1000,
                                                                        1000]
    assert [b.pad_requests(n) for n in (1, 3, 33, 48)] == [1, 4, 48, 48]
    assert [b.pad_pages(n) for n in (1, 65, 128)] == [1, 128, 128]
    for pad, over in ((b.pad_tokens, 1001), (b.pad_requests, 49), (b.pad_pages, 129)):
        with pytest.raises(ValueError, match="outside"):
            pad(over)
    with pytest.raises(ValueError):
        b.pad_tokens(-1)


def test_overrides_are_used_and_checked():
    b = Buckets.derive(8, 256, 512, 16, tokens=[32, 256], requests=(2, 8), pages=[32])
    assert (b.tokens, b.requests, b.pages) == ((32, 256), (2, 8), (32,))
    bad = [dict(tokens=[64, 32, 256]), dict(tokens=[32, 32, 256]), dict(tokens=[0, 256]),
           dict(tokens=[128]), dict(requests=[4]), dict(pages=[16]), dict(tokens=[]),
           dict(requests=[1.5, 8])]
    for override in bad:
        with pytest.raises(ValueError):
            Buckets.derive(8, 256, 512, 16, **override)
    with pytest.raises(ValueError):
        Buckets.derive(0, 256, 512, 16)


def test_token_buckets_may_start_higher():
    b = Buckets.derive(64, 512, 2048, 16, min_tokens=16)
    assert b.tokens == (16, 32, 64, 128, 256, 512)
    assert b.pad_tokens(1) == 16
    assert Buckets.derive(4, 8, 64, 16, min_tokens=16).tokens == (8,)  # budget below it


def test_fixed_pages_is_one_width_the_widest():
    b = Buckets.derive(max_num_seqs=64, max_num_batched_tokens=512, max_model_len=2048,
                       page_size=16, fixed_pages=True)
    assert b.pages == (128,)
    assert [b.pad_pages(n) for n in (1, 7, 128)] == [128, 128, 128]
    odd = Buckets.derive(4, 64, 100, 8, fixed_pages=True)
    assert odd.pages == (13,)  # ceil(100 / 8)
    # An explicit override still wins.
    assert Buckets.derive(4, 64, 100, 8, pages=(4, 13), fixed_pages=True).pages == (4, 13)
