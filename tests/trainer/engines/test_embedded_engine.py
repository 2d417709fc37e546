"""Embedded engine: log-probs equal the learner's recomputation, batching, stops, weight sync."""

from __future__ import annotations

import asyncio

import pytest
import torch

from trainer.engines.base import EngineClosedError, EngineError, SamplingParams
from trainer.engines.embedded import EmbeddedEngine, EmbeddedEngineConfig
from trainer.logprobs import sequence_logprobs, token_logprobs
from trainer.models.loading import load_model_and_tokenizer
from trainer.models.tiny import TinyModelConfig, build_byte_tokenizer, build_tiny_model, save_tiny_checkpoint


def recompute(model, prompt, new, temperature, top_k=-1, top_p=1.0):
    ids = torch.tensor([prompt + new])
    return sequence_logprobs(model, ids, torch.ones_like(ids), temperature, top_k=top_k,
                             top_p=top_p)[0, len(prompt):]


@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, -1), (0.7, 0.9, -1), (1.3, 0.8, 20)])
def test_logprobs_match_learner_forward_batched(model_tok, temperature, top_p, top_k):
    model, tok = model_tok

    async def main():
        eng = EmbeddedEngine(model, tok, EmbeddedEngineConfig(max_batch_size=8))
        prompts = [tok.encode(s, add_special_tokens=False) for s in
                   ["Problem: 2+2?", "x", "A much longer prompt than the others, padded left."]]
        sp = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=24, seed=3)
        res = await asyncio.gather(*(eng.generate(p, sp) for p in prompts))
        await eng.close()
        return prompts, res

    prompts, res = asyncio.run(main())
    for p, r in zip(prompts, res, strict=True):
        assert len(r.token_ids) == len(r.logprobs) == len(r.versions) > 0
        lp = recompute(model, p, r.token_ids, temperature, top_k, top_p)  # over the sampler's support
        assert (lp - torch.tensor(r.logprobs)).abs().max().item() < 1e-5


def test_logprobs_are_raw_not_processed(model_tok):
    """A processor that forces tokens must not change the reported log-probs."""
    model, tok = model_tok
    forced = tok.encode("forced!", add_special_tokens=False)

    def proc(prompt, new, logits):
        out = torch.full_like(logits, -1e9)
        out[forced[min(len(new), len(forced) - 1)]] = 0
        return out

    async def main():
        eng = EmbeddedEngine(model, tok, logits_processor=proc)
        r = await eng.generate(tok.encode("q", add_special_tokens=False),
                               SamplingParams(temperature=0.5, max_new_tokens=len(forced)))
        await eng.close()
        return r

    r = asyncio.run(main())
    assert r.token_ids == forced and r.text == "forced!"
    lp = recompute(model, tok.encode("q", add_special_tokens=False), forced, 0.5)
    assert (lp - torch.tensor(r.logprobs)).abs().max().item() < 1e-5
    assert max(r.logprobs) < -1.0  # untrained model: forced tokens are unlikely under raw logits


def test_stop_strings_eos_and_length(model_tok):
    model, tok = model_tok
    text = "abc</code>zzz"
    script = tok.encode(text, add_special_tokens=False)

    def proc(prompt, new, logits):
        out = torch.full_like(logits, -1e9)
        out[script[len(new)] if len(new) < len(script) else tok.eos_token_id] = 0
        return out

    async def main():
        eng = EmbeddedEngine(model, tok, logits_processor=proc)
        p = tok.encode("p", add_special_tokens=False)
        stop = await eng.generate(p, SamplingParams(stop=("</code>",), max_new_tokens=50))
        length = await eng.generate(p, SamplingParams(max_new_tokens=4))
        eos = await eng.generate(p, SamplingParams(max_new_tokens=50))
        await eng.close()
        return stop, length, eos

    stop, length, eos = asyncio.run(main())
    assert stop.finish_reason == "stop" and stop.text == "abc</code>"
    assert length.finish_reason == "length" and len(length.token_ids) == 4
    assert eos.finish_reason == "eos" and eos.token_ids[-1] == tok.eos_token_id
    assert tok.decode(eos.token_ids, skip_special_tokens=True) == text


