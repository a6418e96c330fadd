"""PageAllocator: allocation, reference counts, the sink page, and misuse that must raise."""
import pytest

from serving.core.page_allocator import SINK_PAGE, OutOfPagesError, PageAllocator


def test_counts_and_usage():
    a = PageAllocator(5)
    assert (a.num_usable_pages, a.num_free_pages, a.num_used_pages, a.usage) == (4, 4, 0, 0.0)
    pages = a.allocate(3)
    assert len(set(pages)) == 3
    assert (a.num_free_pages, a.num_used_pages, a.usage) == (1, 3, 0.75)
    a.free(pages)
    assert (a.num_free_pages, a.num_used_pages, a.usage) == (4, 0, 0.0)


def test_sink_is_never_handed_out():
    a = PageAllocator(9)
    pages = a.allocate(8)
    assert sorted(pages) == list(range(1, 9))
    assert SINK_PAGE not in pages
    assert a.usage == 1.0


def test_exhaustion_raises_and_changes_nothing():
    a = PageAllocator(4)
    a.allocate(2)
    with pytest.raises(OutOfPagesError):
        a.allocate(2)
    assert a.num_free_pages == 1
    assert len(a.allocate(1)) == 1
    with pytest.raises(OutOfPagesError):
        a.allocate(1)
    assert a.allocate(0) == []


def test_uncached_pages_are_reused_first_then_cached_ones_least_recently_freed_first():
    a = PageAllocator(6)
    p = a.allocate(5)
    for page, h in ((p[0], b"h0"), (p[1], b"h1"), (p[2], b"h2")):
        assert a.cache_page(page, h)
    a.free([p[1]])
    a.free([p[3]])  # holds nothing cached
    a.free([p[0], p[2]])
    assert a.num_cached_pages == 3  # freed, still findable
    assert a.allocate(1) == [p[3]]
    assert a.allocate(2) == [p[1], p[0]]  # evicted: no longer findable
    assert (a.lookup(b"h1"), a.lookup(b"h0"), a.lookup(b"h2")) == (None, None, p[2])
    assert a.num_cached_pages == 1 and a.num_evictions == 2


def test_a_hit_takes_a_free_cached_page_out_of_the_free_queue():
    a = PageAllocator(4)
    [p, q] = a.allocate(2)
    a.cache_page(p, b"h")
    a.free([p, q])
    assert a.num_free_pages == 3 and a.is_free(p)
    a.touch([a.lookup(b"h")])
    assert a.ref_count(p) == 1 and not a.is_free(p) and a.num_free_pages == 2
    a.touch([p])  # a second request shares it
    assert a.ref_count(p) == 2
    assert sorted(a.allocate(2)) == sorted({1, 2, 3} - {p})
    with pytest.raises(OutOfPagesError):
        a.allocate(1)
    a.free([p, p])
    assert a.is_free(p) and a.lookup(b"h") == p


def test_cache_page_does_not_deduplicate_and_refuses_misuse():
    a = PageAllocator(4)
    [p, q] = a.allocate(2)
    assert a.cache_page(p, b"h")
    assert not a.cache_page(q, b"h")  # same K/V elsewhere: q stays private
    assert a.page_hash(q) is None and a.lookup(b"h") == p
    assert a.cache_page(p, b"h")  # already so: no change
    with pytest.raises(ValueError, match="another hash"):
        a.cache_page(p, b"other")
    with pytest.raises(ValueError, match="no cached"):
        a.touch([q])
    a.free([q])
    with pytest.raises(ValueError, match="not allocated"):
        a.cache_page(q, b"x")


def test_double_free_raises():
    a = PageAllocator(4)
    pages = a.allocate(2)
    a.free(pages)
    with pytest.raises(ValueError, match="not allocated"):
        a.free(pages[:1])


def test_free_of_sink_or_out_of_range_raises():
    a = PageAllocator(4)
    a.allocate(3)
    with pytest.raises(ValueError, match="sink"):
        a.free([0])
    with pytest.raises(ValueError):
        a.free([4])
    with pytest.raises(ValueError):
        a.free([-1])


def test_bad_free_leaves_pool_unchanged():
    a = PageAllocator(6)
    pages = a.allocate(2)
    with pytest.raises(ValueError):
        a.free([pages[0], pages[0]])  # one reference, released twice in one call
    assert a.ref_count(pages[0]) == 1 and a.num_free_pages == 3
    with pytest.raises(ValueError):
        a.free([pages[1], 5])  # 5 was never allocated
    assert a.ref_count(pages[1]) == 1 and a.num_free_pages == 3


def test_incref_keeps_a_page_until_the_last_owner_frees_it():
    a = PageAllocator(4)
    [p] = a.allocate(1)
    a.incref([p])
    assert a.ref_count(p) == 2
    a.free([p])
    assert a.ref_count(p) == 1 and a.num_used_pages == 1
    a.free([p])
    assert a.ref_count(p) == 0 and a.num_used_pages == 0
    with pytest.raises(ValueError):
        a.incref([p])  # sharing needs a live page
    with pytest.raises(ValueError):
        a.incref([0])


def test_too_small_pool_is_refused():
    with pytest.raises(ValueError):
        PageAllocator(1)


def test_reset_cache_forgets_cached_pages_only_when_none_is_held():
    a = PageAllocator(5)
    pages = a.allocate(2)
    a.cache_page(pages[0], b"h0")
    a.cache_page(pages[1], b"h1")
    a.free([pages[1]])
    assert not a.reset_cache()  # pages[0] is still held: nothing changes
    assert a.lookup(b"h0") == pages[0] and a.lookup(b"h1") == pages[1]
    a.free([pages[0]])
    assert a.reset_cache()
    assert a.lookup(b"h0") is None and a.lookup(b"h1") is None
    assert a.num_cached_pages == 0 and a.num_free_pages == 4
