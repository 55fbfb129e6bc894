"""Incremental detokenization that never emits half a UTF-8 character, and stop strings."""

from __future__ import annotations

from pagedserve.engine.sequence import Sequence

# Tokens of prompt context decoded with the output, so tokenizers that drop a leading space at
# the start of a decode (SentencePiece) still produce the right first word.
_CONTEXT_TOKENS = 5


class Detokenizer:
    """Turns each sequence's new token ids into new text, one step at a time.

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

    def start(self, seq: Sequence) -> None:
        seq.read_offset = seq.num_prompt_tokens
        seq.prefix_offset = max(0, seq.num_prompt_tokens - _CONTEXT_TOKENS)

    def update(self, seq: Sequence) -> str:
        """Append the newly decodable text to ``seq.output_text`` and return it."""
        skip = seq.request.params.skip_special_tokens
        ids = seq.token_ids
        prefix_text = self._decode(ids[seq.prefix_offset:seq.read_offset], skip_special_tokens=skip)
        new_text = self._decode(ids[seq.prefix_offset:], skip_special_tokens=skip)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text):]
        seq.prefix_offset, seq.read_offset = seq.read_offset, len(ids)
        seq.output_text += delta
        return delta


def find_stop_string(seq: Sequence, num_new_chars: int) -> tuple[str, int] | None:
    """The first stop string that now occurs in the output (searching only where it can be new)."""
    stops = seq.request.params.stop
    if not stops or not num_new_chars:
        return None
    text = seq.output_text
    best: tuple[str, int] | None = None
    for stop in stops:
        start = max(0, len(text) - num_new_chars - len(stop) + 1)
        idx = text.find(stop, start)
        if idx != -1 and (best is None or idx < best[1]):
            best = (stop, idx)
    return best