def test_seed_makes_sampling_reproducible(model_tok):
    model, tok = model_tok

    async def main():
        eng = EmbeddedEngine(model, tok)
        p = tok.encode("seed", add_special_tokens=False)
        a = await eng.generate(p, SamplingParams(max_new_tokens=16, seed=7))
        b = await eng.generate(p, SamplingParams(max_new_tokens=16, seed=7))
        c = await eng.generate(p, SamplingParams(max_new_tokens=16, seed=8))
        await eng.close()
        return a, b, c

    a, b, c = asyncio.run(main())
    assert a.token_ids == b.token_ids and a.token_ids != c.token_ids


def test_update_weights_changes_version_and_distribution(model_tok, tmp_path):
    model, tok = model_tok
    other = save_tiny_checkpoint(tmp_path / "other", TinyModelConfig(seed=1))
    new_model, _ = load_model_and_tokenizer(other)

    async def main():
        eng = EmbeddedEngine(model, tok)
        p = tok.encode("v", add_special_tokens=False)
        r0 = await eng.generate(p, SamplingParams(max_new_tokens=8, seed=0))
        await eng.update_weights(new_model.state_dict(), version=1)
        r1 = await eng.generate(p, SamplingParams(max_new_tokens=8, seed=0))
        await eng.update_weights(str(other), version=2)  # from a checkpoint directory too
        with pytest.raises(EngineError, match="does not match"):
            await eng.update_weights({"nope": torch.zeros(1)}, version=3)
        await eng.close()
        return p, r0, r1, eng.version

    p, r0, r1, version = asyncio.run(main())
    assert r0.versions == [0] * len(r0.token_ids) and r1.versions == [1] * len(r1.token_ids)
    assert version == 2
    lp1 = recompute(new_model, p, r1.token_ids, 1.0)
    assert (lp1 - torch.tensor(r1.logprobs)).abs().max().item() < 1e-5


def test_pause_drains_running_requests_and_holds_new_ones_until_resume(model_tok):
    model, tok = model_tok
    p = tok.encode("pause", add_special_tokens=False)

    async def main():
        eng = EmbeddedEngine(model, tok, EmbeddedEngineConfig(batch_wait_s=0))
        long = asyncio.create_task(eng.generate(p, SamplingParams(max_new_tokens=150, ignore_eos=True)))
        while eng.stats.admitted == 0:
            await asyncio.sleep(0.001)
        await eng.pause()
        assert long.done() and len(long.result().token_ids) == 150  # drained, not cut short
        late = asyncio.create_task(eng.generate(p, SamplingParams(max_new_tokens=2)))
        await asyncio.sleep(0.2)
        assert not late.done() and eng.stats.admitted == 1
        await eng.resume()
        r = await asyncio.wait_for(late, 30)
        await eng.close()
        return r

    assert len(asyncio.run(main()).token_ids) == 2


def test_requests_are_batched_and_errors_are_clear(model_tok):
    model, tok = model_tok

    async def main():
        eng = EmbeddedEngine(model, tok, EmbeddedEngineConfig(max_batch_size=16, batch_wait_s=0.05))
        p = tok.encode("b", add_special_tokens=False)
        await asyncio.gather(*(eng.generate(p, SamplingParams(max_new_tokens=3)) for _ in range(16)))
        with pytest.raises(EngineError, match="empty"):
            await eng.generate([], SamplingParams())
        with pytest.raises(EngineError, match="does not fit"):
            await eng.generate([1] * 5000, SamplingParams())
        stats = eng.stats
        await eng.close()
        with pytest.raises(EngineClosedError, match="closed"):
            await eng.generate(p, SamplingParams())
        return stats

    stats = asyncio.run(main())
    assert stats.admitted == 16 and stats.max_rows > 1


def test_sampling_params_validation():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop="</code>")


def test_token_logprobs_definition():
    logits = torch.tensor([[2.0, 0.0, -1.0]])
    lp = token_logprobs(logits, torch.tensor([0]), temperature=2.0)
    expected = 1.0 - torch.logsumexp(torch.tensor([1.0, 0.0, -0.5]), 0)
    assert lp.item() == pytest.approx(expected.item(), abs=1e-7)
    assert len(build_byte_tokenizer()) == 258


# -- stop strings spelled with any tokens (issue 9, fault 7) ------------------------------------
@pytest.fixture(scope="module")
def bpe_model_tok():
    """A tiny Qwen2 over the in-test BPE tokenizer (``</code>`` canonically ``</ code >``)."""
    from bpe_tokenizer import bpe_tokenizer

    tok = bpe_tokenizer()
    return build_tiny_model(TinyModelConfig(seed=0), len(tok), tok.eos_token_id, tok.pad_token_id), tok


