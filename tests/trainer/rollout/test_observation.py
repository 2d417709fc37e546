"""Observation truncation: within the token budget, closing tag kept, visible marker (issue 9)."""

from __future__ import annotations

import re

import pytest
from bpe_tokenizer import bpe_tokenizer

from environments.base import TRUNCATION_MARKER as ENV_MARKER
from trainer.models.tiny import build_byte_tokenizer
from trainer.rollout.observation import SHORT_TRUNCATION_MARKER, TRUNCATION_MARKER, truncate_observation_ids

TOKENIZERS = {"byte": build_byte_tokenizer, "bpe": bpe_tokenizer}
MARKER_RE = re.compile(r"\n\.\.\.\[truncated (\d+) tokens\]\.\.\.\n")


def interpreter_reply(n_chars: int = 500) -> str:
    """A ``<interpreter>`` reply (the math tool's format) of ``n_chars`` characters."""
    body = "\n".join(f"row {i}: {i * 7919 % 1000:03d}" for i in range(200))
    body = body[: n_chars - 31].rstrip("\n").ljust(n_chars - 31, "0")  # the tool strips the end
    reply = f"\n<interpreter>\n{body}\n</interpreter>\n"
    assert len(reply) == n_chars and reply.startswith("\n<interpreter>\n")
    return reply


def enc(tok, s):
    return tok.encode(s, add_special_tokens=False)


@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_500_chars_in_64_tokens_head_marker_closing_tag(name):
    tok = TOKENIZERS[name]()
    text = interpreter_reply(500)
    full = enc(tok, text)
    assert len(full) > 64
    ids = truncate_observation_ids(tok, text, 64)
    out = tok.decode(ids)
    assert len(ids) <= 64
    m = MARKER_RE.search(out)
    assert m is not None
    head, tail = out[: m.start()], out[m.end():]
    assert out.startswith("\n<interpreter>\n") and text.startswith(head)
    assert tail == "</interpreter>\n" and out.endswith("\n</interpreter>\n")
    # n = tokens of the full encoding that are not shown; the three parts add up to the ids
    head_ids, marker_ids, tail_ids = enc(tok, head), enc(tok, m.group(0)), enc(tok, tail)
    assert ids == head_ids + marker_ids + tail_ids
    assert int(m.group(1)) == len(full) - len(head_ids) - len(tail_ids)
    assert len(ids) >= 64 - 3  # the budget is used (the head backs off at most a few tokens)
    if name == "byte":  # one token per byte: n is exactly the number of characters cut out
        assert len(ids) == 64 and int(m.group(1)) == len(text) - len(head) - len(tail)


@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_fitting_observation_is_unchanged(name):
    tok = TOKENIZERS[name]()
    text = interpreter_reply(120)
    full = enc(tok, text)
    assert truncate_observation_ids(tok, text, len(full)) == full
    assert truncate_observation_ids(tok, text, 10_000) == full
    cut = truncate_observation_ids(tok, text, len(full) - 1)
    assert len(cut) <= len(full) - 1 and tok.decode(cut).endswith("</interpreter>\n")
    assert truncate_observation_ids(tok, "", 1) == []


@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_every_budget_stays_within_and_degrades_in_order(name):
    """Budgets 1..full: never over; closing tag whenever it fits; a marker whenever
    marker + tag fit; the counted marker once the head gets a quarter of the budget."""
    tok = TOKENIZERS[name]()
    text = interpreter_reply(500)
    full = enc(tok, text)
    tag = enc(tok, "</interpreter>\n")
    short = enc(tok, SHORT_TRUNCATION_MARKER)
    for budget in range(1, len(full) + 2):
        ids = truncate_observation_ids(tok, text, budget)
        out = tok.decode(ids)
        assert len(ids) <= budget, budget
        if budget >= len(full):
            assert ids == full
            continue
        if budget >= len(tag):
            assert out.endswith("</interpreter>\n"), (budget, out)
        if budget >= len(tag) + len(short):
            assert "\n...\n" in out or MARKER_RE.search(out), (budget, out)
        else:  # too small for any marker: the end of the reply
            assert ids == full[-budget:]
        m = MARKER_RE.search(out)
        if m:
            assert len(enc(tok, out[: m.start()])) >= budget // 4
        if budget >= 64:
            assert m is not None and out.startswith("\n<interpreter>\n")


def test_search_reply_and_untagged_text():
    tok = bpe_tokenizer()
    info = "\n\n<information>" + " ".join(f"Doc {i}(Title: t{i}) body {i}" for i in range(40)) + \
        "</information>\n\n"
    out = tok.decode(truncate_observation_ids(tok, info, 48))
    assert out.startswith("\n\n<information>Doc 0") and out.endswith("...\n</information>\n\n")
    # no closing tag: the last line is kept when short, else the last tokens (half the room)
    lines = "\n".join(f"value {i}" for i in range(100)) + "\ndone\n"
    out = tok.decode(truncate_observation_ids(tok, lines, 64))
    assert out.startswith("value 0\n") and out.endswith("...\ndone\n") and MARKER_RE.search(out)
    one_line = "x" * 300 + "END"
    ids = truncate_observation_ids(tok, one_line, 64)
    out = tok.decode(ids)
    assert len(ids) <= 64 and out.startswith("xx") and out.endswith("xEND") and MARKER_RE.search(out)


def test_multibyte_text_is_not_cut_inside_a_character():
    tok = build_byte_tokenizer()
    text = "\n<interpreter>\n" + "é€" * 100 + "\n</interpreter>\n"
    for budget in range(40, 80):
        out = tok.decode(truncate_observation_ids(tok, text, budget))
        assert "\ufffd" not in out and out.endswith("</interpreter>\n"), budget


def test_bad_budget_and_marker_wording():
    with pytest.raises(ValueError, match="max_tokens"):
        truncate_observation_ids(build_byte_tokenizer(), "abc", 0)
    assert ENV_MARKER.replace("characters", "tokens") == TRUNCATION_MARKER
