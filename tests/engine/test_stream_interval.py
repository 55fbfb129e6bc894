"""``stream_interval``: a running request's output every N tokens, the first token at once, nothing lost.

Engine-level checks on the standard `tiny` model, plus one real server started with
``--stream-interval 4`` (its SSE events, its text and its per-token metrics), against the shared
server's per-token stream.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.config import EngineConfig
from pagedserve.engine.args import add_engine_args, engine_config_from_args
from pagedserve.engine.frontend.async_engine import AsyncEngine
from pagedserve.engine.frontend.engine import Engine
from pagedserve.engine.outputs import RequestOutput
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.server.metrics import ServerMetrics
from tests.conftest import assert_no_leaks
from tests.helpers.servers import wait_for_idle

PROMPT = "def fibonacci(n):"


def make_engine(model_dir, stream_interval: int) -> Engine:
    return Engine(EngineConfig(model=str(model_dir), num_kv_blocks=64, max_model_len=256,
                               stream_interval=stream_interval))


def stream_one(engine: Engine, prompt, params: SamplingParams) -> tuple[list[RequestOutput], int]:
    """Run one request alone; return every output it got and how many steps returned nothing."""
    engine.add_request("r", prompt, params)
    outs, empty_steps = [], 0
    while engine.has_unfinished_requests():
        step = engine.step()
        assert all(o.request_id == "r" for o in step)
        outs.extend(step)
        empty_steps += not step
    assert outs and outs[-1].finished and not any(o.finished for o in outs[:-1])
    return outs, empty_steps


def deltas(outs: list[RequestOutput], index: int = 0) -> list:
    return [next(c for c in o.outputs if c.index == index) for o in outs]


@pytest.fixture
def engines(tiny_model_dir):
    """An interval-1 engine and an interval-4 engine; both must end with no KV block in use."""
    pair = make_engine(tiny_model_dir, 1), make_engine(tiny_model_dir, 4)
    yield pair
    for e in pair:
        assert_no_leaks(e)


def test_first_token_at_once_then_every_n_then_the_rest(engines):
    every, interval4 = engines
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    ref, ref_empty = stream_one(every, PROMPT, params)
    outs, empty = stream_one(interval4, PROMPT, params)

    assert [len(c.delta_token_ids) for c in deltas(ref)] == [1] * 10 and ref_empty == 0
    # Token 1 at once, tokens 2-5 and 6-9 after four steps each, token 10 with the finish.
    assert [len(c.delta_token_ids) for c in deltas(outs)] == [1, 4, 4, 1]
    assert empty == 6  # the steps that produced held-back tokens returned nothing
    final = outs[-1].outputs[0]
    assert final.finish_reason == "length" and len(final.token_ids) == 10
    assert sum((c.delta_token_ids for c in deltas(outs)), []) == final.token_ids
    assert "".join(c.delta_text for c in deltas(outs)) == final.text
    assert final.token_ids == ref[-1].outputs[0].token_ids and final.text == ref[-1].outputs[0].text
    # The first output is the first token, on time: the engine's clock agrees.
    assert outs[0].metrics.first_token_time is not None


def test_interval_larger_than_the_output_sends_first_token_and_finish(tiny_model_dir):
    engine = make_engine(tiny_model_dir, 64)
    outs, _ = stream_one(engine, PROMPT, SamplingParams(max_tokens=7, temperature=0, ignore_eos=True))
    assert [len(c.delta_token_ids) for c in deltas(outs)] == [1, 6]
    assert_no_leaks(engine)


def test_delta_logprobs_add_up_to_the_final_logprobs(engines):
    every, interval4 = engines
    params = SamplingParams(max_tokens=11, temperature=0, ignore_eos=True, logprobs=2)
    ref, _ = stream_one(every, PROMPT, params)
    outs, _ = stream_one(interval4, PROMPT, params)
    assert [len(c.delta_logprobs) for c in deltas(outs)] == [1, 4, 4, 2]
    streamed = sum((c.delta_logprobs for c in deltas(outs)), [])
    final = outs[-1].outputs[0].logprobs
    assert len(final) == 11
    assert [(lp.token_id, lp.logprob, lp.top) for lp in streamed] == [(lp.token_id, lp.logprob, lp.top)
                                                                       for lp in final]
    assert [lp.token_id for lp in final] == outs[-1].outputs[0].token_ids
    assert [(lp.token_id, lp.logprob) for lp in final] == [(lp.token_id, lp.logprob)
                                                           for lp in ref[-1].outputs[0].logprobs]


def test_n2_choices_match_interval_one(engines):
    every, interval4 = engines
    params = SamplingParams(n=2, max_tokens=10, temperature=1.0, seed=7, ignore_eos=True)
    ref, _ = stream_one(every, PROMPT, params)
    outs, _ = stream_one(interval4, PROMPT, params)
    assert len(outs) < len(ref)  # fewer outputs, the same content
    for i in (0, 1):
        final = deltas(outs, i)[-1]
        assert final.text == deltas(ref, i)[-1].text and final.token_ids == deltas(ref, i)[-1].token_ids
        assert "".join(c.delta_text for c in deltas(outs, i)) == final.text
        assert sum((c.delta_token_ids for c in deltas(outs, i)), []) == final.token_ids
    assert [len(c.delta_token_ids) for c in deltas(outs, 0)] == [1, 4, 4, 1]
    assert outs[0].outputs[0].token_ids != outs[0].outputs[1].token_ids or \
        outs[-1].outputs[0].token_ids != outs[-1].outputs[1].token_ids  # really two samples


def test_stop_string_holdback_still_hides_the_stop(engines):
    every, interval4 = engines
    free, _ = stream_one(every, "import os", SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    text = free[-1].outputs[0].text
    assert len(text) > 12
    stop = text[9:12]  # ends the request several tokens in, past at least one interval
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[stop])
    ref, _ = stream_one(every, "import os", params)
    outs, _ = stream_one(interval4, "import os", params)
    final = outs[-1].outputs[0]
    assert final.finish_reason == "stop" and final.stop_reason == stop
    assert final.text == text[:text.index(stop)] == ref[-1].outputs[0].text
    assert "".join(c.delta_text for c in deltas(outs)) == final.text  # nothing of the stop leaked
    for o in outs:  # no intermediate output ever showed the stop string
        assert stop not in o.outputs[0].text


def test_abort_with_tokens_held_back_frees_blocks(tiny_model_dir):
    engine = make_engine(tiny_model_dir, 8)
    engine.add_request("a", PROMPT, SamplingParams(max_tokens=50, ignore_eos=True))
    got = [engine.step() for _ in range(4)]
    assert [len(s) for s in got] == [1, 0, 0, 0]  # first token, then three held back
    assert sum(s.num_output_tokens - s.sent_token_len for s in engine.core.requests["a"].seqs) == 3  # unsent
    assert engine.abort("a")
    assert_no_leaks(engine)


def test_abort_counts_the_held_back_tokens_as_generated(tiny_model_dir):
    # generation_tokens_total counts what the engine computed, streamed or not: an aborted request's
    # held-back tokens included.
    # Nothing after the first token goes out before the end; 4,000 tokens to generate leave the
    # abort seconds to land however slowly this thread gets scheduled.
    engine = Engine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=300, max_model_len=4096,
                                 stream_interval=10_000))
    metrics = ServerMetrics("tiny", engine.stats)

    async def main() -> int:
        ae = AsyncEngine(engine.core)
        ae.observer = metrics
        await ae.start()
        stream = await ae.add_request("a", engine.tokenize(PROMPT), SamplingParams(max_tokens=4000, ignore_eos=True))
        first = await stream.__anext__()
        req = engine.core.requests["a"]
        while req.seqs[0].num_output_tokens < 4:  # a few tokens generated and held back
            await asyncio.sleep(0.005)
        stream.abort()
        await ae.shutdown()
        assert len(first.outputs[0].delta_token_ids) == 1
        return req.seqs[0].num_output_tokens

    generated = asyncio.run(main())
    counted = metrics.registry.get_sample_value("pagedserve_generation_tokens_total", {"model_name": "tiny"})
    assert generated >= 4 and counted == generated
    assert metrics.registry.get_sample_value("pagedserve_request_success_total",
                                             {"model_name": "tiny", "finished_reason": "abort"}) == 1
    assert_no_leaks(engine)


def test_zero_or_bad_interval_is_refused(tiny_model_dir):
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="stream_interval"):
            EngineConfig(model=str(tiny_model_dir), stream_interval=bad)
    assert EngineConfig(model=str(tiny_model_dir)).stream_interval == 1


def test_cli_flag_reaches_the_config(tiny_model_dir):
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args(["--model", str(tiny_model_dir)])).stream_interval == 1
    args = parser.parse_args(["--model", str(tiny_model_dir), "--stream-interval", "4"])
    assert engine_config_from_args(args).stream_interval == 4
    with pytest.raises(ValueError, match="stream_interval"):
        engine_config_from_args(parser.parse_args(["--model", str(tiny_model_dir), "--stream-interval", "0"]))


# ---- through the server ---------------------------------------------------------------------


def _stream_completion(url: str, body: dict) -> list[dict]:
    """The data events of a streamed completion, decoded (the final [DONE] left out)."""
    events = []
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                events.append(json.loads(line[5:]))
    return events


def _metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if not s.name.endswith("_bucket") and "finished_reason" not in s.labels}


def test_server_streams_every_fourth_token(interval_log_server, server_url):
    body = {"prompt": PROMPT, "max_tokens": 9, "temperature": 0, "ignore_eos": True}
    # The per-token reference from the session's shared server (same tiny model and dtype, stream
    # interval 1); its own salt keeps it off any block another test cached.
    ref = _stream_completion(server_url, {**body, "cache_salt": "stream-interval-reference"})
    url = interval_log_server.url  # --stream-interval 4 (shared with the request-log test)
    before = _metrics(url)
    events = _stream_completion(url, body)
    load = wait_for_idle(url)
    after = _metrics(url)
    assert load["kv_blocks_used"] == 0 and load["running"] == 0, load

    content = [e for e in events if e.get("choices") and e["choices"][0]["text"]]
    ref_content = [e for e in ref if e.get("choices") and e["choices"][0]["text"]]
    assert len(ref_content) == 9  # every token of this greedy run has text of its own
    assert len(content) == 3  # 1 + 4 + 4 tokens
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    text = "".join(e["choices"][0]["text"] for e in content)
    assert text == "".join(e["choices"][0]["text"] for e in ref_content)

    def grew(name: str) -> float:
        return after[f"pagedserve_{name}"] - before.get(f"pagedserve_{name}", 0.0)

    assert grew("generation_tokens_total") == 9  # exact, though only 3 outputs carried them
    # One inter-token observation per token after the first, as with per-token streaming.
    assert grew("inter_token_latency_seconds_count") == 8
    assert grew("time_to_first_token_seconds_count") == 1


# ---- a request's own stream_interval ---------------------------------------------------------


def test_a_request_may_ask_for_coarser_streaming_never_finer(engines):
    every, interval4 = engines
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    ref, _ = stream_one(every, PROMPT, params)
    coarse, empty = stream_one(every, PROMPT, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True,
                                                             stream_interval=4))
    assert [len(c.delta_token_ids) for c in deltas(coarse)] == [1, 4, 4, 1] and empty == 6
    assert coarse[-1].outputs[0].token_ids == ref[-1].outputs[0].token_ids
    assert coarse[-1].outputs[0].text == ref[-1].outputs[0].text
    # The engine's interval is a floor: a request asking for 2 on the interval-4 engine gets 4.
    floor, _ = stream_one(interval4, PROMPT, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True,
                                                            stream_interval=2))
    assert [len(c.delta_token_ids) for c in deltas(floor)] == [1, 4, 4, 1]


@pytest.mark.parametrize("bad", [0, 1025, 2.5, True])
def test_a_request_stream_interval_is_bounded(bad):
    from pagedserve.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match="stream_interval") as info:
        SamplingParams(stream_interval=bad).validate()
    assert info.value.param == "stream_interval"


def test_server_streams_a_request_at_its_own_interval(server_url):
    body = {"prompt": PROMPT, "max_tokens": 9, "temperature": 0, "ignore_eos": True,
            "cache_salt": "request-stream-interval"}
    ref = _stream_completion(server_url, body)  # the shared server streams every token
    events = _stream_completion(server_url, {**body, "stream_interval": 4})
    load = wait_for_idle(server_url)
    assert load["kv_blocks_used"] == 0 and load["running"] == 0, load
    content = [e for e in events if e.get("choices") and e["choices"][0]["text"]]
    ref_content = [e for e in ref if e.get("choices") and e["choices"][0]["text"]]
    assert len(ref_content) == 9 and len(content) == 3  # 1 + 4 + 4 tokens
    assert "".join(e["choices"][0]["text"] for e in content) == "".join(e["choices"][0]["text"] for e in ref_content)
    for bad in (0, 1025, "4"):
        r = httpx.post(f"{server_url}/v1/completions", json={**body, "stream": True, "stream_interval": bad},
                       timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream_interval", r.text
