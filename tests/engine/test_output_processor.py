"""The output processor and the detokenizer on their own, with the `tiny` model's real tokenizer (a
byte-level BPE, so one character may take several tokens): text deltas never split a UTF-8
character, stop strings are found across token boundaries and held back while they may still be
completing, and logprobs stay aligned with the text that is kept."""

from __future__ import annotations

import pytest

from pagedserve.engine.frontend.detokenizer import Detokenizer, find_stop_string
from pagedserve.engine.frontend.output_processor import OutputProcessor
from pagedserve.engine.outputs import RequestMetrics, TokenLogprob
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.wire import CoreOutput, SeqDelta
from pagedserve.tokenizer import load_tokenizer

PROMPT = [1716, 8417]  # "The quick"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):  # type: ignore[no-untyped-def]
    return load_tokenizer(str(tiny_model_dir))


def _out(request_id: str, tokens: list[int], finished: bool = False, finish_reason: str | None = None,
         logprobs: list[TokenLogprob] | None = None, cumulative: float | None = None) -> CoreOutput:
    return CoreOutput(request_id, [SeqDelta(0, tokens, logprobs, finish_reason, None, cumulative)], finished, 0,
                      RequestMetrics(arrival_time=0.0, queued_time=0.0))


def _feed_one_by_one(processor: OutputProcessor, request_id: str, ids: list[int]):  # type: ignore[no-untyped-def]
    """Each token in its own core output, the last one finishing it; (text deltas, the final output,
    what the core was told to drop)."""
    deltas, final, dropped = [], None, []
    for i, token in enumerate(ids):
        last = i == len(ids) - 1
        result = processor.process([_out(request_id, [token], last, "length" if last else None)])
        dropped += result.finish_in_core
        for out in result.outputs:
            deltas.append(out.outputs[0].delta_text)
            final = out
        if final is not None and final.finished:
            break
    return deltas, final, dropped


def test_a_character_split_across_tokens_is_never_emitted_in_halves(tokenizer) -> None:  # type: ignore[no-untyped-def]
    text = "héllo wörld 🙂 日本"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text), "the byte-level tokenizer splits these characters"
    processor = OutputProcessor(tokenizer)
    processor.add("r", PROMPT, SamplingParams(max_tokens=len(ids)))
    deltas, final, _ = _feed_one_by_one(processor, "r", ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == final.outputs[0].text == text
    assert final.outputs[0].token_ids == ids and final.finished


def test_the_detokenizer_waits_for_the_rest_of_a_character(tokenizer) -> None:  # type: ignore[no-untyped-def]
    ids = tokenizer.encode("🙂", add_special_tokens=False)
    detok = Detokenizer(tokenizer)
    state = detok.start(PROMPT)
    emitted = []
    for token in ids:
        state.token_ids.append(token)
        emitted.append(detok.update(state))
    assert emitted[:-1] == [""] * (len(ids) - 1) and emitted[-1] == "🙂" == state.output_text


def test_a_stop_string_across_token_boundaries_ends_the_completion_in_the_front(tokenizer) -> None:  # type: ignore[no-untyped-def]
    ids = tokenizer.encode(" brown fox, stop here please.", add_special_tokens=False)
    # "x, st" spans the tokens "x", ",", " stop": found once its last character arrives.
    processor = OutputProcessor(tokenizer)
    processor.add("r", PROMPT, SamplingParams(max_tokens=len(ids), stop=["x, st"]))
    deltas, final, dropped = _feed_one_by_one(processor, "r", ids)
    c = final.outputs[0]
    assert final.finished and c.finish_reason == "stop" and c.stop_reason == "x, st"
    assert c.text == " brown fo" == "".join(deltas)
    assert not any("x" in d for d in deltas), "a stop string's beginning is held back while it may complete"
    assert dropped == [("r", None)], "the core, which still runs it, is told to drop the request"
    assert "r" not in processor.requests


def test_include_stop_str_in_output_keeps_it(tokenizer) -> None:  # type: ignore[no-untyped-def]
    ids = tokenizer.encode(" brown fox, stop here please.", add_special_tokens=False)
    processor = OutputProcessor(tokenizer)
    processor.add("r", PROMPT, SamplingParams(max_tokens=len(ids), stop=["x, st"], include_stop_str_in_output=True))
    _, final, _ = _feed_one_by_one(processor, "r", ids)
    assert final.outputs[0].text == " brown fox, st"


def test_logprobs_past_a_stop_string_leave_the_cumulative_sum(tokenizer) -> None:  # type: ignore[no-untyped-def]
    ids = tokenizer.encode(" fox, stop here", add_special_tokens=False)
    lps = [TokenLogprob(t, -0.5 * (i + 1)) for i, t in enumerate(ids)]
    processor = OutputProcessor(tokenizer)
    processor.add("r", PROMPT, SamplingParams(max_tokens=16, stop=[", "], logprobs=0))
    # One core output carrying every token: the core summed them all; the front keeps those up to the stop.
    result = processor.process([_out("r", ids, logprobs=lps, cumulative=sum(lp.logprob for lp in lps))])
    c = result.outputs[0].outputs[0]
    assert c.text == " fox" and c.finish_reason == "stop"
    # ", " ends with the space of " stop": that token completed the stop string, so it is the last kept.
    kept = ids.index(tokenizer.encode(" stop", add_special_tokens=False)[0]) + 1
    assert [lp.token_id for lp in c.logprobs] == c.token_ids == ids[:kept] and kept < len(ids)
    assert c.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in lps[:kept]))


