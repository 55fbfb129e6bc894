"""OpenAI Responses API request bodies (pydantic), strict and bounded like the chat schema.

Text and function tools only: built-in tools (web search, file search, computer use), ``reasoning``,
``include``, ``background`` and ``conversation`` are refused by name; ``truncation`` only as
``disabled`` (a conversation longer than the context is a 400, never silently cut).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

# One set of bounds for both translations: the Messages API's.
from pagedserve.apis.anthropic_protocol import (MAX_BLOCKS, MAX_DESCRIPTION_CHARS, MAX_MESSAGES, MAX_OUTPUT_TOKENS,
                                                MAX_TOOLS, Id, Text, ToolName)

MAX_RESPONSE_ID_CHARS = 128
ResponseId = Annotated[str, Field(min_length=1, max_length=MAX_RESPONSE_ID_CHARS, pattern=r"^[A-Za-z0-9_-]+$")]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class TextPart(_Strict):
    """``input_text`` (what a user or system says) or ``output_text`` (an earlier answer sent back)."""

    type: Literal["input_text", "output_text"]
    text: Text
    annotations: Annotated[list[Any], Field(max_length=0)] | None = None
    logprobs: Annotated[list[Any], Field(max_length=0)] | None = None


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Text | Annotated[list[TextPart], Field(max_length=MAX_BLOCKS)]
    id: Id | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallItem(_Strict):
    """A call the model made, sent back with its output."""

    type: Literal["function_call"]
    call_id: Id
    name: ToolName
    arguments: Text
    id: Id | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: Id
    output: Text
    id: Id | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


def _item_kind(item: Any) -> str:
    """A message item may leave out its type (the SDK's shorthand ``{"role", "content"}``)."""
    kind = item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", "message")
    return kind if isinstance(kind, str) else "message"


# Told apart by type, so that a bad item gets one complaint, about its own fields.
InputItem = Annotated[Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                      | Annotated[FunctionCallOutputItem, Tag("function_call_output")], Discriminator(_item_kind)]


class FunctionTool(_Strict):
    type: Literal["function"]
    name: ToolName
    description: Annotated[str, Field(max_length=MAX_DESCRIPTION_CHARS)] | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(_Strict):
    type: Literal["function"]
    name: ToolName


class TextFormat(_Strict):
    """``text.format``: plain text, any JSON object, or JSON following ``schema``."""

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: ToolName | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: Annotated[str, Field(max_length=MAX_DESCRIPTION_CHARS)] | None = None
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None


class ResponsesRequest(_Strict):
    """``POST /v1/responses``."""

    model: Annotated[str, Field(max_length=1024)] | None = None
    input: Text | Annotated[list[InputItem], Field(max_length=MAX_MESSAGES)]
    instructions: Text | None = None
    previous_response_id: ResponseId | None = None
    store: bool = True
    stream: bool = False
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_OUTPUT_TOKENS)
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    truncation: Literal["disabled"] | None = None
    user: Annotated[str, Field(max_length=256)] | None = None
    metadata: Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
                        Field(max_length=16)] | None = None
