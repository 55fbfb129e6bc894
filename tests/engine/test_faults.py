"""One request's fault is that request's alone: a step that raises fails only the request that
made it raise; n > 1 completions take their seats at admission."""

from __future__ import annotations

import pytest

from pagedserve import errors
from pagedserve.config import EngineConfig
from pagedserve.engine.frontend.engine import Engine
from pagedserve.engine.sampling_params import SamplingParams
from tests.conftest import assert_no_leaks, run_all
from tests.helpers.faults import Poisoned

PROMPTS = [[11 + i, 200 + 3 * i, 31, 999 + i, 7] * (1 + i % 3) for i in range(8)]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _engine(model_dir, **kw) -> Engine:
    return Engine(EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=256, max_model_len=512, **kw))


def _run(engine: Engine, poisoned: bool) -> dict[str, object]:
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, GREEDY)
    if poisoned:
        engine.add_request("poison-1", [5, 6, 7, 8], GREEDY)
    return run_all(engine)


@pytest.fixture(scope="module")
def clean_tokens(tiny_model_dir) -> dict[str, list[int]]:
    engine = _engine(tiny_model_dir)
    return {rid: out.outputs[0].token_ids for rid, out in _run(engine, poisoned=False).items()}


@pytest.mark.parametrize("stage", ["execute", "sample"])
def test_a_request_that_raises_in_a_step_fails_alone(tiny_model_dir, clean_tokens, stage):
    engine = Engine(EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=256, max_model_len=512),
                    core_factory=Poisoned(stage, "poison"))
    outputs = _run(engine, poisoned=True)
    failed = outputs.pop("poison-1")
    assert failed.finished and failed.error is not None and "injected" in failed.error
    assert {rid: out.outputs[0].token_ids for rid, out in outputs.items()} == clean_tokens
    assert all(out.error is None and out.outputs[0].finish_reason == "length" for out in outputs.values())
    assert engine.stats().failed_requests == 1
    assert_no_leaks(engine)
    # The engine keeps serving after it.
    engine.add_request("after", [1, 2, 3], GREEDY)
    assert _drain(engine)["after"].outputs[0].token_ids


def _drain(engine: Engine) -> dict:
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return done


def test_n_completions_count_against_max_num_seqs_at_admission(tiny_model_dir):
    # 10 requests of n=3 on 8 seats: at most two run at once (6 seats), never 8 + forks.
    engine = _engine(tiny_model_dir, max_num_seqs=8)
    for i in range(10):
        engine.add_request(f"n{i}", [3 + i, 4, 5], SamplingParams(n=3, max_tokens=6, temperature=0.8, seed=i))
    peak = 0
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
        peak = max(peak, len(engine.core.scheduler.running), engine.core.scheduler.seats_in_use)
    assert peak <= 8
    assert len(done) == 10 and all(len(o.outputs) == 3 for o in done.values())
    assert_no_leaks(engine)


def test_more_completions_than_seats_is_refused_at_once(tiny_model_dir):
    engine = _engine(tiny_model_dir, max_num_seqs=4)
    with pytest.raises(errors.InvalidRequest, match="max_num_seqs") as info:
        engine.add_request("big", [1, 2, 3], SamplingParams(n=5))
    assert info.value.param == "n"
    assert_no_leaks(engine)


def test_a_stop_string_ends_one_completion_and_frees_it(tiny_model_dir):
    # The text side decides stop strings; the core drops that completion's blocks at once.
    engine = _engine(tiny_model_dir)
    probe = _engine_output(engine, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    stop = probe.outputs[0].text[3:6]
    assert stop
    out = _engine_output(engine, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=[stop]))
    completion = out.outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    assert completion.text == probe.outputs[0].text[:probe.outputs[0].text.index(stop)]
    assert len(completion.token_ids) < 12
    assert_no_leaks(engine)


def _engine_output(engine: Engine, params: SamplingParams):
    engine.add_request("one", [9, 8, 7, 6], params)
    return _drain(engine)["one"]
