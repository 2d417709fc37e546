"""Micro-batches without the batch's padding columns (:meth:`RolloutBatch.trimmed`): by hand on a
3-row batch, and on a real (tiny) transformers model, where a short micro-batch cut out of a batch
with a long row gives the same log-probs, values and gradients as the same rows batched alone, and
the whole-batch recompute (rows sorted by length into micro-batches) gives each row what it gets
alone, in batch order."""

from __future__ import annotations

import pytest
import torch

from trainer.learner.settings import OptimizerSettings
from trainer.models.tiny import TinyModelConfig, save_tiny_checkpoint
from trainer.rollout.batch import pad_response, to_batch
from trainer.rollout.trajectory import NO_VERSION, Trajectory

from ..learner.test_autocast import _learner

OPT = OptimizerSettings(actor_lr=1e-3, critic_lr=1e-3, grad_clip=1e6)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(save_tiny_checkpoint(tmp_path_factory.mktemp("tiny_trim"),
                                    TinyModelConfig(hidden_size=64, intermediate_size=128, num_layers=2)))


def _traj(i: int, prompt: int, model: int, obs: int = 0) -> Trajectory:
    g = torch.Generator().manual_seed(i)
    tr = Trajectory(prompt_ids=torch.randint(3, 250, (prompt,), generator=g).tolist(), sample_id=i,
                    group_id=i)
    ids = torch.randint(3, 250, (model + obs,), generator=g).tolist()
    tr.append_model_tokens(ids[:2], [-4.0, -4.5], 0)
    if obs:
        tr.append_observation_tokens(ids[2:2 + obs])
    tr.append_model_tokens(ids[2 + obs:], [-5.0] * (model - 2), 0)
    tr.reward = 1.0
    return tr


def test_trimmed_by_hand():
    b = to_batch([_traj(0, 3, 4), _traj(1, 5, 2), _traj(2, 2, 9, obs=3)], pad_token_id=0)
    assert (b.prompt_len, b.loss_mask.shape[1]) == (5, 12)
    short = b.select([0])  # prompt 3 of 5 columns, response 4 of 12
    t = short.trimmed()
    assert (t.prompt_len, t.loss_mask.shape[1], t.input_ids.shape[1]) == (3, 4, 7)
    assert torch.equal(t.input_ids, short.input_ids[:, 2:9])
    assert torch.equal(t.position_ids, torch.arange(7)[None])
    assert t.attention_mask.all() and t.loss_mask.tolist() == [[1.0] * 4]
    assert torch.equal(t.logp_mu, short.logp_mu[:, :4]) and torch.equal(t.rewards, short.rewards[:, :4])
    assert (short.versions[:, 4:] == NO_VERSION).all() and (short.loss_mask[:, 4:] == 0).all()  # what was cut
    two = b.select([0, 1]).trimmed()  # the longer prompt and the longer response set the widths
    assert (two.prompt_len, two.loss_mask.shape[1]) == (5, 4)
    assert b.trimmed() is b  # nothing to cut
    # rows without a prompt (never from the engine, which refuses one): a prompt column stays, so
    # column 0 (never scored) is not a response token
    no_prompt = Trajectory(prompt_ids=[], sample_id=0)
    no_prompt.append_model_tokens([5, 6, 7], [-1.0] * 3, 0)
    t = to_batch([no_prompt, _traj(1, 3, 2)], pad_token_id=0).select([0]).trimmed()
    assert (t.prompt_len, t.loss_mask.shape[1]) == (1, 3)
    assert t.input_ids[0].tolist() == [0, 5, 6, 7] and t.attention_mask[0].tolist() == [0, 1, 1, 1]
    # outputs back to (B, T): zeros in the cut columns
    x = torch.arange(4.0)[None]
    assert pad_response(x, 12).tolist() == [[0.0, 1.0, 2.0, 3.0] + [0.0] * 8]
    assert pad_response(x, 4) is x


def _rows():
    return [_traj(0, 7, 5, obs=2), _traj(1, 4, 3), _traj(2, 9, 30, obs=6), _traj(3, 6, 4, obs=1)]


def test_scores_values_and_grads_of_a_cut_micro_batch_are_those_of_the_rows_alone(tiny):
    rows = _rows()
    lrn, tok = _learner(tiny, None, OPT)
    wide = to_batch(rows, tok.pad_token_id).select([0, 1, 3])  # padded for row 2's 36 response tokens
    alone = to_batch([rows[0], rows[1], rows[3]], tok.pad_token_id)
    assert wide.loss_mask.shape[1] == 36 and alone.loss_mask.shape[1] == 7
    grads = []
    for b in (wide, alone):
        lrn.actor.zero_grad()
        lrn.critic.zero_grad()
        lp, v = lrn.logprobs(b), lrn.values(b)
        assert lp.shape == v.shape == b.loss_mask.shape
        m = b.loss_mask.bool()
        ((lp * m).sum() + (v * m).sum()).backward()
        grads.append(torch.cat([p.grad.flatten() for m_ in (lrn.actor, lrn.critic)
                                for p in m_.parameters() if p.grad is not None]))
        if b is wide:
            lp_w, v_w = lp.detach(), v.detach()
            assert (lp_w[:, 7:] == 0).all() and (v_w[:, 7:] == 0).all()  # the cut columns
    assert torch.allclose(lp_w[:, :7], lp.detach(), atol=1e-5)
    assert torch.allclose(v_w[:, :7] * alone.loss_mask, v.detach() * alone.loss_mask, atol=1e-5)
    assert grads[0].abs().max() > 0
    assert torch.allclose(grads[0], grads[1], atol=1e-5, rtol=1e-4)


def test_recompute_sorts_rows_by_length_and_returns_them_in_batch_order(tiny):
    rows = _rows()
    lrn, tok = _learner(tiny, None, OPT, micro_batch_size=2)
    batch = to_batch(rows, tok.pad_token_id)
    lp, v = lrn.recompute(batch)
    m = batch.loss_mask.bool()
    for i, tr in enumerate(rows):  # each row alone (its own padding only)
        one = to_batch([tr], tok.pad_token_id)
        lp1, v1 = lrn.recompute(one)
        n = one.loss_mask.shape[1]
        assert torch.allclose(lp[i, :n], lp1[0], atol=1e-5), i
        assert torch.allclose(v[i, :n][m[i, :n]], v1[0][m[i, :n]], atol=1e-5), i
        assert (lp[i, n:] == 0).all()
