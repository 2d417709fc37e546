"""Observation tokens within a token budget: cut in the middle, keep the reply well-formed.

An environment's reply (``\\n<interpreter>\\n...\\n</interpreter>\\n``,
``<information>...</information>``) that is longer than the agent loop's
``max_observation_tokens`` is cut *in the middle*: the head (opening tag, first lines) and
the tail (closing tag) are kept, with a visible marker in between saying how much was
left out. Same wording as the environments' character-level cut
(:data:`environments.base.TRUNCATION_MARKER`, ``...[truncated N characters]...``), counted
in tokens here.
"""

from __future__ import annotations

import re
from typing import Any

#: Marker put between head and tail; ``n`` = tokens of the observation that are not shown.
TRUNCATION_MARKER = "\n...[truncated {n} tokens]...\n"
#: Marker used when the full one does not fit next to the tail (small budgets).
SHORT_TRUNCATION_MARKER = "\n...\n"

_CLOSING_TAG = re.compile(r"</[^<>\s]*>\s*")
_MAX_BACKOFF = 3  # a UTF-8 character is split over at most 4 byte tokens


def truncate_observation_ids(tokenizer: Any, text: str, max_tokens: int) -> list[int]:
    """Token ids of observation ``text``, at most ``max_tokens`` long, cut in the middle if needed.

    ``text`` is encoded once without special tokens. If that fits, it is returned unchanged.
    Otherwise the result is ``head + marker + tail`` (each encoded on its own, their lengths
    summed, so the budget holds exactly for any tokenizer):

    * tail: the trailing closing tag with the whitespace after it (``</interpreter>\\n``),
      found as the last ``</`` when only ``</name>`` and whitespace follow it; with no such tag,
      the last non-empty line if it takes at most half the tokens left after the marker, else
      that many last tokens of the encoding;
    * marker: :data:`TRUNCATION_MARKER` with ``n`` = tokens of the full encoding that are not
      shown (its length minus the head and tail tokens kept);
    * head: the first tokens of the full encoding, as many as fit, backed off a little so
      that it does not end inside a multi-byte character.

    Small budgets degrade in this order, never exceeding ``max_tokens``:
    (1) as above, when the head gets at least ``max(1, max_tokens // 4)`` tokens; (2) otherwise
    :data:`SHORT_TRUNCATION_MARKER` (no count) between head and tail, with as much head as fits
    (possibly none);
    (3) when even the short marker and the tail do not fit: the last ``max_tokens`` tokens of
    the encoding (the closing tag, or as much of its end as fits; no marker).

    Args:
        tokenizer: the policy's tokenizer (``encode(text, add_special_tokens=False)``, ``decode``).
        text: the observation text (characters).
        max_tokens: budget in tokens, >= 1.

    Returns:
        Token ids (``list[int]``), ``len <= max_tokens``.

    Raises:
        ValueError: if ``max_tokens < 1``.
    """
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"truncate_observation_ids: max_tokens={max_tokens!r} must be an int >= 1")

    def enc(s: str) -> list[int]:
        return [int(t) for t in tokenizer.encode(s, add_special_tokens=False)] if s else []

    ids = enc(text)
    if len(ids) <= max_tokens:
        return ids
    has_fffd = "\ufffd" in text  # then a trailing U+FFFD is real text, not a split character
    k = text.rfind("</")
    if k >= 0 and _CLOSING_TAG.fullmatch(text, k):
        struct_tail, is_tag = enc(text[k:]), True
    else:
        struct_tail, is_tag = enc(text[text.rstrip().rfind("\n") + 1:]), False

    for marker, min_head in ((TRUNCATION_MARKER, max(1, max_tokens // 4)), (SHORT_TRUNCATION_MARKER, 0)):
        avail = max_tokens - len(enc(marker.format(n=len(ids))))
        tail = struct_tail
        if not is_tag and len(tail) > avail // 2:
            tail = _clean_start(tokenizer, ids[len(ids) - avail // 2:] if avail >= 2 else [], has_fffd)
        h = avail - len(tail)
        if h < min_head:
            continue
        while True:  # the marker's digits depend on the head length: shrink until it fits
            head = _clean_end(tokenizer, ids[:h], has_fffd)
            mk = enc(marker.format(n=len(ids) - len(head) - len(tail)))
            over = len(head) + len(mk) + len(tail) - max_tokens
            if over <= 0:
                return head + mk + tail
            h = len(head) - over
            if h < min_head:
                break
    return ids[-max_tokens:]


def _clean_end(tokenizer: Any, head: list[int], has_fffd: bool) -> list[int]:
    """Drop up to 3 last tokens while ``head`` decodes to an incomplete character."""
    for _ in range(_MAX_BACKOFF):
        if has_fffd or not head or not tokenizer.decode(head).endswith("\ufffd"):
            break
        head = head[:-1]
    return head


def _clean_start(tokenizer: Any, tail: list[int], has_fffd: bool) -> list[int]:
    """Drop up to 3 first tokens while ``tail`` decodes starting inside a character."""
    for _ in range(_MAX_BACKOFF):
        if has_fffd or not tail or not tokenizer.decode(tail).startswith("\ufffd"):
            break
        tail = tail[1:]
    return tail
