"""Engine behaviour on the standard `tiny` model: limits, errors, stop conditions, abort, stats."""

from __future__ import annotations

import pytest

from pagedserve.config import EngineConfig, parse_bytes
from pagedserve.engine.frontend.engine import Engine
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.errors import DuplicateRequestId, InvalidRequest, QueueFull, RequestTooLong
from tests.conftest import assert_no_leaks, run_all


@pytest.fixture
def engine(tiny_model_dir):
    return Engine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64, max_model_len=256, max_waiting=8))


def test_pool_is_sized_from_the_memory_budget(tiny_model_dir):
    e = Engine(EngineConfig(model=str(tiny_model_dir), kv_cache_memory="1MiB"))
    # tiny: 2 layers × 2 KV heads × 16 dims × 2 (K and V) × 2 bytes (bf16) = 256 B/token.
    assert e.core.kv.bytes_per_token == 256
    assert e.core.kv.num_blocks == 2**20 // (16 * 256)


def test_the_cpu_token_budget_defaults_to_2048_and_is_logged(tiny_model_dir, caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="pagedserve.engine.core"):
        engine = Engine(EngineConfig(model=str(tiny_model_dir), dtype="float32", kv_cache_memory="8MiB"))
    assert engine.core.config.max_num_batched_tokens == 2048  # vLLM's API-server default on CPU
    loaded = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("loaded "))
    assert loaded.endswith("steps of up to 64 sequences and 2048 tokens")
    explicit = Engine(EngineConfig(model=str(tiny_model_dir), dtype="float32", kv_cache_memory="8MiB",
                                   max_num_batched_tokens=512))
    assert explicit.core.config.max_num_batched_tokens == 512


def test_parse_bytes():
    assert parse_bytes("2GiB") == 2 * 2**30
    assert parse_bytes("1.5GB") == 1_500_000_000
    assert parse_bytes(123) == 123
    with pytest.raises(ValueError):
        parse_bytes("lots")


def test_requests_that_can_never_fit_are_rejected(engine):
    with pytest.raises(RequestTooLong, match="max_model_len"):
        engine.add_request("a", [5] * 300, SamplingParams(max_tokens=1))
    with pytest.raises(RequestTooLong, match="max_tokens"):
        engine.add_request("b", [5] * 100, SamplingParams(max_tokens=200))
    small = Engine(EngineConfig(model=engine.core.config.model, num_kv_blocks=4, max_model_len=256))
    with pytest.raises(RequestTooLong, match="whole pool"):
        small.add_request("c", [5] * 60, SamplingParams(max_tokens=10))
    with pytest.raises(InvalidRequest, match="empty"):
        engine.add_request("d", "", SamplingParams())
    with pytest.raises(InvalidRequest):
        engine.add_request("e", [10**9], SamplingParams())
    with pytest.raises(InvalidRequest):
        SamplingParams(top_p=0).validate()
    assert_no_leaks(engine)


def test_duplicate_id_and_full_queue(engine):
    engine.add_request("x", "hello", SamplingParams(max_tokens=2))
    with pytest.raises(DuplicateRequestId):
        engine.add_request("x", "hello", SamplingParams(max_tokens=2))
    for i in range(7):
        engine.add_request(f"q{i}", "hello", SamplingParams(max_tokens=2))
    with pytest.raises(QueueFull):
        engine.add_request("overflow", "hello", SamplingParams(max_tokens=2))
    run_all(engine)
    assert_no_leaks(engine)


def test_max_tokens_and_ignore_eos(engine):
    out = run_all_one(engine, "def f(x):", SamplingParams(max_tokens=7, temperature=0, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 7 and out.outputs[0].finish_reason == "length"
    assert_no_leaks(engine)


def run_all_one(engine, prompt, params):
    engine.add_request("one", prompt, params)
    return run_all(engine)["one"]


def test_stop_string_truncates_and_streams_consistently(engine):
    free = run_all_one(engine, "import os", SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    text = free.outputs[0].text
    assert len(text) > 6
    stop = text[3:6]
    engine.add_request("s", "import os", SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[stop]))
    deltas, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.append(out.outputs[0].delta_text)
            final = out
    c = final.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == text[:text.index(stop)]
    assert "".join(deltas) == c.text  # nothing of the stop string leaked into the stream
    assert_no_leaks(engine)


def test_stop_token_ids(engine):
    free = run_all_one(engine, "class A:", SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    stop_tok = free.outputs[0].token_ids[4]
    out = run_all_one(engine, "class A:", SamplingParams(max_tokens=10, temperature=0, ignore_eos=True,
                                                          stop_token_ids=[stop_tok]))
    first = free.outputs[0].token_ids.index(stop_tok)
    assert out.outputs[0].token_ids == free.outputs[0].token_ids[:first + 1]
    assert out.outputs[0].stop_reason == stop_tok


def test_min_tokens_blocks_eos(tiny_model_dir):
    e = Engine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64, max_model_len=256))
    e.core.assembler.eos_token_ids = set(range(3, 32000))  # nearly every token would end it at once
    out = run_all_one(e, "x = 1", SamplingParams(max_tokens=6, min_tokens=4, temperature=0))
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].finish_reason == "stop"
    assert_no_leaks(e)


def test_abort_frees_blocks_mid_generation(engine):
    engine.add_request("a", "while True:", SamplingParams(max_tokens=100, ignore_eos=True))
    engine.add_request("b", "for i in range(3):", SamplingParams(max_tokens=5, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.core.block_manager.num_used_blocks > 0
    assert engine.abort("a")
    assert not engine.abort("a")
    run_all(engine)
    assert_no_leaks(engine)


def test_stats_report_utilization_and_naive_counterfactual(engine):
    engine.add_request("a", [7] * 40, SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(5):
        engine.step()
    st = engine.stats()
    assert st.num_running == 1 and st.kv_blocks_used == 3  # 44 tokens of KV: 3 blocks of 16
    assert st.kv_tokens_in_use == 44 and st.kv_slots_allocated == 48
    assert st.kv_utilization == pytest.approx(44 / 48)
    assert st.naive_reserved_tokens == 256
    engine.abort("a")
    assert_no_leaks(engine)


def test_detokenizer_never_emits_broken_utf8(engine):
    # Force byte-level tokens of a multi-byte character out one at a time via the prompt path.
    tok = engine.tokenizer
    ids = tok.encode("é😀ü", add_special_tokens=False)
    from pagedserve.engine.frontend.detokenizer import Detokenizer

    det = Detokenizer(tok)
    state = det.start([1])
    pieces = []
    for t in ids:
        state.token_ids.append(t)
        pieces.append(det.update(state))
    assert "".join(pieces) == "é😀ü"
    assert all("\ufffd" not in p for p in pieces)
