"""OpenAI request and response bodies (pydantic), plus the few fields vLLM adds.

Requests are validated strictly at the edge: JSON types must match (``"5"`` is not an integer),
unknown fields are refused with their name, and every piece of text a client sends (prompts,
message contents, stop strings) must be valid Unicode without control characters. Every field is
bounded to what the engine can hold (the bounds of :mod:`pagedserve.engine.sampling_params`, so
a value the sampler could not take is a 400 here, never a fault in a step): integers to their
ranges, floats finite (``NaN`` and ``Infinity``, which Python's JSON parser accepts, are refused),
strings and lists to a length. The schemas also make the app's OpenAPI document, which the fuzz
test drives.
"""

from __future__ import annotations

import re
import time
import unicodedata
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from pagedserve.engine.sampling_params import (
    LOGIT_BIAS_MAX,
    MAX_LOGIT_BIAS,
    MAX_CHOICE_CHARS,
    MAX_CHOICES,
    MAX_GRAMMAR_CHARS,
    MAX_LOGPROBS,
    MAX_N,
    MAX_STOP,
    MAX_STOP_CHARS,
    MAX_STOP_TOKEN_IDS,
    MAX_STREAM_INTERVAL,
    MAX_TOKEN_ID,
    MAX_TOKENS_LIMIT,
    MAX_TOP_K,
    PENALTY_MAX,
    REPETITION_PENALTY_MAX,
    SEED_MAX,
    SEED_MIN,
    TEMPERATURE_MAX,
)

# Control characters a prompt may legitimately contain.
_ALLOWED_CONTROL = {"\t", "\n", "\r"}
# Lengths of what is not a sampling parameter. The body limit (--max-body-bytes, 4 MiB by
# default) is what usually binds; these hold whatever that limit is raised to.
MAX_TEXT_CHARS = 2**24          # one prompt, message content or text part (16 Mi characters)
MAX_PROMPT_TOKENS = 2**24       # a prompt sent as token ids
MAX_PROMPTS = 64                # a list of prompts in one completions request
MAX_MESSAGES = 2048             # messages in one conversation
MAX_CONTENT_PARTS = 1024        # text parts of one message
MAX_NAME_CHARS = 256            # user, message name, tool_call_id, cache_salt
MAX_MODEL_CHARS = 1024          # a model name (a served path can be long)
MAX_TEMPLATE_KWARGS = 32        # chat_template_kwargs entries
MAX_TEMPLATE_KEY_CHARS = 64
MAX_TEMPLATE_VALUE_CHARS = 4096
MAX_REQUEST_ID_CHARS = 128
MAX_TOOLS = 128                 # tools offered in one request
MAX_TOOL_NAME_CHARS = 64        # OpenAI's bound on a function name
MAX_DESCRIPTION_CHARS = 8192    # a tool's or a schema's description
MAX_TOOL_CALLS = 128            # tool calls of one assistant message sent back


# Control characters (Unicode category Cc: U+0000-001F, U+007F-009F) other than tab, newline and CR.
_CONTROL = tuple(chr(c) for c in range(0xA0) if unicodedata.category(chr(c)) == "Cc" and chr(c) not in _ALLOWED_CONTROL)
_C0_BYTES = "".join(c for c in _CONTROL if ord(c) < 0x80).encode()  # one byte each in UTF-8
_C1_UTF8 = re.compile(b"\xc2[\x80-\x9f]")  # U+0080-009F in UTF-8


def _check_text(text: str) -> str:
    """Refuse lone surrogates (not encodable as UTF-8) and control characters other than tab/newline/CR.

    This runs on the event loop while the body is validated, for prompts of megabytes: every pass
    here is a C loop (encode, translate, a regex, str.find), a few ms for 4 MB. (A loop over the
    characters in Python took over a second for 4 MB, and stalled /health and every stream.)"""
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError as exc:  # only a lone surrogate fails to encode; exc.start is its index
        i = exc.start
        control = _first_control(text[:i])
        if control is None:
            raise ValueError(f"is not valid Unicode: lone surrogate U+{ord(text[i]):04X} at index {i}; "
                             "send valid UTF-8 text") from None
        i = control
    else:
        if len(data.translate(None, _C0_BYTES)) == len(data) and (b"\xc2" not in data or not _C1_UTF8.search(data)):
            return text
        i = _first_control(text)
        assert i is not None
    raise ValueError(f"contains control character U+{ord(text[i]):04X} at index {i}; remove it "
                     "(only tab, newline and carriage return are allowed)")


def _first_control(text: str) -> int | None:
    """Index of the first refused control character in ``text``, if any (one str.find per character)."""
    found = [i for i in (text.find(c) for c in _CONTROL) if i >= 0]
    return min(found) if found else None


