"""Schema-driven fuzzing (schemathesis) of every endpoint in the app's OpenAPI document: valid and
invalid bodies alike must never get a 5xx. Bounded in time so the suite stays fast."""

from __future__ import annotations

import contextlib
import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

FUZZ_SECONDS = 20.0
MAX_EXAMPLES_PER_MODE = 50


class _OutOfTime(Exception):
    """Raised by a fuzzed call once its time share is spent. Hypothesis, generating only (no shrink
    phase), stops at the first exception; a call that merely returned would still have it generate,
    and throw away, the rest of max_examples: slow for the larger request schemas."""


def test_no_5xx_for_generated_requests(server_url: str) -> None:
    schema = schemathesis.openapi.from_url(f"{server_url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize",
                                              "/version", "/load", "/v1/messages", "/v1/messages/count_tokens",
                                              "/v1/responses", "/v1/responses/{response_id}"}
    budget = FUZZ_SECONDS / (2 * len(operations))  # every operation and mode gets its share
    failures: list[str] = []
    calls = 0
    for op in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            deadline = time.monotonic() + budget

            @given(case=op.as_strategy(generation_mode=mode))
            @settings(max_examples=MAX_EXAMPLES_PER_MODE, deadline=None, database=None, phases=[Phase.generate],
                      suppress_health_check=list(HealthCheck))
            def call(case: schemathesis.Case) -> None:
                nonlocal calls
                if time.monotonic() > deadline:
                    raise _OutOfTime
                if isinstance(case.body, dict) and op.path.startswith("/v1/"):
                    # Keep generated work small: fuzzing is about input handling, not long generations.
                    for field in ("n", "best_of"):
                        if isinstance(case.body.get(field), int) and case.body[field] > 4:
                            case.body[field] = 4
                    if isinstance(case.body.get("prompt"), list) and len(case.body["prompt"]) > 4 \
                            and isinstance(case.body["prompt"][0], (str, list)):
                        case.body["prompt"] = case.body["prompt"][:4]  # several prompts: a few are enough
                    if "max_tokens" in case.body and isinstance(case.body["max_tokens"], int):
                        case.body["max_tokens"] = min(case.body["max_tokens"], 8) if case.body["max_tokens"] > 0 \
                            else case.body["max_tokens"]
                    if isinstance(case.body.get("max_output_tokens"), int) and case.body["max_output_tokens"] > 8:
                        case.body["max_output_tokens"] = 8  # the Responses API's cap
                    if op.path == "/v1/responses":
                        case.body.setdefault("max_output_tokens", 8)
                    else:
                        case.body.setdefault("max_tokens", 8)
                    case.body.pop("max_completion_tokens", None)
                response = case.call(base_url=server_url, timeout=30)
                calls += 1
                if response.status_code >= 500:
                    failures.append(f"{op.method.upper()} {op.path} {response.status_code}: "
                                    f"{case.body!r} -> {response.text[:300]}")

            try:
                call()
            except _OutOfTime:
                pass
            except Exception as exc:  # a generation problem in schemathesis itself is not our 5xx
                if "Unsatisfiable" not in type(exc).__name__:
                    raise
    assert calls >= 20, f"the fuzzer made only {calls} calls"
    assert not failures, "\n".join(failures[:10])


@pytest.mark.parametrize("path", ["/openapi.json", "/docs"])
def test_openapi_document_served(server_url: str, http: httpx.Client, path: str) -> None:
    assert http.get(f"{server_url}{path}", timeout=10).status_code == 200


# Schema-like JSON: the keywords a JSON schema uses, with values of any JSON type, so most bodies
# are nonsense schemas (400) and some compile and run (200); none may be a 5xx.
_KEYWORDS = ["type", "properties", "items", "enum", "required", "minimum", "maxLength", "anyOf", "$ref",
             "pattern", "const", "additionalProperties", "minItems", "format"]
_JSON = st.recursive(st.none() | st.booleans() | st.integers(-3, 3) | st.text(max_size=6)
                     | st.sampled_from(["object", "string", "integer", "array", "number", "boolean"]),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
                         st.sampled_from(_KEYWORDS) | st.text(max_size=4), inner, max_size=4), max_leaves=10)
_SCHEMA = st.dictionaries(st.sampled_from(_KEYWORDS), _JSON, max_size=4)
_TOOL = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": st.sampled_from(["f", "g", "get_weather"])}, optional={"parameters": _SCHEMA})})
_CONSTRAINTS = st.one_of(
    st.fixed_dictionaries({"guided_json": _SCHEMA}),
    st.fixed_dictionaries({"guided_regex": st.text(max_size=16)}),
    st.fixed_dictionaries({"guided_grammar": st.text(max_size=24).map(lambda t: "root ::= " + t)}),
    st.fixed_dictionaries({"guided_choice": st.lists(st.text(max_size=5), max_size=4)}),
    st.fixed_dictionaries({"structured_outputs": st.dictionaries(
        st.sampled_from(["json", "regex", "choice", "grammar", "json_object"]), _JSON, max_size=2)}),
    st.fixed_dictionaries({"response_format": st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "json_schema", "xml"])},
        optional={"json_schema": st.fixed_dictionaries({"name": st.just("x")}, optional={"schema": _SCHEMA})})}),
    st.fixed_dictionaries({"tools": st.lists(_TOOL, max_size=3)}, optional={"tool_choice": st.one_of(
        st.sampled_from(["none", "auto", "required", "any"]),
        st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
            {"name": st.sampled_from(["f", "g", "h"])})}))}),
)


def test_no_5xx_for_generated_constraints(server_url: str, http: httpx.Client) -> None:
    """Structured-output and tool fields with generated specs: a 400 or an answer, never a 5xx."""
    # The grammar backend's first request compiles the tokenizer's vocabulary (seconds on 2 cores):
    # done before the clock starts, so a run of this test alone fuzzes as long as one after others.
    warm = http.post(f"{server_url}/v1/completions",
                     json={"prompt": "hi", "max_tokens": 2, "guided_choice": ["a", "b"]}, timeout=120)
    assert warm.status_code == 200, warm.text
    deadline = time.monotonic() + 12.0
    failures: list[str] = []
    statuses: list[int] = []

    @given(extra=_CONSTRAINTS, chat=st.booleans())
    @settings(max_examples=150, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    def call(extra: dict, chat: bool) -> None:
        if time.monotonic() > deadline:
            raise _OutOfTime
        if not chat and "tools" in extra:
            chat = True
        path, body = (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}) if chat
                      else ("/v1/completions", {"prompt": "hi"}))
        r = http.post(f"{server_url}{path}", json={**body, "max_tokens": 8, **extra}, timeout=60)
        statuses.append(r.status_code)
        if r.status_code >= 500:
            failures.append(f"{path} {extra!r} -> {r.status_code} {r.text[:300]}")

    with contextlib.suppress(_OutOfTime):
        call()
    assert not failures, "\n".join(failures[:10])
    assert {200, 400} <= set(statuses), f"{len(statuses)} calls: {sorted(set(statuses))}"
