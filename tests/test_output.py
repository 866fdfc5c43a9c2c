"""OutputAccumulator: one request's chunks merged, as HTTP, the front door and the SDK do."""

from __future__ import annotations

from common.messages import CLIENT_INBOX, ClientResult, Output
from common.protocol import decode, encode
from router.output import OutputAccumulator


def _chunk(text, ids, finish=None, lp=True, cached=2) -> Output:
    lps = [-0.5 * t for t in ids] if lp else None
    tops = [[[t, -0.5 * t]] for t in ids] if lp else None
    return Output(text, ids, finish, 4, 0, cached, lps, tops)


def _fed(*chunks: Output) -> OutputAccumulator:
    acc = OutputAccumulator()
    for c in chunks:
        acc.add(c)
    return acc


def test_whole_output_merges_text_ids_logprobs_and_usage():
    acc = _fed(
        _chunk("he", [1, 2]), _chunk("", [3], cached=3), _chunk("llo", [4], "length", cached=3)
    )
    out = acc.output()
    assert (out.text, out.token_ids, out.finish_reason) == ("hello", [1, 2, 3, 4], "length")
    assert (out.prompt_tokens, out.completion_tokens, out.cached_tokens) == (4, 4, 3)
    assert out.logprobs == [-0.5, -1.0, -1.5, -2.0]
    assert out.top_logprobs == [[[t, -0.5 * t]] for t in [1, 2, 3, 4]]


def test_take_returns_increments_with_usage_so_far():
    acc = _fed(_chunk("a", [1]), _chunk("", [2]))
    first = acc.take()
    assert (first.text, first.token_ids, first.completion_tokens) == ("a", [1, 2], 2)
    assert first.logprobs == [-0.5, -1.0] and first.finish_reason is None
    acc.add(_chunk("b", [3], "stop"))
    second = acc.take()
    assert (second.text, second.token_ids, second.finish_reason) == ("b", [3], "stop")
    assert second.completion_tokens == 3 and second.logprobs == [-1.5]
    rest = acc.take()  # nothing new: empty, aligned, usage still counted
    assert (rest.text, rest.token_ids, rest.logprobs, rest.completion_tokens) == ("", [], [], 3)
    assert acc.output().token_ids == [1, 2, 3]


def test_logprobs_are_none_unless_aligned_one_to_one_with_token_ids():
    plain = _fed(_chunk("a", [1], lp=False), _chunk("b", [2], "length", lp=False)).output()
    assert plain.logprobs is None and plain.top_logprobs is None
    assert OutputAccumulator().output().logprobs is None  # nothing asked, nothing came
    # a chunk with tokens but no logprobs: the whole cannot be aligned
    gap = _fed(_chunk("a", [1]), _chunk("b", [2], lp=False), _chunk("c", [3], "stop"))
    assert gap.output().logprobs is None and gap.output().top_logprobs is None
    short = _chunk("a", [1, 2])
    short.logprobs = [-1.0]
    assert _fed(short).output().logprobs is None
    # a chunk without tokens needs none
    tail = _fed(_chunk("a", [1]), Output("", [], "stop", 4, 1, 2)).output()
    assert tail.logprobs == [-0.5] and tail.finish_reason == "stop"


def test_client_result_is_an_output_on_the_wire():
    out = _fed(_chunk("hé", [5, 6], "length")).output()
    fields = {k: getattr(out, k) for k in Output.__dataclass_fields__}
    msg = ClientResult(rid="c1", **fields)
    got = decode(encode(msg), CLIENT_INBOX)
    assert got == msg and isinstance(got, Output)
    assert _fed(got).output() == out
