"""A thought under a thinking budget must be able to end when the model ends it.

Claude Code asks for thinking on every request (`thinking: {"type": "adaptive"}`), so
every request of it gets router.api.constraints.after_thinking's grammar, whose budget is
half of its max_tokens (16,000 tokens of its 32,000). When that grammar named the end
marker by its text, llguidance's matcher refused the marker's token once the thought had
any text (at the thought's start it allowed it), so a real model's thought ran to the
budget (seen with the scripted agent model: a 12,771-token thought, 87 s on this CPU,
where the model wrote its end marker at the second token). The grammar now names the
marker's token (`<[id]>`) beside its text.
"""

from __future__ import annotations

import numpy as np


def allows(matcher, tokenizer, token: int) -> bool:
    import llguidance.numpy as llg_np

    bitmask = llg_np.allocate_token_bitmask(1, len(tokenizer))
    llg_np.fill_next_token_bitmask(matcher, bitmask, 0)
    return bool(np.unpackbits(bitmask.view(np.uint8), bitorder="little")[token])


def budget_matcher(agent_model):
    import llguidance
    from transformers import AutoTokenizer

    from common.grammar_spec import to_llguidance
    from router.api.chat_format import ChatFormat
    from router.api.constraints import after_thinking
    from worker_mlx.grammar import Grammars

    tokenizer = AutoTokenizer.from_pretrained(agent_model)
    fmt = ChatFormat.of(tokenizer)
    kind, source = after_thinking(fmt, None, 100)
    grammars = Grammars(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    matcher = llguidance.LLMatcher(grammars.lltokenizer, to_llguidance(kind, source))
    return matcher, tokenizer, tokenizer.convert_tokens_to_ids(fmt.think_end)


def test_the_end_marker_may_open_the_thought(agent_model):
    matcher, tokenizer, end = budget_matcher(agent_model)
    assert allows(matcher, tokenizer, end)


def test_the_end_marker_may_follow_a_thought(agent_model):
    matcher, tokenizer, end = budget_matcher(agent_model)
    assert matcher.consume_tokens(tokenizer.encode("hello there"))
    assert allows(matcher, tokenizer, end)


def test_the_budget_still_ends_the_thought(agent_model):
    matcher, tokenizer, end = budget_matcher(agent_model)
    words = tokenizer.encode("word " * 150)
    taken = 0
    for token in words:
        if not allows(matcher, tokenizer, token):
            break
        assert matcher.consume_tokens([token])
        taken += 1
    assert taken == 100  # the budget given to after_thinking
    assert allows(matcher, tokenizer, end)
