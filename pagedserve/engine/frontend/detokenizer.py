"""Incremental detokenization that never emits half a UTF-8 character, and stop strings."""

from __future__ import annotations

from dataclasses import dataclass

# Tokens of prompt context decoded with the output, so tokenizers that drop a leading space at
# the start of a decode (SentencePiece) still produce the right first word.
_CONTEXT_TOKENS = 5


@dataclass(eq=False)
class TextState:
    """One completion's text so far: its token ids (prompt included) and the decoding window."""

    token_ids: list[int]
    skip_special_tokens: bool = True
    output_text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0


class Detokenizer:
    """Turns each completion's new token ids into new text, one step at a time.

    It decodes a small window ``token_ids[prefix_offset:]`` and emits only what lies past the
    text of ``token_ids[prefix_offset:read_offset]``; while the window ends in an incomplete
    character (U+FFFD) it waits for the next token instead of emitting garbage.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        # A fast tokenizer's Rust backend decodes without transformers' per-call conversions,
        # which cost more than the decode itself on this per-token path.
        backend = getattr(tokenizer, "_tokenizer", None)
        self._decode = backend.decode if backend is not None else (
            lambda ids, skip_special_tokens: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))

    @staticmethod
    def start(prompt_token_ids: list[int], skip_special_tokens: bool = True) -> TextState:
        n = len(prompt_token_ids)
        return TextState(list(prompt_token_ids), skip_special_tokens, "", max(0, n - _CONTEXT_TOKENS), n)

    def update(self, state: TextState) -> str:
        """Append the newly decodable text (of tokens already appended to ``state.token_ids``) to
        ``state.output_text`` and return it."""
        skip, ids = state.skip_special_tokens, state.token_ids
        prefix_text = self._decode(ids[state.prefix_offset:state.read_offset], skip_special_tokens=skip)
        new_text = self._decode(ids[state.prefix_offset:], skip_special_tokens=skip)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text):]
        state.prefix_offset, state.read_offset = state.read_offset, len(ids)
        state.output_text += delta
        return delta


def find_stop_string(text: str, num_new_chars: int, stops: list[str]) -> tuple[str, int] | None:
    """The first stop string that now occurs in ``text`` (searching only where it can be new)."""
    if not num_new_chars:
        return None
    # Each stop string from the first position where it could overlap the new characters.
    found = [(stop, text.find(stop, max(0, len(text) - num_new_chars - len(stop) + 1))) for stop in stops]
    return min((f for f in found if f[1] != -1), key=lambda f: f[1], default=None)  # the earliest
