"""The worker's ModelRunner on a vision model: extends whose rows carry images (their
pixels and spans, their runs as pad values), prefix KV reused from the pool, the compiled
decode step with each row's M-RoPE skip, rows with and without images in one batch;
token for token as mlx-vlm's own greedy generation."""

from __future__ import annotations

import pytest

from common.messages import DecodeBatch, ExtendBatch, ExtendReq, ReleaseReq, SamplingParams
from common.tiny_vlm import VLM_FAMILIES, ensure_tiny_vlm
from tests.conftest import load_vlm, random_image, vlm_greedy
from tests.test_model_runner import SlotAllocator
from tests.vision_prompts import IMAGE, Prompt, chat, text
from worker_mlx.kv_pool import MlxKVPool
from worker_mlx.model_probe import probe_kv_layout
from worker_mlx.model_runner import ModelRunner
from worker_mlx.vision_model import VisionLanguageModel
from worker_mlx.vision_pass import VisionPasses

N = 8  # tokens generated per request
ASK = chat(text("Look:"), IMAGE, text("What is in the picture?"))


class VisionHarness:
    """A runner over a pool, and the scheduler's side of the slot contract for it."""

    def __init__(self, path: str):
        vlm, self.processor = load_vlm(path)
        self.model = VisionLanguageModel(vlm, vlm.config.model_type)
        self.pool = MlxKVPool(probe_kv_layout(self.model), 1024)
        self.vision = VisionPasses(self.model)
        self.runner = ModelRunner(
            self.model, self.pool, self.model.vocab_size, compile_decode=True, vision=self.vision
        )
        self.alloc = SlotAllocator(1024)
        self.slots: dict[str, list[int]] = {}
        self.out: dict[str, list[int]] = {}
        self.step = 0

    def prompt(self, messages, images) -> Prompt:
        return Prompt(self.model, self.processor, messages, images)

    def run(self, reqs: dict[str, tuple[Prompt, list[int]]]) -> dict[str, list[int]]:
        """Extend each request (rid: its prompt and the prefix slots it reuses) in one
        batch, decode them together to N tokens, release them (flushed): their tokens."""
        extends = []
        for rid, (p, prefix) in reqs.items():
            new = self.alloc.alloc(len(p.ids) - len(prefix))
            self.slots[rid] = prefix + new
            greedy = SamplingParams(max_new_tokens=N, temperature=0.0)
            extends.append(
                ExtendReq(rid, p.ids[len(prefix) :], prefix, new, greedy, images=p.parts)
            )
        self.step += 1
        res = self.runner.extend(ExtendBatch(self.step, extends))
        out = {rid: [tok] for rid, tok in zip(res.rids, res.next_token_ids)}
        rids = list(reqs)
        for _ in range(N - 1):
            self.step += 1
            locs = self.alloc.alloc(len(rids))
            res = self.runner.decode(DecodeBatch(self.step, rids, locs))
            for rid, loc, tok in zip(rids, locs, res.next_token_ids):
                self.slots[rid].append(loc)
                out[rid].append(tok)
        self.runner.release([ReleaseReq(rid, flush=True) for rid in rids])
        return out


@pytest.fixture(scope="module")
def harness(tiny_vlm):
    return VisionHarness(tiny_vlm)


@pytest.fixture(scope="module", params=VLM_FAMILIES)
def families(request, model_cache):
    """(path, harness) of each served family's tiny VLM."""
    path = str(ensure_tiny_vlm(model_cache, arch=request.param))
    return path, VisionHarness(path)


def test_cold_then_cached_image_then_another_image(families):
    tiny_vlm, harness = families
    picture, other = random_image(7), random_image(8)
    p = harness.prompt(ASK, [picture])
    want = vlm_greedy(tiny_vlm, ASK, [picture], N)
    runs = harness.vision.tower_runs
    assert harness.run({"cold": (p, [])})["cold"] == want
    assert harness.vision.tower_runs == runs + 1
    # the same prompt again: everything but its last token from the pool (no tower run)
    again = harness.run({"again": (p, harness.slots["cold"][: len(p.ids) - 1])})
    assert again["again"] == want and harness.vision.tower_runs == runs + 1
    # another image at the same place: the text before it is reused, the image is not
    q = harness.prompt(ASK, [other])
    start = q.spans[0].start
    assert q.ids[:start] == p.ids[:start] and q.ids[start] != p.ids[start]
    got = harness.run({"other": (q, harness.slots["cold"][:start])})["other"]
    assert got == vlm_greedy(tiny_vlm, ASK, [other], N) != want


def test_a_batch_mixing_image_and_text_rows(families):
    tiny_vlm, harness = families
    plain = chat(text("Tell me a story about the sea."))
    two = chat(IMAGE, text("or"), IMAGE, text("?"))
    rows = {
        "image": (ASK, [random_image(9)]),
        "text": (plain, []),
        "two": (two, [random_image(10), random_image(11, 60, 120)]),
        "text2": (chat(text("Hi")), []),
    }
    got = harness.run({rid: (harness.prompt(m, imgs), []) for rid, (m, imgs) in rows.items()})
    for rid, (messages, images) in rows.items():
        assert got[rid] == vlm_greedy(tiny_vlm, messages, images, N), rid


