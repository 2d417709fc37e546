"""Continuous batching in the embedded engine: requests join and leave a running batch; outputs,
log-probs and policy versions stay exactly what one-at-a-time decoding and the learner give."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from trainer.engines.base import EngineError, SamplingParams
from trainer.engines.continuous import ContinuousBatcher, prefill_groups
from trainer.engines.embedded import EmbeddedEngine, EmbeddedEngineConfig
from trainer.engines.kv_slots import CAPACITY_BLOCK, SlotKVCache
from trainer.logprobs import sequence_logprobs
from trainer.models.loading import load_model_and_tokenizer
from trainer.models.tiny import TinyModelConfig, save_tiny_checkpoint

pytestmark = pytest.mark.usefixtures("one_torch_thread")
GREEDY = dict(temperature=1.0, top_k=1)


def learner_view(model, prompt, new, temperature=1.0, logits=False, top_k=-1, top_p=1.0):
    """Log-probs of ``new`` after ``prompt`` by the learner's ``sequence_logprobs`` over the whole
    sequence, and with ``logits`` also the ``(len(new), V)`` logits that predicted each token."""
    ids = torch.tensor([prompt + new])
    with torch.no_grad():
        lp = sequence_logprobs(model, ids, torch.ones_like(ids), temperature, top_k=top_k,
                               top_p=top_p)[0, len(prompt):]
        if not logits:
            return lp
        return lp, model(input_ids=ids).logits[0, len(prompt) - 1:-1]


def max_diff(a, b) -> float:
    return (torch.as_tensor(a) - torch.as_tensor(b)).abs().max().item()


def requests(tok, n, seed=0):
    """``n`` prompts of 1..~70 byte tokens with 2..40 new tokens each."""
    rng = random.Random(seed)
    words = ["the", "a", "train", "leaves", "at", "noon", "and", "another", "one", "follows", "two",
             "hours", "later", "how", "far"]
    out = []
    for i in range(n):
        text = f"#{i}: " + " ".join(rng.choice(words) for _ in range(rng.randint(0, 14)))
        out.append((tok.encode(text, add_special_tokens=False), rng.randint(2, 40)))
    return out


async def staggered(eng, reqs, make_params, gap_s=0.003):
    """Submit ``reqs`` a few ms apart (so later ones arrive while earlier ones decode)."""
    tasks = []
    for prompt, n in reqs:
        tasks.append(asyncio.create_task(eng.generate(prompt, make_params(n))))
        await asyncio.sleep(gap_s)
    return await asyncio.gather(*tasks)


def test_requests_join_mid_decode_and_greedy_equals_one_at_a_time(model_tok):
    model, tok = model_tok
    reqs = requests(tok, 14)
    greedy = lambda n: SamplingParams(max_new_tokens=n, ignore_eos=True, **GREEDY)  # noqa: E731

    async def main():
        eng = EmbeddedEngine(model, tok, EmbeddedEngineConfig(max_batch_size=4, batch_wait_s=0))
        together = await staggered(eng, reqs, greedy)
        stats = eng.stats
        alone = [await eng.generate(p, greedy(n)) for p, n in reqs]
        await eng.close()
        return together, alone, stats

    together, alone, stats = asyncio.run(main())
    # the batch really was continuous: full, and later requests joined rows already decoding
    assert stats.max_rows == 4 and stats.joined_running >= 5 and stats.admitted == len(reqs)
    for (prompt, n), a, b in zip(reqs, together, alone, strict=True):
        assert a.token_ids == b.token_ids and len(a.token_ids) == n and a.finish_reason == "length"
        lp, logits = learner_view(model, prompt, a.token_ids, logits=True)
        assert max_diff(lp, a.logprobs) < 1e-5 and max_diff(lp, b.logprobs) < 1e-5
        assert a.token_ids == logits.argmax(-1).tolist()  # greedy under the learner's own logits


def test_mixed_sampling_params_in_one_running_batch(model_tok):
    """Per-request temperature, top-p, top-k, seed, stop string and max tokens in one batch."""
    model, tok = model_tok
    p = [tok.encode(s, add_special_tokens=False) for s in ("alpha", "b", "a longer prompt, the third", "dd")]
    stop_script = tok.encode("xy</code>tail", add_special_tokens=False)
    cases = [SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=30, seed=11, ignore_eos=True),
             SamplingParams(temperature=1.3, top_k=5, max_new_tokens=25, seed=12, ignore_eos=True),
             SamplingParams(temperature=1.0, max_new_tokens=7, ignore_eos=True),
             SamplingParams(temperature=0.5, stop=("</code>",), max_new_tokens=40)]

    def proc(prompt, new, logits):  # forces the last request's text; others sample freely
        if prompt != p[3]:
            return logits
        out = torch.full_like(logits, -1e9)
        out[stop_script[min(len(new), len(stop_script) - 1)]] = 0
        return out

    async def main():
        eng = EmbeddedEngine(model, tok, EmbeddedEngineConfig(max_batch_size=8, batch_wait_s=0.05),
                             logits_processor=proc)
        res = await asyncio.gather(*(eng.generate(x, sp) for x, sp in zip(p, cases, strict=True)))
        seeded_alone = await eng.generate(p[0], cases[0])
        await eng.close()
        return res, seeded_alone

    res, seeded_alone = asyncio.run(main())
    for x, sp, r in zip(p, cases, res, strict=True):
        lp, logits = learner_view(model, x, r.token_ids, sp.temperature, logits=True, top_k=sp.top_k,
                                  top_p=sp.top_p)  # the learner's view of the sampler's support
        inside = torch.isfinite(lp)  # the forced tokens of the last request may lie outside it
        full = learner_view(model, x, r.token_ids, sp.temperature)
        assert max_diff(lp[inside], torch.tensor(r.logprobs)[inside]) < 1e-5
        assert inside.all() or max_diff(full[~inside], torch.tensor(r.logprobs)[~inside]) < 1e-5
        if sp.top_k > 0:  # every drawn token is among the k best of the learner's logits
            assert all(t in row.topk(sp.top_k).indices.tolist()
                       for t, row in zip(r.token_ids, logits, strict=True))
    assert [len(r.token_ids) for r in res[:3]] == [30, 25, 7]
    assert res[3].finish_reason == "stop" and res[3].text == "xy</code>"
    assert seeded_alone.token_ids == res[0].token_ids  # a seed gives the same tokens in or out of a batch
    assert res[0].token_ids != res[1].token_ids[:25]


def test_weight_update_under_continuous_load_records_exact_versions(model_tok, tmp_path):
    """Clients keep requests coming while the weights change: every result carries one version,
    and its log-probs are those of exactly that version's model (not merely a consistent label)."""
    model, tok = model_tok
    old = load_model_and_tokenizer(save_tiny_checkpoint(tmp_path / "old", TinyModelConfig(seed=0)))[0]
    new = load_model_and_tokenizer(save_tiny_checkpoint(tmp_path / "new", TinyModelConfig(seed=1)))[0]
    reqs = requests(tok, 40, seed=3)

    async def main():
        eng = EmbeddedEngine(model, tok, EmbeddedEngineConfig(max_batch_size=6, batch_wait_s=0))
        results, done = [], asyncio.Event()

        async def client(k):
            i = k
            while not done.is_set():
                prompt, n = reqs[i % len(reqs)]
                r = await eng.generate(prompt, SamplingParams(max_new_tokens=n, ignore_eos=True))
                results.append((prompt, r))
                i += 4

        clients = [asyncio.create_task(client(k)) for k in range(4)]
        while len(results) < 10:
            await asyncio.sleep(0.01)
        in_flight = eng.stats.admitted - len(results)
        await eng.update_weights(new.state_dict(), version=1)
        n_before = len(results)
        while len(results) < n_before + 10:
            await asyncio.sleep(0.01)
        done.set()
        await asyncio.gather(*clients)
        await eng.close()
        return results, in_flight

    results, in_flight = asyncio.run(main())
    assert in_flight > 0  # the update arrived while requests were running
    seen = set()
    for prompt, r in results:
        assert len(set(r.versions)) == 1
        v = r.versions[0]
        seen.add(v)
        mine, other = (old, new) if v == 0 else (new, old)
        assert max_diff(learner_view(mine, prompt, r.token_ids), r.logprobs) < 1e-5
        assert max_diff(learner_view(other, prompt, r.token_ids), r.logprobs) > 1e-3
    assert seen == {0, 1}