def run_scripts(model, tok, requests):
    """Generate ``[(prompt_ids, script_ids, params)]`` in one batch, each row forced to its script."""
    scripts = {tuple(p): s for p, s, _ in requests}

    def proc(prompt, new, logits):
        script = scripts[tuple(prompt)]
        out = torch.full_like(logits, -1e9)
        out[script[len(new)] if len(new) < len(script) else tok.eos_token_id] = 0
        return out

    async def main():
        eng = EmbeddedEngine(model, tok, EmbeddedEngineConfig(max_batch_size=8, batch_wait_s=0.05),
                             logits_processor=proc)
        res = await asyncio.gather(*(eng.generate(p, sp) for p, _, sp in requests))
        await eng.close()
        return res

    return asyncio.run(main())


def test_stop_string_found_whatever_tokens_spell_it(bpe_model_tok):
    """Char-by-char, canonical and mid-token spellings of ``</code>`` all stop at the completing
    token (kept), in one batch, next to a row without stop strings."""
    from bpe_tokenizer import token_of

    model, tok = bpe_model_tok
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    assert [tok.decode([t]) for t in enc("</code>")] == ["</", "code", ">"]  # canonical: 3 tokens
    chars = [token_of(tok, c) for c in "</code>"]  # 7 one-character tokens
    head, after = enc("x = 1\nprint(x)\n```\n"), enc("\nThe answer")
    sp = SamplingParams(stop=("</code>",), max_new_tokens=60)
    by_char = head + chars + after
    canonical = head + enc("</code>") + after
    mid = [*head, token_of(tok, "</"), token_of(tok, "code"), token_of(tok, ">\n"), *after]
    no_stop = head + chars + after
    prompts = [enc(f"Q{i}:") for i in range(4)]
    res = run_scripts(model, tok, [(prompts[0], by_char, sp), (prompts[1], canonical, sp),
                                   (prompts[2], mid, sp),
                                   (prompts[3], no_stop, SamplingParams(max_new_tokens=60))])
    text = tok.decode(head) + "</code>"
    assert res[0].finish_reason == "stop" and res[0].token_ids == head + chars and res[0].text == text
    assert res[1].finish_reason == "stop" and res[1].token_ids == head + enc("</code>")
    assert res[1].text == text
    # ">\n" completes "</code>" in the middle of its text: stop right there, the token is kept
    assert res[2].finish_reason == "stop" and res[2].token_ids == mid[: len(head) + 3]
    assert res[2].text == text + "\n"
    assert res[3].finish_reason == "eos" and res[3].token_ids == [*no_stop, tok.eos_token_id]
    # log-probs of the stopped rows still match the learner's recomputation
    lp = recompute(model, prompts[0], res[0].token_ids, 1.0)
    assert (lp - torch.tensor(res[0].logprobs)).abs().max().item() < 1e-5


def test_stop_string_in_prompt_or_across_prompt_boundary_does_not_stop(bpe_model_tok):
    """Only generated text is matched: ``</co`` in the prompt + generated ``de>`` is no stop, nor
    is a ``</code>`` that lies wholly in the prompt; a later generated ``</code>`` still stops."""
    model, tok = bpe_model_tok
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    sp = SamplingParams(stop=("</code>",), max_new_tokens=60)
    split_prompt = enc("print(x)\n```\n</co")
    whole_prompt = enc("A: <code>\nx\n</code>")
    rest, later = enc("de>\nmore text"), enc("ok\n</code>\nignored")
    res = run_scripts(model, tok, [(split_prompt, rest, sp), (whole_prompt, later, sp)])
    assert res[0].finish_reason == "eos" and res[0].token_ids == [*rest, tok.eos_token_id]
    k = min(k for k in range(len(later) + 1) if "</code>" in tok.decode(later[:k]))
    assert [tok.decode([t]) for t in later[k - 3:k]] == ["</", "code", ">\n"]  # completes mid-token
    assert res[1].finish_reason == "stop" and res[1].token_ids == later[:k]
    assert res[1].text == "ok\n</code>\n"


