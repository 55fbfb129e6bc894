"""Anthropic Messages API request bodies (pydantic): what ``POST /v1/messages`` and
``POST /v1/messages/count_tokens`` accept, strictly and bounded, as the OpenAI schemas are.

Text only: image and document blocks, ``thinking`` and server tools are refused by name (the
models served here read text and call client-side functions). ``cache_control`` is accepted on
every block and ignored: the engine's prefix cache reuses any repeated prefix without being asked.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_TEXT_CHARS = 2**24  # as the OpenAI schema: the body limit is what usually binds
MAX_MESSAGES = 2048
MAX_BLOCKS = 1024  # content blocks of one message or one system prompt
MAX_TOOLS = 128
MAX_STOP_SEQUENCES = 16
MAX_STOP_CHARS = 256
MAX_ID_CHARS = 256
MAX_DESCRIPTION_CHARS = 8192
MAX_OUTPUT_TOKENS = 2**20

Text = Annotated[str, Field(max_length=MAX_TEXT_CHARS)]
Id = Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS)]
ToolName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class CacheControl(_Strict):
    """Accepted and ignored: prefix caching is automatic here."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(_Strict):
    type: Literal["text"]
    text: Text
    cache_control: CacheControl | None = None
    # What the SDK's own blocks carry when a response's content is sent back as it is: only empty.
    citations: Annotated[list[Any], Field(max_length=0)] | None = None


class ToolUseBlock(_Strict):
    """A call the assistant made, sent back in the conversation."""

    type: Literal["tool_use"]
    id: Id
    name: ToolName
    input: dict[str, Any]
    cache_control: CacheControl | None = None
    caller: None = None  # sent back by the SDK as null (server-tool callers are not supported)
    toolset_name: None = None


class ToolResultBlock(_Strict):
    """A tool's answer to the call ``tool_use_id`` (in a user message)."""

    type: Literal["tool_result"]
    tool_use_id: Id
    content: Text | Annotated[list[TextBlock], Field(max_length=MAX_BLOCKS)] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class InputMessage(_Strict):
    role: Literal["user", "assistant"]
    content: Text | Annotated[list[Block], Field(max_length=MAX_BLOCKS)]


class ToolDefinition(_Strict):
    """A client-side function: its arguments are a JSON schema."""

    type: Literal["custom"] | None = None
    name: ToolName
    description: Annotated[str, Field(max_length=MAX_DESCRIPTION_CHARS)] | None = None
    input_schema: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolChoice(_Strict):
    """auto (the model decides), any (some tool must be called), tool (this one), none."""

    type: Literal["auto", "any", "tool", "none"]
    name: ToolName | None = None
    disable_parallel_tool_use: bool | None = None


class Metadata(_Strict):
    user_id: Annotated[str, Field(max_length=256)] | None = None


class CountTokensRequest(_Strict):
    """``POST /v1/messages/count_tokens``: the prompt's tokens as the model would see them."""

    model: Annotated[str, Field(max_length=1024)]
    messages: Annotated[list[InputMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    system: Text | Annotated[list[TextBlock], Field(max_length=MAX_BLOCKS)] | None = None
    tools: Annotated[list[ToolDefinition], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None


class MessagesRequest(CountTokensRequest):
    """``POST /v1/messages``."""

    max_tokens: int = Field(..., ge=1, le=MAX_OUTPUT_TOKENS)
    stop_sequences: Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]],
                              Field(max_length=MAX_STOP_SEQUENCES)] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=0, le=2**20)
    metadata: Metadata | None = None
    cache_control: CacheControl | None = None  # the SDK's request-level form; ignored as on blocks


class ErrorDetail(BaseModel):
    type: str
    message: str


class ErrorResponse(BaseModel):
    """Anthropic's error body."""

    type: Literal["error"] = "error"
    error: ErrorDetail