def test_close_fails_running_and_queued_requests(model_tok):
    model, tok = model_tok
    p = tok.encode("c", add_special_tokens=False)

    async def main():
        eng = EmbeddedEngine(model, tok, EmbeddedEngineConfig(max_batch_size=1, batch_wait_s=0))
        sp = SamplingParams(max_new_tokens=4000, ignore_eos=True)
        tasks = [asyncio.create_task(eng.generate(p, sp)) for _ in range(2)]
        while eng.stats.steps < 3:
            await asyncio.sleep(0.001)
        await eng.close()
        return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)

    running, queued = asyncio.run(main())
    assert isinstance(running, EngineError) and isinstance(queued, EngineError)
    assert "closed" in str(running) and "closed" in str(queued)


def test_cache_growth_and_slot_moves_keep_logprobs_exact(model_tok):
    """Prompts near the first capacity block grow the cache mid-decode; rows finishing out of
    order move the last slots into their place; every log-prob still matches the learner."""
    model, tok = model_tok
    base = tok.encode("0123456789" * 30, add_special_tokens=False)
    reqs = [(base[: CAPACITY_BLOCK - 20 + 7 * i], 5 + 9 * (i % 4)) for i in range(7)]

    async def main():
        eng = EmbeddedEngine(model, tok, EmbeddedEngineConfig(max_batch_size=3, batch_wait_s=0))
        res = await staggered(eng, reqs, lambda n: SamplingParams(max_new_tokens=n, ignore_eos=True))
        cap = eng._batcher.cache.capacity
        await eng.close()
        return res, cap

    res, cap = asyncio.run(main())
    assert cap > CAPACITY_BLOCK  # the test did grow the cache
    for (prompt, n), r in zip(reqs, res, strict=True):
        assert len(r.token_ids) == n
        assert max_diff(learner_view(model, prompt, r.token_ids), r.logprobs) < 1e-5


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_either_attention_kernel_matches_an_eager_learner(tiny_ckpt, attn):
    engine_model, tok = load_model_and_tokenizer(tiny_ckpt, attn_implementation="eager")
    learner = load_model_and_tokenizer(tiny_ckpt, attn_implementation="eager")[0]
    reqs = requests(tok, 6, seed=5)

    async def main():
        cfg = EmbeddedEngineConfig(max_batch_size=4, attn_implementation=attn)
        eng = EmbeddedEngine(engine_model, tok, cfg)
        res = await staggered(eng, reqs, lambda n: SamplingParams(temperature=0.8, max_new_tokens=n))
        await eng.close()
        return res

    res = asyncio.run(main())
    assert engine_model.config._attn_implementation == attn
    for (prompt, _), r in zip(reqs, res, strict=True):
        assert max_diff(learner_view(learner, prompt, r.token_ids, 0.8), r.logprobs) < 1e-5