# The length is checked before the characters are (cheaply, and with pydantic's "characters" message).
Text = Annotated[str, Field(max_length=MAX_TEXT_CHARS), AfterValidator(_check_text)]
Name = Annotated[str, Field(max_length=MAX_NAME_CHARS), AfterValidator(_check_text)]
StopText = Annotated[str, Field(max_length=MAX_STOP_CHARS), AfterValidator(_check_text)]
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
TokenIds = Annotated[list[TokenId], Field(max_length=MAX_PROMPT_TOKENS)]
Finite = Annotated[float, Field(allow_inf_nan=False)]
ModelName = Annotated[str, Field(max_length=MAX_MODEL_CHARS)]
TemplateValue = Annotated[str, Field(max_length=MAX_TEMPLATE_VALUE_CHARS)] | int | Finite | bool | None


class _Strict(BaseModel):
    # strict: JSON types must match exactly; forbid: a misspelt field is an error, not a silent no-op.
    model_config = ConfigDict(strict=True, extra="forbid")


GrammarText = Annotated[str, Field(min_length=1, max_length=MAX_GRAMMAR_CHARS), AfterValidator(_check_text)]
ChoiceText = Annotated[str, Field(min_length=1, max_length=MAX_CHOICE_CHARS), AfterValidator(_check_text)]
Choices = Annotated[list[ChoiceText], Field(min_length=1, max_length=MAX_CHOICES)]
# A JSON schema as an object (or its JSON text); its size is checked once serialized (MAX_GRAMMAR_CHARS).
JsonSchema = dict[str, Any] | GrammarText
FunctionName = Annotated[str, Field(min_length=1, max_length=MAX_TOOL_NAME_CHARS, pattern=r"^[A-Za-z0-9_.-]+$")]


class JsonSchemaFormat(_Strict):
    """``response_format.json_schema``: OpenAI's structured outputs."""

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)
    name: FunctionName = Field("response", description="The schema's name (letters, digits, _ . -).")
    description: Annotated[str, Field(max_length=MAX_DESCRIPTION_CHARS)] | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description=(
        f"The JSON schema the output must validate against (at most {MAX_GRAMMAR_CHARS} characters as JSON)."))
    strict: bool | None = Field(None, description="Accepted; the output always follows the schema.")


class ResponseFormat(_Strict):
    """``response_format``: plain text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(_Strict):
    """vLLM's ``structured_outputs``: exactly one constraint on the output."""

    json_: JsonSchema | None = Field(None, alias="json", description="A JSON schema.")
    regex: GrammarText | None = None
    choice: Choices | None = None
    grammar: GrammarText | None = Field(None, description="An EBNF grammar (xgrammar's dialect; rule root).")
    json_object: bool | None = None

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)


class StreamOptions(_Strict):
    """``stream_options``: with ``include_usage`` a last chunk before ``[DONE]`` carries usage."""

    include_usage: bool = False


