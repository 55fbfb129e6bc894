"""Which tool-call format a model writes, read from its chat template.

A chat template that renders tool calls shows the model's format: Hermes / Qwen templates wrap
each call in ``<tool_call>`` … ``</tool_call>``; Llama 3.1+ templates write a JSON object with
``"parameters"`` after ``<|python_tag|>`` or in the ``ipython`` role's turn. Where the template
shows one of them, ``tool_choice: "auto"`` works without ``--enable-auto-tool-choice``, read with
that format's parser (``--tool-call-parser``, given explicitly, still decides the parser).
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def infer_tool_parser(template: str | None) -> str | None:
    """The parser name (:data:`pagedserve.server.tool_parsers.PARSERS`) the template's format needs,
    or None when it shows no tool-call format this server reads."""
    if not template:
        return None
    if "<tool_call>" in template and "</tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or ("ipython" in template and '"parameters"' in template):
        return "llama3_json"
    return None


def auto_tool_parser(template: str | None, flag_parser: str | None, flag_enabled: bool) -> str | None:
    """The parser ``tool_choice: "auto"`` uses, or None when ``auto`` is refused: the flags' (when
    --enable-auto-tool-choice is given), else the one the template shows (logged once)."""
    if flag_enabled:
        return flag_parser or "hermes"
    inferred = infer_tool_parser(template)
    if inferred is not None:
        chosen = flag_parser or inferred
        logger.info('tool_choice "auto" enabled: the chat template shows the %s tool-call format (parser %s)',
                    inferred, chosen)
        return chosen
    return None