def test_unsupported_attention_is_a_clear_error(model_tok):
    model, tok = model_tok
    model.config.layer_types = ["full_attention", "sliding_attention"]
    with pytest.raises(EngineError, match=r"layer_types \['sliding_attention'\]"):
        ContinuousBatcher(model, tok, 4)
    model.config.layer_types = ["full_attention"] * 2
    model.set_attn_implementation("flex_attention")
    with pytest.raises(EngineError, match="attn_implementation='flex_attention' is not supported"):
        EmbeddedEngine(model, tok, EmbeddedEngineConfig(attn_implementation=None))
    with pytest.raises(ValueError, match="attn_implementation"):
        EmbeddedEngineConfig(attn_implementation="flash_attention_2")


# -- prefix reuse -------------------------------------------------------------------------------
def engine_pair(model, tok, **cfg):
    """An engine with prefix reuse and one without (reference), same model and settings."""
    return (EmbeddedEngine(model, tok, EmbeddedEngineConfig(batch_wait_s=0, **cfg)),
            EmbeddedEngine(model, tok, EmbeddedEngineConfig(batch_wait_s=0, reuse_prefix=False, **cfg)))


def test_next_turn_reuses_the_previous_turn_exactly(model_tok):
    """Turn 2's prompt is turn 1's prompt + generated tokens + an observation: everything turn 1
    cached is reused (no prefill), and the tokens and log-probs are those of a full prefill."""
    model, tok = model_tok
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    p1, obs = enc("System: answer with a search. User: who wrote it?"), enc("<obs>a book</obs>")
    sp = SamplingParams(max_new_tokens=12, ignore_eos=True, **GREEDY)

    async def main():
        eng, ref = engine_pair(model, tok)
        out = []
        for e in (eng, ref):
            r1 = await e.generate(p1, sp)
            before = e.stats.reused_tokens
            r2 = await e.generate(p1 + r1.token_ids + obs, sp)
            out.append((r1, r2, e.stats.reused_tokens - before, e.stats.prefilled_tokens))
            await e.close()
        return out

    (r1, r2, reused, prefilled), (q1, q2, ref_reused, ref_prefilled) = asyncio.run(main())
    assert reused == len(p1) + len(r1.token_ids) - 1 and ref_reused == 0
    assert prefilled == len(p1) + len(obs) + 1 and ref_prefilled == 2 * len(p1) + len(q1.token_ids) + len(obs)
    assert (r1.token_ids, r2.token_ids) == (q1.token_ids, q2.token_ids)
    assert max_diff(learner_view(model, p1 + r1.token_ids + obs, r2.token_ids), r2.logprobs) < 1e-5


