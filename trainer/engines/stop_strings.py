"""Stop strings matched on the incrementally decoded text of generated tokens (any spelling)."""

from __future__ import annotations

from collections.abc import Sequence

#: Prompt tokens decoded in front of the generated ones (context only: never matched).
STOP_CONTEXT_TOKENS = 5
#: Most tokens held back while their text ends in an incomplete character (U+FFFD); a UTF-8
#: character has at most 4 bytes, so more pending tokens than this are released as they are.
STOP_MAX_PENDING_TOKENS = 4


class StopStringMatcher:
    """Finds stop strings in the decoded text of generated tokens, one token at a time.

    The text is detokenized *incrementally* (the scheme of vLLM's and SGLang's detokenizers):
    each step decodes only the tokens since the previous step plus the previous step's tokens
    as left context, and takes the new characters as the difference. The stop strings are then
    searched in the last ``len(longest stop) - 1`` characters of earlier text followed by the
    new characters, so a match is found at the token that *completes* it, whatever tokens
    spell it (``</code>`` as ``</ code >``, as 7 one-character tokens, or ending in the middle
    of a token such as ``>\\n``). Cost per token: two ``decode`` calls over a few tokens and a
    substring search over ``O(len(longest stop))`` characters — independent of how long the
    generation is (a fixed window of the last N *tokens* would miss spellings longer than N
    tokens; a window of ``max_stop_chars`` tokens would cost O(stop length) decoding per step
    and still depend on every token decoding to >= 1 character).

    Only generated text is matched: the prompt's last :data:`STOP_CONTEXT_TOKENS` tokens are
    decoding context (so a leading space or a split character decodes right) but a stop
    string that lies in the prompt, or starts in the prompt and ends in generated text, does
    not stop (like SGLang, which matches on output tokens only). Tokens whose text ends with an
    incomplete character (U+FFFD) are held back until the character completes (at most
    :data:`STOP_MAX_PENDING_TOKENS` tokens). Special tokens are decoded as their text
    (``skip_special_tokens=False``, as in :attr:`GenerationResult.text`); no clean-up of
    tokenization spaces.

    Args:
        tokenizer: ``decode(ids, skip_special_tokens=..., clean_up_tokenization_spaces=...) -> str``.
        stop: non-empty stop strings.
        context_ids: prompt token ids (only the last :data:`STOP_CONTEXT_TOKENS` are used).

    Raises:
        ValueError: if ``stop`` is empty or has an empty string.
    """

    def __init__(self, tokenizer, stop: Sequence[str], context_ids: Sequence[int] = ()) -> None:
        if not stop or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"StopStringMatcher: stop={stop!r} must be non-empty strings")
        self._tok = tokenizer
        self.stop = tuple(stop)
        self._keep = max(map(len, self.stop)) - 1  # chars of earlier text a match may start in
        # decode window: left context (already in the text), then ids not yet read
        self._ids = [int(t) for t in context_ids[max(len(context_ids) - STOP_CONTEXT_TOKENS, 0):]]
        self._read = len(self._ids)  # ids before this are already in the text
        self._tail = ""  # last ``_keep`` characters of the generated text so far

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def push(self, token_id: int) -> str | None:
        """Add one generated token (an id); return the stop string it completes, or None."""
        self._ids.append(int(token_id))
        prefix_text = self._decode(self._ids[: self._read])
        text = self._decode(self._ids)
        if text.endswith("\ufffd") and len(self._ids) - self._read < STOP_MAX_PENDING_TOKENS:
            return None  # an incomplete character: wait for its next byte(s)
        new = text[len(prefix_text):]
        del self._ids[: self._read]  # the ids that were read become the next left context
        self._read = len(self._ids)
        buf = self._tail + new
        for s in self.stop:  # an occurrence must end in ``new``: it starts after this index
            if s in buf[max(len(self._tail) - len(s) + 1, 0):]:
                return s
        self._tail = buf[-self._keep:] if self._keep else ""
        return None
