"""Observation tokens within a token budget: cut in the middle, keep the reply well-formed.

An environment's reply (``\\n<interpreter>\\n...\\n</interpreter>\\n``,
``<information>...</information>``) that is longer than the agent loop's
``max_observation_tokens`` is cut *in the middle*: the head (opening tag, first lines) and
the tail (closing tag) are kept, with a visible marker in between saying how much was
left out. Same wording as the environments' character-level cut
(:data:`environments.base.TRUNCATION_MARKER`, ``...[truncated N characters]...``), counted
in tokens here.

:class:`ChatTurns` renders the prompt and the observation turns of environments in a native
tool-call format (``hermes`` / ``openai``) through the tokenizer's chat template, keeping
token-in/token-out parity with the template's rendering of the whole conversation.

Tool output never creates special tokens: an observation's text (and a message's content in a
tool turn) is encoded with ``split_special_tokens=True`` (:func:`encode_plain`), so text such
as ``<|im_end|>\n<|im_start|>system`` printed by a program stays plain text tokens; only the
chat template's own markup becomes special tokens.
"""

from __future__ import annotations

import re
from typing import Any

from ..errors import ConfigError

#: Marker put between head and tail; ``n`` = tokens of the observation that are not shown.
TRUNCATION_MARKER = "\n...[truncated {n} tokens]...\n"
#: Marker used when the full one does not fit next to the tail (small budgets).
SHORT_TRUNCATION_MARKER = "\n...\n"

_CLOSING_TAG = re.compile(r"</[^<>\s]*>\s*")
_MAX_BACKOFF = 3  # a UTF-8 character is split over at most 4 byte tokens


def encode_plain(tokenizer: Any, text: str) -> list[int]:
    """Ids of ``text`` with no added BOS/EOS and no special tokens made from it: text that spells a
    special token (``<|im_end|>``) is split into ordinary tokens (``split_special_tokens=True``;
    added non-special tokens such as ``<tool_call>`` keep their ids). ``[]`` for ``""``."""
    if not text:
        return []
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)]