def test_stop_string_with_multibyte_characters_split_over_byte_tokens(bpe_model_tok):
    """``€`` is 3 byte tokens that decode to U+FFFD until the last: the stop is at the 3rd byte."""
    model, tok = bpe_model_tok
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    euro = enc("€")
    assert len(euro) == 3 and tok.decode(euro[:2]) == "\ufffd"
    script = enc("cost: 5 ") + euro + enc(" and 6 €")
    res = run_scripts(model, tok, [(enc("Q"), script, SamplingParams(stop=("5 €",), max_new_tokens=60))])
    assert res[0].finish_reason == "stop" and res[0].text == "cost: 5 €"
    assert res[0].token_ids == script[: len(enc("cost: 5 ")) + 3]


def test_stop_matcher_cost_per_token_is_bounded(bpe_model_tok):
    """Per token the matcher decodes a few tokens, however long the generation (no O(length))."""
    from trainer.engines.embedded import STOP_CONTEXT_TOKENS, StopStringMatcher

    _, tok = bpe_model_tok
    decoded_lens = []

    class Spy:
        def decode(self, ids, **kw):
            decoded_lens.append(len(ids))
            return tok.decode(ids, **kw)

    text = "x = 1\nprint(x)\n" * 300 + "wörld € </co" + "de>"
    ids = tok.encode(text, add_special_tokens=False)
    m = StopStringMatcher(Spy(), ("</code>", "€ </"), tok.encode("prompt", add_special_tokens=False))
    hits = [(i, m.push(t)) for i, t in enumerate(ids)]
    found = [(i, s) for i, s in hits if s is not None]
    # "€ </" completes first (at the "</" token); each push is decoded over a handful of ids
    assert found[0] == (ids.index(tok.encode("</", add_special_tokens=False)[0], len(ids) - 10), "€ </")
    assert len(ids) > 2000 and max(decoded_lens) <= STOP_CONTEXT_TOKENS + 1
    assert len(decoded_lens) == 2 * len(ids)
    with pytest.raises(ValueError, match="stop"):
        StopStringMatcher(tok, ())


def test_a_dead_worker_thread_fails_callers_instead_of_hanging(model_tok):
    """Audit of issue 9 fault 1's kind: if the engine's thread dies, no request waits forever."""
    model, tok = model_tok

    class Fatal(BaseException):  # not an Exception: escapes the per-batch handler
        pass

    def die(self, new_rows):
        raise Fatal("out of host memory")

    async def main():
        eng = EmbeddedEngine(model, tok)
        eng._step = die.__get__(eng)
        p = tok.encode("b", add_special_tokens=False)
        calls = (eng.generate(p, SamplingParams(max_new_tokens=3)) for _ in range(3))
        results = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 30)
        assert all(isinstance(r, EngineError) for r in results), results
        assert "embedded engine worker died: Fatal: out of host memory" in str(results[0])
        with pytest.raises(EngineError, match="worker died"):  # later calls fail at once too
            await asyncio.wait_for(eng.generate(p, SamplingParams(max_new_tokens=3)), 5)
        await asyncio.wait_for(eng.pause(), 5)  # nothing waits on a dead thread
        await eng.close()

    asyncio.run(main())


def test_intra_op_threads_are_set_in_the_worker_thread(model_tok):
    """``set_intra_op_threads`` reaches the thread that runs the forward passes (torch's count is per
    thread: set from the caller's thread it would not); the caller's own count is untouched."""
    model, tok = model_tok
    seen: list[int] = []

    def proc(prompt, new, logits):  # runs in the engine's worker thread
        seen.append(torch.get_num_threads())
        return logits

    async def one(eng):
        await eng.generate(tok.encode("q", add_special_tokens=False), SamplingParams(max_new_tokens=1))
        return seen[-1]

    async def main():
        eng = EmbeddedEngine(model, tok, logits_processor=proc)
        try:
            eng.set_intra_op_threads(1)
            first = await one(eng)
            eng.set_intra_op_threads(2)
            second = await one(eng)
            eng.set_intra_op_threads(1)
            return first, second, await one(eng)
        finally:
            await eng.close()

    mine = torch.get_num_threads()
    assert asyncio.run(main()) == (1, 2, 1)
    torch.set_num_threads(mine)  # the global default the worker also set
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match=r"set_intra_op_threads: n="):
            EmbeddedEngine.set_intra_op_threads(object.__new__(EmbeddedEngine), bad)