@pytest.mark.parametrize(
    "where, needle",
    [("outside its run", "outside the vocabulary"), ("not its own", "image tokens do not match")],
)
def test_image_tokens_must_match_the_spans(harness, where, needle):
    p = harness.prompt(ASK, [random_image(12)])
    ids, start = list(p.ids), p.spans[0].start
    if where == "outside its run":
        ids[start - 1] = ids[start]
    else:  # another image's value at one position of the run
        ids[start + 1] = ids[start + 1] + 1
    loc = harness.alloc.alloc(len(ids))
    req = ExtendReq("bad", ids, [], loc, SamplingParams(max_new_tokens=1), images=p.parts)
    with pytest.raises(ValueError, match=needle):
        harness.runner.extend(ExtendBatch(99, [req]))
    harness.alloc.free(loc)


def test_a_resent_image_whose_kv_was_evicted_skips_the_tower(tiny_vlm, harness):
    """No prefix (its KV evicted): the whole prompt is computed again, the image's
    embeddings come from the vision cache, and the tokens are still mlx-vlm's."""
    picture = random_image(13)
    p = harness.prompt(ASK, [picture])
    first = harness.run({"first": (p, [])})["first"]
    runs = harness.vision.tower_runs
    assert harness.run({"evicted": (p, [])})["evicted"] == first
    assert harness.vision.tower_runs == runs
    assert first == vlm_greedy(tiny_vlm, ASK, [picture], N)


def test_chunked_prefill_cut_inside_the_image(tiny_vlm, harness):
    """A chunk boundary inside the image's run: the second chunk gets the rest of its
    embeddings (from the vision cache) and the positions continue inside the grid."""
    picture = random_image(14)
    p = harness.prompt(ASK, [picture])
    cut = p.spans[0].start + 5
    greedy = SamplingParams(max_new_tokens=N, temperature=0.0)
    head = harness.alloc.alloc(cut)
    chunk = ExtendReq("chunked", p.ids[:cut], [], head, greedy, last_chunk=False, images=p.parts)
    assert harness.runner.extend(ExtendBatch(200, [chunk])).rids == []
    rest = p.ids[cut:]
    tail = harness.alloc.alloc(len(rest))
    final = ExtendReq("chunked", rest, head, tail, greedy, images=p.parts)
    first = harness.runner.extend(ExtendBatch(201, [final])).next_token_ids[0]
    assert first == vlm_greedy(tiny_vlm, ASK, [picture], 1)[0]
    harness.runner.release([ReleaseReq("chunked", flush=True)])


def test_penalties_see_the_image_placeholder_not_its_pad_value(harness):
    """A penalized request's prompt holds pad values above the vocabulary: the penalties
    count the model's placeholder id instead (as mlx-vlm's do), never an id past the
    logits."""
    p = harness.prompt(ASK, [random_image(15)])
    sampling = SamplingParams(max_new_tokens=4, temperature=0.0, repetition_penalty=1.5)
    loc = harness.alloc.alloc(len(p.ids))
    req = ExtendReq("penalized", p.ids, [], loc, sampling, images=p.parts)
    decoding = harness.runner._new_decoding(req)
    assert max(decoding.penalty.seen) == harness.model.image_token_id < harness.model.vocab_size
    out = harness.runner.extend(ExtendBatch(300, [req]))
    assert 0 <= out.next_token_ids[0] < harness.model.vocab_size
    harness.runner.release([ReleaseReq("penalized", flush=True)])


def test_verify_steps_after_an_image(tiny_vlm, harness):
    """Speculation stays on after the image: verify steps of S columns take the rows'
    RoPE skip as plain steps do, so accepted drafts and the token after them are
    mlx-vlm's."""
    from worker_mlx.proposer import SchedulerDrafts
    from worker_mlx.speculation import Verifier

    picture = random_image(16)
    p = harness.prompt(ASK, [picture])
    want = vlm_greedy(tiny_vlm, ASK, [picture], 10)
    verifier = Verifier(harness.runner, SchedulerDrafts())
    greedy = SamplingParams(max_new_tokens=10, temperature=0.0)
    loc = harness.alloc.alloc(len(p.ids))
    req = ExtendReq("spec", p.ids, [], loc, greedy, images=p.parts)
    got = verifier.extend(ExtendBatch(400, [req])).next_token_ids
    wrong = (want[3] + 1) % harness.model.vocab_size
    for step, drafts in enumerate([want[1:3] + [wrong], want[4:6], []]):
        slot, draft_slots = harness.alloc.alloc(1), harness.alloc.alloc(len(drafts))
        batch = DecodeBatch(401 + step, ["spec"], slot, drafts=[drafts], draft_slots=[draft_slots])
        out = verifier.decode(batch)
        accepted = out.accepted[0] if out.accepted else 0
        got += drafts[:accepted] + out.next_token_ids
    assert got == want[: len(got)] and len(got) == 8
    verifier.release([ReleaseReq("spec", flush=True)])