def test_a_shared_system_prompt_is_prefilled_once(model_tok):
    """Eight requests arriving together with one 100-token system prompt: it is computed once
    (the first request's), the others copy it and prefill only their own part."""
    model, tok = model_tok
    system = tok.encode("S" * 40 + " You are a careful assistant; think, then answer. " + "=" * 10,
                        add_special_tokens=False)
    assert len(system) == 100
    users = [tok.encode(f"{chr(65 + i)}: question {i}?" + "x" * i, add_special_tokens=False)
             for i in range(8)]
    sp = SamplingParams(max_new_tokens=6, ignore_eos=True)

    async def main():
        eng = EmbeddedEngine(model, tok, EmbeddedEngineConfig(batch_wait_s=0.05))
        res = await asyncio.gather(*(eng.generate(system + u, sp) for u in users))
        stats = eng.stats
        await eng.close()
        return res, stats

    res, stats = asyncio.run(main())
    assert stats.reused_tokens == 7 * 100
    assert stats.prefilled_tokens == 100 + sum(len(u) for u in users)
    for u, r in zip(users, res, strict=True):
        assert max_diff(learner_view(model, system + u, r.token_ids), r.logprobs) < 1e-5


def test_reuse_never_crosses_a_weight_update(model_tok, tmp_path):
    model, tok = model_tok
    new = load_model_and_tokenizer(save_tiny_checkpoint(tmp_path / "new", TinyModelConfig(seed=1)))[0]
    p = tok.encode("a prompt long enough to be parked and reused later", add_special_tokens=False)
    sp = SamplingParams(max_new_tokens=5, ignore_eos=True)

    async def main():
        eng = EmbeddedEngine(model, tok, EmbeddedEngineConfig(batch_wait_s=0))
        r1 = await eng.generate(p, sp)
        await eng.update_weights(new.state_dict(), version=1)
        r2 = await eng.generate(p + r1.token_ids, sp)
        stats = eng.stats
        await eng.close()
        return r1, r2, stats

    r1, r2, stats = asyncio.run(main())
    assert stats.reused_tokens == 0 and r2.versions == [1] * 5  # v0's KV is not v1's
    assert max_diff(learner_view(new, p + r1.token_ids, r2.token_ids), r2.logprobs) < 1e-5