class SamplingFields(_Strict):
    """Fields shared by completions and chat completions."""

    model: ModelName | None = Field(None, description="Served model name (see GET /v1/models); default: the one model.")
    n: int = Field(1, ge=1, le=MAX_N, description="Completions to generate for the prompt (at most the server's "
                                                   "max_num_seqs, which run side by side).")
    temperature: float | None = Field(None, ge=0.0, le=TEMPERATURE_MAX, allow_inf_nan=False,
                                      description="0 = greedy; default 1.0.")
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=-1, le=MAX_TOP_K,
                              description="-1 or 0 disables; a value at or above the vocabulary size keeps every token.")
    min_p: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False)
    presence_penalty: float | None = Field(None, ge=-PENALTY_MAX, le=PENALTY_MAX, allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, ge=-PENALTY_MAX, le=PENALTY_MAX, allow_inf_nan=False)
    repetition_penalty: float | None = Field(None, gt=0.0, le=REPETITION_PENALTY_MAX, allow_inf_nan=False)
    # int64, as vLLM: the engine seeds completion i with seed + i, which stays in torch's range.
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX, description="Per-request sampling seed (any int64).")
    stop: StopText | Annotated[list[StopText], Field(max_length=MAX_STOP)] | None = Field(
        None, description=f"Up to {MAX_STOP} stop strings of at most {MAX_STOP_CHARS} characters.")
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = Field(
        None, description=f"Up to {MAX_STOP_TOKEN_IDS} token ids that end the output.")
    ignore_eos: bool = Field(False, description="Keep generating past the EOS token (benchmarks).")
    min_tokens: int = Field(0, ge=0, le=MAX_TOKENS_LIMIT,
                            description="Tokens to generate before EOS/stop may end the output.")
    include_stop_str_in_output: bool = Field(False, description="Keep the stop string that ended the output in its text.")
    skip_special_tokens: bool = Field(True, description="Leave special tokens out of the output text.")
    prompt_logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS,
        description=f"vLLM's: for each prompt token its logprob, rank and the top N (0-{MAX_LOGPROBS}) alternatives "
                    "(the first token gets null). The request then skips the prefix cache; not with stream=true.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    stream_interval: int | None = Field(
        None, ge=1, le=MAX_STREAM_INTERVAL,
        description="Stream one event per this many new tokens (the first token at once, the finish flushes the "
                    "rest): fewer events and writes per token for a client that needs no per-token updates. The "
                    "server's --stream-interval is a floor. A pagedserve extension; the gateway sets it per tier.")
    priority: int = Field(0, ge=-(2**31), le=2**31 - 1,
                          description="Engine priority: lower is served sooner (vLLM's convention).")
    cache_salt: Name | None = Field(None, min_length=1,
                                    description="Prefix-cache namespace: only requests with the same salt share cached blocks.")
    user: Name | None = Field(None, description="End-user id (accepted for compatibility; logged only).")
    request_id: str | None = Field(None, min_length=1, max_length=MAX_REQUEST_ID_CHARS, pattern=r"^[A-Za-z0-9_.:-]+$",
                                   description="Caller-chosen request id (default: generated).")
    # Keys are token ids written as strings (JSON object keys), as OpenAI takes them.
    logit_bias: Annotated[dict[Annotated[str, Field(pattern=r"^[0-9]{1,10}$")],
                               Annotated[float, Field(ge=-LOGIT_BIAS_MAX, le=LOGIT_BIAS_MAX, allow_inf_nan=False)]],
                          Field(max_length=MAX_LOGIT_BIAS)] | None = Field(
        None, description=f"Token id (as a string) -> bias in [-{LOGIT_BIAS_MAX:g}, {LOGIT_BIAS_MAX:g}] added to its "
                          f"logit before sampling; at most {MAX_LOGIT_BIAS} entries, ids below the vocabulary size.")
    # OpenAI's bounds: 16 pairs, keys up to 64 characters, values up to 512.
    metadata: Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
                        Field(max_length=16)] | None = Field(None, description="Accepted and ignored.")
    store: bool | None = Field(None, description="Accepted and ignored.")
    service_tier: str | None = Field(None, max_length=32, description="Accepted and ignored.")
    # Structured output: at most one of these per request (pagedserve.server.structured maps them).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: JsonSchema | None = Field(None, description="Older vLLM name of structured_outputs.json.")
    guided_regex: GrammarText | None = Field(None, description="Older vLLM name of structured_outputs.regex.")
    guided_choice: Choices | None = Field(None, description="Older vLLM name of structured_outputs.choice.")
    guided_grammar: GrammarText | None = Field(None, description="Older vLLM name of structured_outputs.grammar.")


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``. ``prompt`` is text, token ids, or a list of either (several prompts:
    prompt ``i``'s choice ``j`` has index ``i * n + j``, as OpenAI numbers them)."""

    prompt: Text | TokenIds | Annotated[list[Text], Field(max_length=MAX_PROMPTS)] \
        | Annotated[list[TokenIds], Field(max_length=MAX_PROMPTS)] = Field(
            ..., description=f"Text, a list of token ids, or a list of up to {MAX_PROMPTS} prompts (texts or token-id "
                             "lists); prompts x n (or best_of) completions must fit max_num_seqs.")
    max_tokens: int | None = Field(16, ge=0, le=MAX_TOKENS_LIMIT,
                                   description="Tokens to generate; null = up to max_model_len; 0 only with echo "
                                               "(the prompt and its logprobs, nothing generated).")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="Top logprobs per token.")
    echo: bool = Field(False, description="Prepend the prompt to each choice's text; with logprobs, the prompt "
                                          "tokens' logprobs come first (the first one null).")
    best_of: int | None = Field(None, ge=1, le=MAX_N, description="Only best_of == n is supported.")
    suffix: str | None = Field(None, max_length=MAX_TEXT_CHARS, description="Not supported: only null or empty is accepted.")


class TextPart(_Strict):
    """One text part of a message's ``content`` list."""

    type: Literal["text"]
    text: Text


class FunctionCall(_Strict):
    """A called function: its name and its arguments as JSON text."""

    name: FunctionName
    arguments: Annotated[str, Field(max_length=MAX_TEXT_CHARS)]