def test_an_error_from_the_core_ends_the_request_with_it(tokenizer) -> None:  # type: ignore[no-untyped-def]
    processor = OutputProcessor(tokenizer)
    processor.add("r", PROMPT, SamplingParams())
    failed = CoreOutput("r", [], True, 0, RequestMetrics(0.0, 0.0), error="RuntimeError: boom")
    out = processor.process([failed]).outputs[0]
    assert out.finished and out.error == "RuntimeError: boom" and out.outputs == []
    # Late tokens of a request that ended here are dropped.
    assert processor.process([_out("r", [5])]).outputs == []


def test_find_stop_string_looks_only_where_a_new_one_can_be() -> None:
    assert find_stop_string("abc, def", 3, [", d"]) == (", d", 3)
    assert find_stop_string("abc, def", 1, [", d"]) is None  # it ended before the new character
    assert find_stop_string("xx yy END", 6, ["END", " yy"]) == (" yy", 2)  # the earliest of those found


def test_logprobs_stay_with_their_tokens_while_a_character_is_held_back(tokenizer) -> None:  # type: ignore[no-untyped-def]
    """Tokens whose bytes make half a character give no text yet, but their logprobs go out with
    the tokens, in order: each output's delta logprobs are its delta tokens'."""
    ids = tokenizer.encode(" 🙂 ok", add_special_tokens=False)
    lps = {t: TokenLogprob(t, -0.25 * (i + 1), [(t, -0.25 * (i + 1))]) for i, t in enumerate(ids)}
    processor = OutputProcessor(tokenizer)
    processor.add("r", PROMPT, SamplingParams(max_tokens=len(ids), logprobs=1))
    outputs = []
    for i, token in enumerate(ids):
        last = i == len(ids) - 1
        total = sum(lps[t].logprob for t in ids[:i + 1])
        outputs += processor.process([_out("r", [token], last, "length" if last else None, [lps[token]],
                                           total)]).outputs
    completions = [o.outputs[0] for o in outputs]
    assert any(c.delta_text == "" and c.delta_token_ids for c in completions), "a token with no text of its own"
    for c in completions:
        assert [lp.token_id for lp in c.delta_logprobs] == c.delta_token_ids
    final = completions[-1]
    assert final.text == " 🙂 ok" and [lp.token_id for lp in final.logprobs] == final.token_ids == ids
    assert final.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in lps.values()))


def test_a_stop_string_made_of_a_split_character(tokenizer) -> None:  # type: ignore[no-untyped-def]
    """A stop string that is one multi-token character is found when its last byte arrives, and
    nothing of it (no replacement character) was emitted before."""
    ids = tokenizer.encode("ab 🙂 cd", add_special_tokens=False)
    processor = OutputProcessor(tokenizer)
    processor.add("r", PROMPT, SamplingParams(max_tokens=len(ids), stop=["🙂"]))
    deltas, final, dropped = _feed_one_by_one(processor, "r", ids)
    c = final.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == "🙂" and c.text == "ab " == "".join(deltas)
    assert all("\ufffd" not in d for d in deltas) and dropped == [("r", None)]


def test_logprob_text_of_each_token_and_its_alternatives(tokenizer) -> None:  # type: ignore[no-untyped-def]
    """The per-token text the completions API reports (echo with logprobs): each token's own
    decoded text, the alternatives keyed by theirs, offsets advancing by each token's text and not
    at all for a special token; the first token's logprob is null, as OpenAI sends it."""
    from pagedserve.server.prompt_logprobs import echo_logprobs

    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    ids = [bos] + tokenizer.encode("The quick brown", add_special_tokens=False)
    lps = [None] + [TokenLogprob(t, -1.0 - i, [(t, -1.0 - i), (PROMPT[0], -9.0)]) for i, t in enumerate(ids[1:])]
    out = echo_logprobs(ids, lps, lambda t: tokenizer.decode([t]), 2, frozenset(tokenizer.all_special_ids))
    assert out.tokens == [tokenizer.decode([t]) for t in ids] and "".join(out.tokens[1:]) == "The quick brown"
    assert out.token_logprobs[0] is None and out.token_logprobs[1:] == [-1.0 - i for i in range(len(ids) - 1)]
    assert out.top_logprobs[0] is None
    assert all(set(top) == {tokenizer.decode([t]), tokenizer.decode([PROMPT[0]])}
               for top, t in zip(out.top_logprobs[1:], ids[1:]))
    assert out.text_offset[:2] == [0, 0]  # the special token adds no text
    assert [b - a for a, b in zip(out.text_offset[1:], out.text_offset[2:])] == [len(t) for t in out.tokens[1:-1]]
