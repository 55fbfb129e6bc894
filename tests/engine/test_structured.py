"""Structured output in the engine (tiny random-weight model): the grammar, not the model, makes
every output match, in mixed batches, with n > 1, under preemption and prefix caching."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pagedserve.config import EngineConfig
from pagedserve.engine.frontend.engine import Engine
from pagedserve.engine.sampling_params import SamplingParams, StructuredOutputsParams
from pagedserve.engine.core.structured import check
from pagedserve.errors import InvalidRequest
from tests.conftest import assert_no_leaks, run_all

# Bounded lengths (maxLength, enums, maxItems) so a random model reaches the end well within max_tokens.
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "role": {"enum": ["admin", "user", "guest"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False},
}, "required": ["name", "age", "role", "address"], "additionalProperties": False}


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return Engine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=256, max_model_len=512))


def test_mixed_batch_every_output_matches(engine):
    so = StructuredOutputsParams
    engine.add_request("json", "Describe a person:", SamplingParams(max_tokens=300, n=3, seed=1,
                                                                   structured_outputs=so(json=PERSON)))
    engine.add_request("choice", "Pick:", SamplingParams(max_tokens=50, seed=2,
                                                         structured_outputs=so(choice=["yes", 'no "way"', "maybe\n"])))
    engine.add_request("regex", "Code:", SamplingParams(max_tokens=50, seed=3,
                                                        structured_outputs=so(regex=r"[A-Z]{3}-[0-9]{2,4}")))
    engine.add_request("plain", "Free text:", SamplingParams(max_tokens=12, ignore_eos=True, seed=4))
    engine.add_request("greedy", "Describe:", SamplingParams(max_tokens=300, temperature=0,
                                                             structured_outputs=so(json=json.dumps(PERSON))))
    done = run_all(engine)
    for out in done["json"].outputs + done["greedy"].outputs:
        assert out.finish_reason == "stop", out
        jsonschema.validate(json.loads(out.text), PERSON)
    assert len(done["json"].outputs) == 3
    assert done["choice"].outputs[0].text in ("yes", 'no "way"', "maybe\n")
    assert re.fullmatch(r"[A-Z]{3}-[0-9]{2,4}", done["regex"].outputs[0].text)
    assert done["plain"].outputs[0].finish_reason == "length" and len(done["plain"].outputs[0].token_ids) == 12
    assert_no_leaks(engine)


def test_matcher_survives_preemption_and_prefix_cache(tiny_model_dir):
    # 12 blocks of 16 tokens for 4 growing requests: some are preempted and recomputed.
    small = Engine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=12, max_model_len=512))
    prompt = "A shared prompt that fills more than one block of sixteen tokens, twice over at least."
    for i in range(4):
        small.add_request(f"r{i}", prompt, SamplingParams(max_tokens=120, seed=i,
                                                          structured_outputs=StructuredOutputsParams(json=PERSON)))
    done = run_all(small)
    assert small.stats().num_preemptions > 0
    assert small.stats().prefix_hit_tokens > 0
    for out in done.values():
        assert out.outputs[0].finish_reason in ("stop", "length")
        if out.outputs[0].finish_reason == "stop":
            jsonschema.validate(json.loads(out.outputs[0].text), PERSON)
    assert sum(o.outputs[0].finish_reason == "stop" for o in done.values()) >= 2
    assert_no_leaks(small)


def test_bad_specs_are_refused_by_name():
    with pytest.raises(InvalidRequest, match="JSON schema cannot be compiled.*bogus"):
        check(StructuredOutputsParams(json={"type": "bogus"}))
    with pytest.raises(InvalidRequest, match="regex cannot be compiled.*parenthesis"):
        check(StructuredOutputsParams(regex="(abc"))
    with pytest.raises(InvalidRequest, match="grammar cannot be compiled.*not defined"):
        check(StructuredOutputsParams(grammar="root ::= foo"))
    with pytest.raises(InvalidRequest, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"]).validate()
    with pytest.raises(InvalidRequest, match="at most"):
        StructuredOutputsParams(regex="a" * 70_000).validate()
    with pytest.raises(InvalidRequest, match="choice"):
        StructuredOutputsParams(choice=[]).validate()


def test_a_spec_that_fails_in_the_core_fails_only_its_request(engine):
    # Past the front end's check (the offline engine has none): the compile fails on the compiler's
    # thread, the request ends with an error, the rest runs.
    engine.add_request("bad", "x", SamplingParams(max_tokens=5, structured_outputs=StructuredOutputsParams(
        grammar="root ::= undefined_rule")))
    engine.add_request("ok", "x", SamplingParams(max_tokens=5, ignore_eos=True))
    done = run_all(engine)
    assert done["bad"].error and "not defined" in done["bad"].error
    assert len(done["ok"].outputs[0].token_ids) == 5
    # aborting a request while its grammar compiles leaves nothing behind
    engine.add_request("gone", "x", SamplingParams(max_tokens=5, structured_outputs=StructuredOutputsParams(
        regex="[a-z]{1,3}q")))
    assert engine.abort("gone")
    assert not engine.core.compiling
    assert_no_leaks(engine)


def test_json_strings_never_hold_raw_control_characters():
    # xgrammar's maxLength strings allow U+0000-U+001F raw; JSON forbids them (json.loads refuses).
    from xgrammar.testing import _is_grammar_accept_string as accepts

    from pagedserve.engine.core.structured import _grammar

    so = StructuredOutputsParams
    grammar = _grammar(so(json={"type": "object", "properties": {"a": {"type": "string", "maxLength": 4}},
                                "required": ["a"]}))
    assert accepts(grammar, '{"a": "ab"}')
    assert not accepts(grammar, '{"a": "a\x11"}') and not accepts(grammar, '{"a": "\t"}')
    assert not accepts(_grammar(so(json_object=True)), '{"a": "\x01"}')