def test_slot_pressure_moves_and_gives_up_parked_rows_exactly(model_tok):
    """Many two-turn episodes through 2 running rows and 1 spare slot: parked rows are moved out
    of the way, taken over or given up; every output equals decoding without any reuse."""
    model, tok = model_tok
    rng = random.Random(7)
    system = tok.encode("Instructions: search, then answer briefly. ", add_special_tokens=False)
    firsts = [system + tok.encode(f"Q{i}" + "?" * rng.randint(0, 30), add_special_tokens=False)
              for i in range(9)]

    async def episode(e, prompt, n):
        await asyncio.sleep(rng.random() * 0.02)
        sp = SamplingParams(max_new_tokens=n, ignore_eos=True, **GREEDY)
        r1 = await e.generate(prompt, sp)
        p2 = prompt + r1.token_ids + tok.encode("<obs>", add_special_tokens=False)
        return r1, p2, await e.generate(p2, sp)

    async def main():
        eng, ref = engine_pair(model, tok, max_batch_size=2, park_slots=1)
        out = []
        for e in (eng, ref):
            out.append(await asyncio.gather(*(episode(e, p, 3 + i % 5) for i, p in enumerate(firsts))))
            out.append(e.stats)
            await e.close()
        return out

    ours, stats, refs, _ = asyncio.run(main())
    assert stats.reused_tokens > 9 * len(system)  # reuse did happen, across and within episodes
    for (r1, p2, r2), (q1, _, q2) in zip(ours, refs, strict=True):
        assert r1.token_ids == q1.token_ids and r2.token_ids == q2.token_ids
        assert max_diff(learner_view(model, p2, r2.token_ids), r2.logprobs) < 1e-5


def test_long_prompts_are_prefilled_in_chunks(model_tok, monkeypatch):
    from trainer.engines import continuous

    model, tok = model_tok
    monkeypatch.setattr(continuous, "MASK_ELEMENTS", 64 * 300)  # 300-token prompts: 64-token chunks
    prompts = [tok.encode(f"{i} " + "chunked prefill " * 20, add_special_tokens=False)[:300]
               for i in range(2)]

    async def main():
        eng = EmbeddedEngine(model, tok, EmbeddedEngineConfig(batch_wait_s=0, reuse_prefix=False))
        res = [await eng.generate(p, SamplingParams(max_new_tokens=4)) for p in prompts]
        stats = eng.stats
        await eng.close()
        return res, stats

    res, stats = asyncio.run(main())
    assert stats.prefills == 2 * 5 and stats.prefilled_tokens == 600  # ceil(300 / 64) passes each
    for p, r in zip(prompts, res, strict=True):
        assert max_diff(learner_view(model, p, r.token_ids), r.logprobs) < 1e-5


def test_slot_cache_grows_and_moves_rows_exactly():
    cache = SlotKVCache(num_layers=2, max_slots=8)
    cache.reserve(2, 10)
    assert (cache.slots, cache.capacity) == (2, CAPACITY_BLOCK)
    for layer in cache.layers:
        layer.lazy_initialization(torch.zeros(2, 3, 1, 4), torch.zeros(2, 3, 1, 4))
        layer.keys.copy_(torch.randn_like(layer.keys))
        layer.values.copy_(torch.randn_like(layer.values))
    before = [(lay.keys.clone(), lay.values.clone()) for lay in cache.layers]
    cache.reserve(3, CAPACITY_BLOCK + 1)
    assert (cache.slots, cache.capacity) == (4, 2 * CAPACITY_BLOCK)
    old = slice(None, CAPACITY_BLOCK)
    for lay, (k, v) in zip(cache.layers, before, strict=True):
        assert torch.equal(lay.keys[:2, :, old], k) and torch.equal(lay.values[:2, :, old], v)
        assert not lay.keys[2:].any() and not lay.keys[:, :, CAPACITY_BLOCK:].any()
    cache.move(1, 3, 7)
    for lay, (k, v) in zip(cache.layers, before, strict=True):
        assert torch.equal(lay.keys[3, :, :7], k[1, :, :7]) and torch.equal(lay.values[3, :, :7], v[1, :, :7])
        assert not lay.keys[3, :, 7:].any()
    with pytest.raises(ValueError, match="max_slots"):
        cache.reserve(9, 1)
    assert cache.nbytes() == 2 * 2 * 4 * 3 * 2 * CAPACITY_BLOCK * 4 * 4
    cache.release()
    assert cache.nbytes() == 0 and cache.slots == 0


