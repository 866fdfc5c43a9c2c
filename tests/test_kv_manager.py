"""KVCacheManager: allocation under pressure evicts in batches, not token by token."""

from __future__ import annotations

from scheduler.cache import EVICT_FRACTION, KVCacheManager


def test_full_pool_evicts_a_batch_so_the_next_steps_need_no_trie_walk():
    kv = KVCacheManager(num_slots=8192, max_requests=4, disable_radix_cache=False)
    for i in range(64):  # fill the pool with idle cached sequences of 128 tokens
        slots = kv.allocator.alloc(128)
        assert kv.tree.insert([i] + list(range(1000, 1127)), slots) == 0
    assert kv.allocator.available_size() == 0
    assert kv.alloc(1) is not None
    freed = kv.evicted_tokens
    assert freed >= 8192 // EVICT_FRACTION
    for _ in range(freed - 1):  # the rest of the batch serves later steps without evicting
        assert kv.alloc(1) is not None
    assert kv.evicted_tokens == freed
    assert kv.allocator.available_size() == 0  # exactly the batch was freed and used


def test_a_match_never_ends_inside_an_image_run():
    """A prompt whose image run agrees with a cached one's first values only (a partial
    collision) reuses the text before the image, not the agreeing part of its run."""
    from common.messages import ImagePart, SamplingParams
    from scheduler.request import Req

    kv = KVCacheManager(num_slots=256, max_requests=4, disable_radix_cache=False)
    text, run = [5, 6, 7, 8], [1000 + k for k in range(6)]
    cached = text + run + [9, 10]
    kv.tree.insert(cached, kv.allocator.alloc(len(cached)))
    image = ImagePart(start=len(text), grid=[1, 6, 1], length=len(run), key=b"x" * 32)
    whole = Req("same", cached + [11], SamplingParams(), images=[image])
    assert len(kv.match(whole)) == len(cached)
    partial = Req("other", text + run[:3] + [2000, 2001, 2002, 9, 10, 11], SamplingParams(),
                  images=[image])  # fmt: skip
    assert len(kv.match(partial)) == len(text)