class ToolCall(_Strict):
    """One tool call of an assistant message (as the response gives it, and as a client sends it back)."""

    id: Name
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(_Strict):
    """A function the model may call; ``parameters`` is a JSON schema of its arguments."""

    name: FunctionName
    description: Annotated[str, Field(max_length=MAX_DESCRIPTION_CHARS)] | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    """One entry of ``tools``."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: FunctionName


class NamedToolChoice(_Strict):
    """``tool_choice`` naming the one function to call."""

    type: Literal["function"]
    function: NamedFunction


class ChatMessage(_Strict):
    """One chat message; ``content`` is text or a list of text parts."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | Annotated[list[TextPart], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    name: Name | None = None
    tool_call_id: Name | None = None
    # An assistant message's tool calls, sent back with the tools' results (role "tool") after it.
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOL_CALLS)] | None = None
    # Fields the openai client sends back when a response message is appended to the conversation;
    # accepted when empty.
    refusal: str | None = Field(None, max_length=MAX_TEXT_CHARS)
    function_call: dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    annotations: list[Any] | None = Field(None, max_length=MAX_CONTENT_PARTS)


Messages = Annotated[list[ChatMessage], Field(max_length=MAX_MESSAGES)]


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``: the tokenizer's chat template turns ``messages`` into a prompt."""

    messages: Messages = Field(..., description=f"The conversation; must not be empty (at most {MAX_MESSAGES} messages).")
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT, description="Deprecated alias of max_completion_tokens.")
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT,
                                              description="Tokens to generate; null = up to max_model_len.")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = Field(
        None, description=f"Functions the model may call (at most {MAX_TOOLS}); the chat template receives them.")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="none, auto (needs --enable-auto-tool-choice), required, or a named function; "
                          "default: auto where enabled and tools are given, else none.")
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call (required / auto).")
    add_generation_prompt: bool = True
    chat_template_kwargs: Annotated[dict[Annotated[str, Field(max_length=MAX_TEMPLATE_KEY_CHARS)], TemplateValue],
                                    Field(max_length=MAX_TEMPLATE_KWARGS)] | None = Field(
        None, description=f"Extra variables for the chat template (e.g. enable_thinking): up to {MAX_TEMPLATE_KWARGS} "
                          f"scalars, strings up to {MAX_TEMPLATE_VALUE_CHARS} characters.")


class DetokenizeRequest(_Strict):
    """``POST /detokenize`` (vLLM's): the text of token ids."""

    model: ModelName | None = None
    tokens: TokenIds


class TokenizeRequest(_Strict):
    """``POST /tokenize`` (vLLM's): count the tokens of a prompt or of chat messages."""

    model: ModelName | None = None
    prompt: Text | None = None
    messages: Messages | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


# ---- responses --------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    """Prompt tokens served from the prefix cache."""

    cached_tokens: int = 0


class Usage(BaseModel):
    """Token counts; ``total_tokens == prompt_tokens + completion_tokens``."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class CompletionLogprobs(BaseModel):
    """Completions-style logprobs: parallel lists, one entry per generated token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's entry of ``prompt_logprobs``: a token's logprob, its rank (1 = most likely) and text."""

    logprob: float
    rank: int | None = None
    decoded_token: str


# One entry per prompt token (null for the first): token id (a JSON key) -> its entry; the prompt
# token itself and the top alternatives.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    """One of the ``n`` completions of ``/v1/completions``."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(BaseModel):
    """The body of a non-streamed ``/v1/completions`` answer (chunks use the same shape)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class TopLogprob(BaseModel):
    """One candidate token and its log-probability."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    """A generated token's log-probability and the top alternatives."""

    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    """Chat-style logprobs: one entry per generated token."""

    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    """The assistant's message in a non-streamed chat answer."""

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A tool call's part in a streamed chunk; the client joins the parts of one ``index``."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class ChatDelta(BaseModel):
    """The new part of the assistant's message in one streamed chunk."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChoice(BaseModel):
    """One of the ``n`` choices of a non-streamed chat answer."""

    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatStreamChoice(BaseModel):
    """One choice's delta in a streamed chat chunk."""

    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionResponse(BaseModel):
    """The body of a non-streamed ``/v1/chat/completions`` answer."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed chat answer."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    """The served model as ``/v1/models`` lists it, with pagedserve's extra fields."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedserve"
    root: str | None = None
    max_model_len: int | None = None
    random_weights: bool = False
    description: str | None = None


class ModelList(BaseModel):
    """``GET /v1/models``."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    """``POST /tokenize``: the token ids, their count and the context limit."""

    count: int
    tokens: list[int]
    max_model_len: int


class DetokenizeResponse(BaseModel):
    """``POST /detokenize``: the decoded text."""

    prompt: str


class VersionResponse(BaseModel):
    """``GET /version``."""

    version: str


class ErrorInfo(BaseModel):
    """The fields of OpenAI's error object."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body."""

    error: ErrorInfo