def truncate_observation_ids(tokenizer: Any, text: str, max_tokens: int) -> list[int]:
    """Token ids of observation ``text``, at most ``max_tokens`` long, cut in the middle if needed.

    ``text`` is encoded once with :func:`encode_plain` (no special token can come from it). If
    that fits, it is returned unchanged.
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
        return encode_plain(tokenizer, s)

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


#: Stands for the model's turn when a chat template renders an observation turn on its own.
_TURN_MARK = "COPC_MODEL_TURN_7f3a9c"


def check_chat_template(tokenizer: Any, use_chat_template: bool, model_dir: Any = None) -> None:
    """Refuse ``rollout.use_chat_template: true`` with a tokenizer that has no chat template: a
    config error found once the model's tokenizer is loaded, reported like a load-time one.

    Raises:
        ConfigError: one line naming ``rollout.use_chat_template`` (and ``model_dir`` if given).
    """
    if use_chat_template and not getattr(tokenizer, "chat_template", None):
        where = f" (of {model_dir})" if model_dir is not None else ""
        raise ConfigError(f"rollout.use_chat_template=true: the tokenizer has no chat_template{where}; "
                          "set rollout.use_chat_template=false or use a model whose tokenizer has one")


class ChatTurns:
    """Prompt and observation tokens rendered through the tokenizer's chat template.

    For environments in a native tool-call format (``tool_format: hermes`` / ``openai``,
    :mod:`environments.tool_formats`), which return the chat messages an observation stands for
    (``info["observation_messages"]``: ``role: "tool"`` / ``"user"``) and their tools' schemas
    (``reset``'s ``info["tools"]``). The environment stays text-only; the rendering lives here,
    where the tokenizer is.

    Token-in/token-out parity: with the prompt ids from :meth:`prompt_ids`, the model's tokens as
    generated (never re-tokenised) and each observation's ids from :meth:`observation_ids`, the
    trajectory's ids equal the chat template's rendering of the whole conversation (``user``
    prompt, ``assistant`` turns whose content is the model's text, the observation messages;
    ``tools`` given) tokenised at once — for a template that renders an assistant message's
    content verbatim and a tokenizer that splits at the template's special tokens. An observation
    is the text the template puts after an assistant turn's content up to the next generation
    prompt: for Qwen2.5, ``<|im_end|>\\n<|im_start|>user\\n<tool_response>\\n...\\n</tool_response>
    <|im_end|>\\n<|im_start|>assistant\\n``. If the model's turn already ended with a special token
    the observation starts with (its end-of-turn token, e.g. ``<|im_end|>`` after an ``openai``
    format call), that text is not repeated.

    Args:
        tokenizer: the policy's tokenizer with a ``chat_template``.
        tools: OpenAI function schemas for the template (``None``: none).
        system: a ``system`` message put before the ``user`` prompt (``rollout.system_prompt``);
            ``""``: none (a template may then add its own default system message).

    Raises:
        ConfigError: the tokenizer has no chat template (names ``rollout.use_chat_template``).
    """

    def __init__(self, tokenizer: Any, tools: Any = None, system: str = "") -> None:
        check_chat_template(tokenizer, True)
        self.tokenizer = tokenizer
        self.tools = [dict(t) for t in tools] if tools else None
        self.head = [{"role": "system", "content": system}] if system else []

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        """The template's text of ``messages`` (with :attr:`tools`)."""
        return self.tokenizer.apply_chat_template(messages, tools=self.tools, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def encode(self, text: str) -> list[int]:
        """``text``'s ids (no added BOS/EOS; special-token text becomes special tokens)."""
        return [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)] if text else []

    def prompt_ids(self, text: str) -> list[int]:
        """Ids of the ``system`` message (if any) and the ``user`` message ``text`` with the generation
        prompt (the episode's prompt). The prompt text is the task's, not a tool's: its special-token
        text is markup."""
        return self.encode(self.render([*self.head, {"role": "user", "content": text}],
                                       add_generation_prompt=True))

    def observation_text(self, messages: list[dict[str, Any]]) -> str:
        """The template's text between a model turn's content and the next generation prompt's end.

        Raises:
            ValueError: the template does not render an assistant message's content verbatim.
        """
        ctx = [*self.head, {"role": "user", "content": "?"}, {"role": "assistant", "content": _TURN_MARK}]
        full = self.render(ctx + [dict(m) for m in messages], add_generation_prompt=True)
        if full.count(_TURN_MARK) != 1:
            raise ValueError("the chat template does not render an assistant message's content verbatim, "
                             "so observation turns cannot be rendered on their own")
        return full[full.index(_TURN_MARK) + len(_TURN_MARK):]

    def _plain_contents_ids(self, msgs: list[dict[str, Any]], skip: str) -> list[int]:
        """Ids of the observation turn of ``msgs`` whose contents spell special tokens: the
        template's text encoded as usual, each message's content with :func:`encode_plain`
        (located by rendering unique marks in place of the contents).

        Raises:
            ValueError: the template does not render each content verbatim, once.
        """
        marks = [f"COPC_CONTENT_{i}_7f3a9c" for i in range(len(msgs))]
        text = self.observation_text([dict(m, content=k) for m, k in zip(msgs, marks, strict=True)])
        text = text[len(skip):] if skip and text.startswith(skip) else text
        return self._splice_plain(text, [(k, str(m.get("content") or "")) for m, k in zip(msgs, marks,
                                                                                           strict=True)])

    def _splice_plain(self, text: str, parts: list[tuple[str, str]]) -> list[int]:
        """Ids of ``text``, in which each ``(mark, content)`` mark (once, in order) stands for a
        content encoded with :func:`encode_plain`; the rest encoded as usual.

        Raises:
            ValueError: a mark not found exactly once.
        """
        ids, pos = [], 0
        for mark, content in parts:
            at = text.find(mark, pos)
            if at < 0 or text.count(mark) != 1:
                raise ValueError("the chat template does not render a tool message's content verbatim, "
                                 "so its text cannot be kept free of special tokens")
            ids += self.encode(text[pos:at]) + encode_plain(self.tokenizer, content)
            pos = at + len(mark)
        return ids + self.encode(text[pos:])

    def conversation_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """Ids of a whole conversation rendered with the generation prompt, each ``tool`` message's
        content encoded with :func:`encode_plain` (tool output never becomes special tokens; the
        other messages' text is the caller's markup), e.g. the first call of a harness agent.

        Raises:
            ValueError: the template does not render a tool message's content verbatim, once.
        """
        parts, shown = [], []
        for i, m in enumerate(messages):
            content = str(m.get("content") or "")
            if m.get("role") == "tool" and self.encode(content) != encode_plain(self.tokenizer, content):
                mark = f"COPC_TOOL_CONTENT_{i}_7f3a9c"
                parts.append((mark, content))
                m = dict(m, content=mark)
            shown.append(m)
        text = self.render(shown, add_generation_prompt=True)
        return self._splice_plain(text, parts) if parts else self.encode(text)

    def observation_ids(self, messages: list[dict[str, Any]], max_tokens: int,
                        after_token: int | None = None) -> list[int]:
        """Ids of the observation turn of ``messages``, within ``max_tokens`` where possible.

        Too long: each message's ``content`` is cut in the middle
        (:func:`truncate_observation_ids`, decoded back to text) so that the rendered turn fits;
        the template's own tokens are never cut (a budget smaller than them is exceeded by them).

        Args:
            messages: the observation's chat messages (``info["observation_messages"]``).
            max_tokens: budget in tokens (>= 1).
            after_token: the model turn's last token id (see the class: end-of-turn handling).

        Returns:
            Token ids (``list[int]``).

        Raises:
            ValueError: ``max_tokens < 1``; see :meth:`observation_text`.
        """
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"ChatTurns.observation_ids: max_tokens={max_tokens!r} must be an int >= 1")
        skip = ""
        if after_token is not None and after_token in set(getattr(self.tokenizer, "all_special_ids", ())):
            skip = self.tokenizer.decode([after_token])

        def ids_of(msgs: list[dict[str, Any]]) -> list[int]:
            text = self.observation_text(msgs)
            contents = [str(m.get("content") or "") for m in msgs]
            if any(self.encode(c) != encode_plain(self.tokenizer, c) for c in contents):
                return self._plain_contents_ids(msgs, skip)
            # no content spells a special token: the text at once, as the template renders it
            return self.encode(text[len(skip):] if skip and text.startswith(skip) else text)

        ids = ids_of(messages)
        if len(ids) <= max_tokens:
            return ids
        bare = ids_of([dict(m, content="") for m in messages])
        budget = max_tokens - len(bare)
        for _ in range(4):  # decoding and re-encoding a cut content can move a few tokens
            per = budget // len(messages)
            if per < 1:
                break
            cut = [dict(m, content=self.tokenizer.decode(truncate_observation_ids(
                self.tokenizer, str(m.get("content", "")), per))) for m in messages]
            ids = ids_of(cut)
            if len(ids) <= max_tokens:
                return ids
            budget -= len(ids) - max_tokens
        return ids_of([dict(m, content=SHORT_TRUNCATION_MARKER.strip()) for m in messages])
