"""Sampling-support replay (issue 46 item 1): with top-k / top-p the behaviour log-probs are those of
the truncated, renormalised distribution the sampler drew from, and the learner takes π's log-probs
over the same support, so on-policy ratios are 1 and a token outside π's support has ratio 0, is
masked from the policy loss and is counted (``diag/outside_support_frac``).

Real components: the embedded engine and the torch learner on the tiny checkpoint; the truncation
function against a slow per-row loop; top_p = 1 / top_k off bit-identical to the untruncated
convention.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest
import torch

import copc
from trainer.engines.base import SamplingParams
from trainer.engines.embedded import EmbeddedEngine, EmbeddedEngineConfig
from trainer.engines.sampling import sample_next
from trainer.learner.backends.torch import TorchLearner, response_logprobs
from trainer.learner.outside_support import OUTSIDE_SUPPORT_LOGP, floor_outside_support, support_loss_mask
from trainer.learner.settings import LearnerConfig
from trainer.logprobs import support_logits, token_logprobs
from trainer.models.chunked_logprobs import chunked_token_scores
from trainer.rollout.batch import to_batch
from trainer.rollout.trajectory import Trajectory

pytestmark = pytest.mark.usefixtures("one_torch_thread")

T, TOP_P, TOP_K = 0.7, 0.9, 20
ROOT = Path(__file__).resolve().parents[3]


def slow_truncated_logprobs(logits: torch.Tensor, ids: torch.Tensor, temperature: float, top_k: int,
                            top_p: float) -> list[float]:
    """The sampler's distribution one row at a time in float64 Python: sort the scaled logits, keep
    the ``top_k`` best, renormalise, keep tokens while the mass of the better kept ones is < top_p,
    renormalise over the kept set; ``-inf`` outside."""
    out = []
    for row, y in zip(logits.double().tolist(), ids.tolist(), strict=True):
        z = [v / temperature for v in row]
        order = sorted(range(len(z)), key=lambda j: -z[j])
        if top_k > 0:
            order = order[:top_k]
        m = max(z[j] for j in order)
        w = {j: math.exp(z[j] - m) for j in order}
        total = sum(w.values())
        kept, before = [], 0.0
        for j in order:
            if kept and before >= top_p:
                break
            kept.append(j)
            before += w[j] / total
        if y not in kept:
            out.append(-math.inf)
            continue
        out.append(z[y] - m - math.log(sum(w[j] for j in kept)))
    return out


@pytest.mark.parametrize("top_k,top_p", [(20, 1.0), (-1, 0.9), (20, 0.9), (5, 0.5), (3, 0.999)])
def test_truncated_logprobs_equal_a_slow_per_row_loop(top_k, top_p):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(12, 50, generator=g) * 3
    ids = torch.randint(0, 50, (12,), generator=g)
    ids[:4] = logits[:4].argmax(1)  # some tokens certainly inside the support
    got = token_logprobs(logits, ids, T, top_k=top_k, top_p=top_p)
    want = torch.tensor(slow_truncated_logprobs(logits, ids, T, top_k, top_p), dtype=torch.float64)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert bool(torch.isinf(got).any())  # the random tokens include some outside the support
    fin = torch.isfinite(want)
    assert (got[fin].double() - want[fin]).abs().max() < 1e-5
    # the sampler's support is the same set: -inf exactly where the loop excludes the token
    kept = torch.isfinite(support_logits(logits / T, torch.full((12,), top_k), torch.full((12,), top_p)))
    assert torch.equal(kept.gather(1, ids[:, None]).squeeze(1), fin)


def test_top_k_with_top_p_takes_the_top_k_path_and_keeps_the_full_sort_s_support():
    """Review finding: top_k with top_p sorted the whole vocabulary per token; rows that all have a
    top-k now take their ``topk`` (the nucleus lies inside the k best). Same kept logits as the full
    sort, which a batch holding one top-p-only row still takes."""
    g = torch.Generator().manual_seed(3)
    scaled = torch.randn(9, 400, generator=g) * 2
    k = torch.tensor([20, 20, 5, 1, 400, 3, 20, -1, 0])
    p = torch.tensor([0.9, 1.0, 0.5, 0.9, 0.95, 0.999, 0.3, 1.0, 1.0])
    fast = support_logits(scaled, k, p)  # every top-p row has a top-k
    mixed = support_logits(torch.cat([scaled, scaled[:1]]), torch.cat([k, torch.tensor([-1])]),
                           torch.cat([p, torch.tensor([0.8])]))  # one top-p-only row: the full sort
    assert torch.equal(fast, mixed[:9])
    assert torch.equal(fast[7:], scaled[7:])  # rows without truncation untouched
    kept = torch.isfinite(fast).sum(1)
    assert kept[0] <= 20 and kept[1] == 20 and kept[3] == 1 and 1 <= kept[6] <= 20


def test_top_p_1_and_top_k_off_are_the_untruncated_convention_bit_for_bit():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 6, 50, generator=g)
    ids = torch.randint(0, 50, (4, 6), generator=g)
    scaled = logits.float() / T
    old = scaled.gather(-1, ids[..., None]).squeeze(-1) - torch.logsumexp(scaled, -1)  # the old definition
    for k, p in [(-1, 1.0), (0, 1.0), (1, 1.0), (1, 0.5)]:  # off, or greedy (untruncated by convention)
        assert torch.equal(token_logprobs(logits, ids, T, top_k=k, top_p=p), old)
    # the chunked learner path: the same bits with the truncation off as without the arguments
    h, w = torch.randn(24, 8, generator=g), torch.randn(50, 8, generator=g)
    base = chunked_token_scores(h, w, ids.reshape(-1), temperature=T, chunk_tokens=5, entropy=True)
    for k, p in [(-1, 1.0), (0, 1.0), (1, 0.7)]:
        got = chunked_token_scores(h, w, ids.reshape(-1), temperature=T, chunk_tokens=5, entropy=True,
                                   top_k=k, top_p=p)
        assert torch.equal(got[0], base[0]) and torch.equal(got[1], base[1])
    # the engine's behaviour log-probs: untruncated rows report exactly the old definition
    rows = logits[:, 0]
    tok, lp = sample_next(rows, [SamplingParams(temperature=T)] * 4, [torch.Generator().manual_seed(i)
                                                                       for i in range(4)])
    s = rows / T
    assert torch.equal(lp, s.gather(1, tok[:, None]).squeeze(1) - torch.logsumexp(s, 1))


def test_chunked_truncated_scores_and_gradients_match_the_full_logits_path():
    """The learner's chunked path with truncation = token_logprobs on the full logits (values, and
    gradients w.r.t. hidden states and head through the renormalised support)."""
    g = torch.Generator().manual_seed(2)
    h = torch.randn(30, 8, generator=g, requires_grad=True)
    w = (torch.randn(60, 8, generator=g) * 0.7).requires_grad_()
    with torch.no_grad():
        ids = (h @ w.t()).topk(3, dim=1).indices[:, 2]  # the 3rd best: inside top_k 20, mostly in the nucleus
    lp, ent = chunked_token_scores(h, w, ids, temperature=T, chunk_tokens=7, entropy=True, top_k=TOP_K,
                                   top_p=TOP_P)
    ref = token_logprobs(h @ w.t(), ids, T, top_k=TOP_K, top_p=TOP_P)
    assert torch.equal(torch.isinf(lp), torch.isinf(ref))
    fin = torch.isfinite(ref)
    assert fin.sum() >= 20
    assert (lp[fin] - ref[fin]).abs().max() < 1e-5
    trunc = support_logits((h @ w.t()).detach() / T, torch.full((30,), TOP_K), torch.full((30,), TOP_P))
    q = torch.softmax(trunc, 1)
    assert (ent - (-(q * torch.log_softmax(trunc, 1).nan_to_num(neginf=0.0)).sum(1))).abs().max() < 1e-5
    gh, gw = torch.autograd.grad((lp[fin] * torch.arange(int(fin.sum()))).sum(), (h, w))
    rh, rw = torch.autograd.grad((ref[fin] * torch.arange(int(fin.sum()))).sum(), (h, w))
    assert (gh - rh).norm() / rh.norm() < 1e-5 and (gw - rw).norm() / rw.norm() < 1e-5


def _engine_batch(model, tok, params: SamplingParams):
    prompts = [tok.encode(s, add_special_tokens=False) for s in
               ["Problem: 2+2?", "x", "A much longer prompt than the others, padded left.", "abc def"]]

    async def main():
        eng = EmbeddedEngine(model, tok, EmbeddedEngineConfig(max_batch_size=8))
        res = await asyncio.gather(*(eng.generate(p, params) for p in prompts))
        await eng.close()
        return res

    trs = []
    for i, (p, r) in enumerate(zip(prompts, asyncio.run(main()), strict=True)):
        tr = Trajectory(prompt_ids=p, sample_id=i, group_id=i // 2)
        tr.append_model_tokens(r.token_ids, r.logprobs, r.versions)
        tr.reward = float(i % 2)
        trs.append(tr)
    return to_batch(trs, tok.pad_token_id)


def test_on_policy_ratio_is_one_with_top_p_and_top_k(model_tok):
    """Sample with the real embedded engine at T 0.7, top_p 0.9, top_k 20; the torch learner with the
    same weights and the run's sampling settings gives log-probs whose ratio to µ is 1 to 1e-6 on
    every token (the untruncated convention is off by far more), and a whole learner step sees ratio
    1 and nothing outside the support."""
    model, tok = model_tok
    batch = _engine_batch(model, tok, SamplingParams(temperature=T, top_p=TOP_P, top_k=TOP_K,
                                                     max_new_tokens=24, seed=3))
    mask = batch.loss_mask.bool()
    assert int(mask.sum()) >= 60
    cfg = LearnerConfig(temperature=T, top_k=TOP_K, top_p=TOP_P, micro_batch_size=2)
    learner = TorchLearner(model, copc.get_preset("copc"), cfg)
    learner.actor.eval()
    with torch.no_grad():
        lp = learner.logprobs(batch)
        untruncated = response_logprobs(learner.actor, batch, T)
    ratio = (lp - batch.logp_mu)[mask].double().exp()
    assert (ratio - 1).abs().max() < 1e-6
    assert (untruncated - batch.logp_mu)[mask].abs().max() > 0.05  # what the old convention gave
    metrics = learner.step(batch)
    assert metrics["diag/outside_support_frac"] == 0.0 and metrics["actor/outside_support_frac"] == 0.0
    assert abs(metrics["advantage/ratio_max"] - 1) < 1e-6 and abs(metrics["advantage/ratio_min"] - 1) < 1e-6


def test_a_token_outside_pis_top_k_support_gets_ratio_0_is_masked_and_counted(model_tok):
    """The last response token of a row replaced by the least likely token under π (outside its top-20): the
    learner's log-prob is -inf, the step's ratio for it is 0 (advantage/ratio_min), it is masked from
    the loss (the same loss and gradients as with that token's loss_mask set to 0) and counted:
    1 of the batch's action tokens."""
    model, tok = model_tok
    batch = _engine_batch(model, tok, SamplingParams(temperature=T, top_p=TOP_P, top_k=TOP_K,
                                                     max_new_tokens=12, seed=4))
    cfg = LearnerConfig(temperature=T, top_k=TOP_K, top_p=TOP_P, micro_batch_size=4)
    learner = TorchLearner(model, copc.get_preset("ppo_async"), cfg)
    P, row = batch.prompt_len, 1
    col = int(batch.loss_mask[row].nonzero().max())  # its last token: no later token's context changes
    with torch.no_grad():  # the least likely next token at response column `col` of row 1
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                       position_ids=batch.position_ids).logits
        worst = int(logits[row, P + col - 1].argmin())
    batch.input_ids[row, P + col] = worst
    batch.logp_mu[row, col] = -3.0  # µ sampled it (another policy's support)
    n = int(batch.loss_mask.sum())
    lp, values = learner.recompute(batch)  # the step's own recompute (no grad, eval mode)
    assert lp[row, col] == -math.inf and bool(torch.isfinite(lp[batch.loss_mask.bool()]).sum() == n - 1)

    algo = learner.algorithm
    x, met = algo.advantages(batch, lp, values, 0)
    assert met["diag/outside_support_frac"] == pytest.approx(1 / n, abs=1e-12)
    assert x.logp_old[row, col] == OUTSIDE_SUPPORT_LOGP and met["advantage/ratio_min"] == 0.0
    assert math.isfinite(met["advantage/ratio_mean"])
    den = algo.denominators(batch)
    logp = lp.clone().requires_grad_()
    loss, pm = algo.policy_loss(logp, batch, x, den)
    (g,) = torch.autograd.grad(loss, logp)
    assert pm["actor/outside_support_frac"] == pytest.approx(1 / n, abs=1e-12)
    assert g[row, col] == 0 and torch.isfinite(g).all() and math.isfinite(float(loss.detach()))
    # masked: exactly the loss of the batch with that token's loss_mask 0 (same denominators)
    masked = batch.select(list(range(len(batch))))
    masked.loss_mask[row, col] = 0
    finite = lp.masked_fill(torch.isinf(lp), 0.0).requires_grad_()
    ref, _ = copc.compute_policy_loss(finite, copc.PolicyLossInputs(
        logp_old=x.logp_old, logp_mu=masked.logp_mu, advantages=x.advantages, loss_mask=masked.loss_mask,
        denominators=den), algo.algo)
    (rg,) = torch.autograd.grad(ref, finite)
    assert float(loss.detach()) == float(ref.detach()) and torch.equal(g, rg)
    metrics = learner.step(batch)  # the whole step: finite, the token counted
    assert metrics["diag/outside_support_frac"] == pytest.approx(1 / n, abs=1e-12)
    assert all(math.isfinite(v) for k, v in metrics.items() if k.startswith(("actor/", "critic/")))


