"""``learner.backend_settings.shared_prefix_tokens`` on a real (tiny) transformers model: a
micro-batch's common prefix run once gives the plain forward's hidden states, log-probs, values and
gradients (float rounding apart), whatever the padding holds; too short a prefix is the plain
forward, bit for bit; bad settings are one line naming the key."""

from __future__ import annotations

import pytest
import torch

from trainer.config import ConfigError, load_config, plugin_settings
from trainer.learner.settings import OptimizerSettings
from trainer.models.loading import load_model_and_tokenizer
from trainer.models.shared_prefix import common_prefix_len, decoder_hidden_states
from trainer.models.tiny import TinyModelConfig, save_tiny_checkpoint
from trainer.rollout.batch import to_batch
from trainer.rollout.trajectory import Trajectory

from ..learner.test_autocast import _learner as autocast_learner

OPT = OptimizerSettings(actor_lr=1e-3, critic_lr=1e-3, grad_clip=1e6)  # reports grad_norm; never binds
PREFIX = 24  # tokens every prompt starts with (a few-shot prompt's stand-in)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(save_tiny_checkpoint(tmp_path_factory.mktemp("tiny_shared_prefix"),
                                    TinyModelConfig(hidden_size=64, intermediate_size=128, num_layers=2)))


def _batch(pad_id, n=5, prefix=PREFIX):
    """``n`` two-turn episodes whose prompts are ``prefix`` shared tokens + a question of 1..n tokens
    (left padding differs per row), responses of different lengths (right padding), rewards 0/1."""
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(3, 250, (prefix,), generator=g).tolist()
    trs = []
    for i in range(n):
        tr = Trajectory(prompt_ids=shared + torch.randint(3, 250, (1 + i,), generator=g).tolist(),
                        sample_id=i, group_id=i)
        ids = torch.randint(3, 250, (6 + 2 * (n - i),), generator=g).tolist()
        tr.append_model_tokens(ids[:3], [-5.0] * 3, 0)
        tr.append_observation_tokens(ids[3:5])
        tr.append_model_tokens(ids[5:], [-5.5] * len(ids[5:]), 0)
        tr.reward = float(i % 2)
        trs.append(tr)
    return to_batch(trs, pad_id)


def _learner(tiny, shared):
    return autocast_learner(tiny, None, OPT, shared_prefix_tokens=shared)


def test_common_prefix_len_by_hand():
    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [0, 5, 6, 7, 9, 1], [5, 6, 7, 8, 2, 0]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0]])
    c, starts = common_prefix_len(ids, mask)
    assert c == 3 and starts.tolist() == [2, 1, 0]  # 5 6 7, then 8 / 9 / 8
    assert common_prefix_len(ids[:1], mask[:1])[0] == 4  # one row: all of its real tokens
    assert common_prefix_len(torch.tensor([[1, 2], [3, 2]]), torch.ones(2, 2, dtype=torch.long))[0] == 0


def test_hidden_states_and_gradients_are_the_plain_forward(tiny):
    actor, tok = load_model_and_tokenizer(tiny)
    b = _batch(tok.pad_token_id)
    dec = actor.get_decoder()
    real = b.attention_mask.bool()
    plain = dec(input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=b.position_ids,
                use_cache=False).last_hidden_state
    shared = decoder_hidden_states(dec, b.input_ids, b.attention_mask, b.position_ids, 8)
    assert (shared - plain)[real].abs().max() < 1e-5
    starts = b.attention_mask.argmax(dim=1)
    for i, s in enumerate(starts.tolist()):  # left padding: zeros, never read
        assert (shared[i, :s] == 0).all()
    # gradients of every parameter, through the shared keys and values (summed over the rows)
    w = torch.randn(plain.shape)
    grads = []
    for n in (0, 8):  # 0: the plain forward
        dec.zero_grad()
        h = decoder_hidden_states(dec, b.input_ids, b.attention_mask, b.position_ids, n)
        (h * w)[real].sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in dec.parameters()]))
    assert ((grads[0] - grads[1]).norm() / grads[0].norm()) < 1e-5


def test_garbage_at_padding_changes_nothing(tiny):
    actor, tok = load_model_and_tokenizer(tiny)
    b = _batch(tok.pad_token_id)
    dec = actor.get_decoder()
    real = b.attention_mask.bool()
    noisy = b.input_ids.masked_fill(~real, 0) + torch.randint(0, 200, b.input_ids.shape) * (~real)
    h1 = decoder_hidden_states(dec, b.input_ids, b.attention_mask, b.position_ids, 8)
    h2 = decoder_hidden_states(dec, noisy, b.attention_mask, b.position_ids, 8)
    assert torch.equal(h1[real], h2[real])


def test_too_short_a_prefix_is_the_plain_forward_bit_for_bit(tiny):
    actor, tok = load_model_and_tokenizer(tiny)
    b = _batch(tok.pad_token_id)
    dec = actor.get_decoder()
    plain = dec(input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=b.position_ids,
                use_cache=False).last_hidden_state
    for n in (0, PREFIX + 1):  # off, and longer than the rows share
        h = decoder_hidden_states(dec, b.input_ids, b.attention_mask, b.position_ids, n)
        assert torch.equal(h, plain)


def test_a_learner_step_with_a_shared_prefix_is_the_plain_step(tiny):
    (plain, tok), (shared, _) = _learner(tiny, 0), _learner(tiny, 8)
    batch = _batch(tok.pad_token_id)
    m = batch.loss_mask.bool()
    lp0, v0 = plain.recompute(batch)
    lp1, v1 = shared.recompute(batch)
    assert (lp1 - lp0)[m].abs().max() < 1e-5 and (v1 - v0)[m].abs().max() < 1e-5
    assert (lp1[~m] == 0).all()
    m0, m1 = plain.step(batch, version=0), shared.step(batch, version=0)
    assert m0["actor/grad_norm"] > 0 and abs(m1["actor/grad_norm"] / m0["actor/grad_norm"] - 1) < 1e-4
    assert abs(m1["critic/grad_norm"] / m0["critic/grad_norm"] - 1) < 1e-4
    for role in ("actor", "critic"):
        a, c = getattr(plain, role), getattr(shared, role)
        for (n, p), (_, q) in zip(a.named_parameters(), c.named_parameters(), strict=True):
            assert (p - q).abs().max() < 1e-5, (role, n)


def test_bad_settings_are_one_line_naming_the_key():
    cfg = "configs/math_tool/cpu_tiny.yaml"
    with pytest.raises(ConfigError, match=r"learner\.backend_settings\.shared_prefix_tokens.*-1.*must be an "
                                          r"int >= 0"):
        load_config(cfg, ["learner.backend_settings.shared_prefix_tokens=-1"])
    with pytest.raises(ConfigError, match=r"learner\.backend_settings\.shared_prefix_tokens.*"
                                          r"gradient_checkpointing"):
        load_config(cfg, ["learner.backend_settings.shared_prefix_tokens=64",
                          "learner.backend_settings.gradient_checkpointing=true"])
    # a backend whose settings have no shared_prefix_tokens refuses it, naming the key
    with pytest.raises(ConfigError, match=r"learner\.backend_settings\.shared_prefix_tokens=64: unknown "
                                          r"setting of DistributedSettings"):
        load_config(cfg, ["learner.backend_settings.shared_prefix_tokens=64", "learner.backend=fsdp"])
    on = load_config(cfg, ["learner.backend_settings.shared_prefix_tokens=64"])
    assert plugin_settings(on, "learner.backend").shared_prefix_tokens == 64