def test_prefill_groups_respect_the_token_budget():
    lengths = [5, 100, 7, 60, 6, 300]
    groups = prefill_groups(lengths, lengths, budget=128)
    assert sorted(i for g in groups for i in g) == list(range(6))
    for g in groups:
        assert len(g) == 1 or len(g) * max(lengths[i] for i in g) <= 128
    assert groups[0] == [0, 4, 2] and [5] in groups  # shortest first; an over-budget prompt alone


# -- the real pretrained model ---------------------------------------------------------------
def chat_requests(tok):
    msgs = ["What is the capital of France?", "Name three prime numbers.", "Say hi."]
    prompts = [tok.apply_chat_template([{"role": "user", "content": m}], add_generation_prompt=True,
                                       tokenize=True, return_dict=False) for m in msgs]
    return [(list(p), 4 + 2 * i) for i, p in enumerate(prompts)]


@pytest.mark.realmodel
def test_smollm2_continuous_batching_is_exact_in_float64(realmodel_path):
    """SmolLM2-135M in float64 (no float32 rounding floor): requests joining mid-decode give the
    same greedy tokens as one at a time, and greedy and sampled (T = 0.7, top-p) log-probs equal
    the learner's recomputation within 1e-5 (in fact to float32 rounding of the same logits)."""
    model, tok = load_model_and_tokenizer(realmodel_path, dtype=torch.float64)
    reqs = chat_requests(tok)

    async def main():
        eng = EmbeddedEngine(model, tok, EmbeddedEngineConfig(max_batch_size=2, batch_wait_s=0))
        greedy = await staggered(eng, reqs, lambda n: SamplingParams(max_new_tokens=n, **GREEDY), 0.05)
        alone = [await eng.generate(p, SamplingParams(max_new_tokens=n, **GREEDY)) for p, n in reqs]
        sampled = await staggered(eng, reqs, lambda n: SamplingParams(temperature=0.7, top_p=0.95,
                                                                      max_new_tokens=n, seed=n))
        stats = eng.stats
        await eng.close()
        return greedy, alone, sampled, stats

    greedy, alone, sampled, stats = asyncio.run(main())
    assert stats.joined_running >= 1
    assert greedy[0].text == "The capital of France"  # 4 tokens of the real answer
    for (prompt, _), g, a, s in zip(reqs, greedy, alone, sampled, strict=True):
        assert g.token_ids == a.token_ids
        assert max_diff(learner_view(model, prompt, g.token_ids), g.logprobs) < 1e-5
        assert max_diff(learner_view(model, prompt, s.token_ids, 0.7, top_p=0.95), s.logprobs) < 1e-5


@pytest.mark.realmodel
def test_smollm2_float32_logprobs_at_the_float32_floor(realmodel_path):
    """SmolLM2-135M in float32 (what users run), engine (sdpa, KV cache) vs an eager learner.

    SmolLM2's logits reach |z| ~ 30-60, where float32 spacing is 2-4e-6, so two exact but
    differently ordered computations differ by a few ulps: the engine before continuous
    batching measured max 2.3e-5 (4 % of sampled tokens above 1e-5) on this set, and the
    learner itself, sdpa vs eager, 1.9e-5. This checks that the new engine stays at that floor:
    mean below 5e-6, max below 3e-5 (a wrong position, mask or cache entry costs >= 1e-2)."""
    engine_model, tok = load_model_and_tokenizer(realmodel_path)
    learner = load_model_and_tokenizer(realmodel_path)[0]
    reqs = chat_requests(tok)

    async def main():
        eng = EmbeddedEngine(engine_model, tok, EmbeddedEngineConfig(max_batch_size=3, batch_wait_s=0))
        res = await staggered(eng, reqs, lambda n: SamplingParams(max_new_tokens=5 * n, seed=n,
                                                                  ignore_eos=True), 0.05)
        await eng.close()
        return res

    res = asyncio.run(main())
    d = torch.cat([(learner_view(learner, p, r.token_ids) - torch.tensor(r.logprobs)).abs()
                   for (p, _), r in zip(reqs, res, strict=True)])
    assert d.numel() == sum(5 * n for _, n in reqs)
    assert d.mean().item() < 5e-6 and d.max().item() < 3e-5, (d.mean().item(), d.max().item())