def test_no_outside_tokens_leave_the_step_inputs_untouched():
    """Without a -inf the step's tensors pass through as the same objects (bit-identical default)."""
    lp = torch.tensor([[-1.0, -2.0, 0.0]])
    out, outside = floor_outside_support(lp, torch.tensor([[1, 1, 0]]))
    assert out is lp and not outside.any()
    m = torch.tensor([[1.0, 1.0, 0.0]])
    assert support_loss_mask(m, outside) is m
    lp[0, 1] = -math.inf
    out, outside = floor_outside_support(lp, torch.tensor([[1, 1, 0]]))
    assert out.tolist() == [[-1.0, OUTSIDE_SUPPORT_LOGP, 0.0]] and outside.tolist() == [[False, True, False]]
    assert support_loss_mask(m, outside).tolist() == [[1.0, 0.0, 0.0]]
    assert math.exp(OUTSIDE_SUPPORT_LOGP + 745.0) == 0.0  # ratio exactly 0 against any drawable µ


def test_a_processor_forced_token_outside_the_raw_support_keeps_a_finite_untruncated_mu():
    """The engine's test-only logits processor can force a token outside the raw top-k support: its µ
    is then the untruncated log-prob (finite), never -inf; inside tokens get the truncated one."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 40, generator=g)
    forced = torch.full_like(logits, -1e9)
    worst, best = int(logits[0].argmin()), int(logits[1].argmax())
    forced[0, worst], forced[1, best] = 0.0, 0.0
    params = [SamplingParams(temperature=T, top_k=5)] * 2
    ids, lp = sample_next(logits, params, [None, None], sampling_logits=forced)
    assert ids.tolist() == [worst, best]
    assert lp[0] == token_logprobs(logits[:1], ids[:1], T)[0]  # untruncated fallback
    assert lp[1] == token_logprobs(logits[1:], ids[1:], T, top_k=5)[0]  # truncated
    assert lp[1] > token_logprobs(logits[1:], ids[1:], T)[0]  # renormalised over 5 tokens: larger


def test_the_runs_sampling_settings_reach_the_learner_and_megatron_refuses_truncation():
    """``rollout.top_k`` / ``top_p`` are the run's one rollout setting: the learner config carries
    them; the megatron backend (vocabulary-parallel, untruncated log-probs) refuses them up front."""
    from trainer.config import ConfigError, load_config
    from trainer.config.specs import learner_config
    from trainer.learner.backends.megatron.rank_learner import MegatronRankLearner

    cfg = load_config(str(ROOT / "configs/math_tool/cpu_tiny.yaml"),
                      ["rollout.top_p=0.9", "rollout.top_k=20", "rollout.temperature=0.7"])
    lc = learner_config(cfg)
    assert (lc.temperature, lc.top_k, lc.top_p) == (0.7, 20, 0.9)
    with pytest.raises(ConfigError, match=r"^rollout\.top_k=20 / rollout\.top_p=0\.9 with learner"):
        MegatronRankLearner("/nonexistent", copc.get_preset("copc"), lc, None)
    # and at load, before any rank starts (its registry metadata: truncated_sampling=False; review)
    with pytest.raises(ConfigError, match=r"^rollout\.top_k=20 / rollout\.top_p=0\.9 with "
                                          r"learner\.backend='megatron': this backend's log-probs are"):
        load_config(str(ROOT / "configs/math_tool/cpu_tiny.yaml"),
                    ["rollout.top_p=0.9", "rollout.top_k=20", "learner.backend=megatron"])
    for backend in ("torch", "fsdp"):  # these replay the support
        load_config(str(ROOT / "configs/math_tool/cpu_tiny.yaml"),
                    ["rollout.top_p=0.9", "rollout.top_k=20", f"learner.backend={backend}"])
