"""The chunked log-prob path (hidden states at the model tokens, LM head + log-softmax in chunks with
recomputation in backward) against today's full-logits path, on real tiny models and on the real
SmolLM2-135M-Instruct (``realmodel``).

The reference is :func:`full_logits_scores`: ``model(...).logits`` over the whole sequence, then
:func:`trainer.logprobs.token_logprobs` at the response columns (the torch learner's path before
the chunked one). Goals: log-probs within 1e-5 absolute, gradients within 1e-4 relative (per
parameter tensor, ``‖Δg‖ / ‖g‖``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import copc
from trainer.config import ConfigError, load_config, plugin_settings
from trainer.config.specs import learner_spec
from trainer.learner import make_learner
from trainer.learner.backends.torch import TorchLearner, response_scores
from trainer.learner.settings import LearnerConfig, OptimizerSettings
from trainer.logprobs import token_logprobs
from trainer.models.chunked_logprobs import chunked_token_scores
from trainer.models.lm_head import check_output_head, output_head, token_scores
from trainer.models.loading import load_model_and_tokenizer
from trainer.models.tiny import TinyModelConfig, build_tiny_model, save_tiny_checkpoint
from trainer.rollout.batch import RolloutBatch, to_batch
from trainer.rollout.trajectory import Trajectory

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 300


def tiny_model(arch: str = "qwen2", seed: int = 1, tied: bool = True) -> nn.Module:
    model = build_tiny_model(TinyModelConfig(arch=arch, hidden_size=32, intermediate_size=64, seed=seed),
                             VOCAB, VOCAB - 2, VOCAB - 1)
    if not tied:  # an untied head with its own weight
        model.config.tie_word_embeddings = False
        model.lm_head = nn.Linear(32, VOCAB, bias=False)
    with torch.no_grad():  # logits of std ~1 (the default init gives a near-uniform distribution)
        model.lm_head.weight.normal_(0.0, 0.2, generator=torch.Generator().manual_seed(seed))
    return model


def padded_batch(vocab: int = VOCAB, seed: int = 0, prompt_lens=(3, 7, 5), turn_lens=((4, 6), (9, 2), (1, 5)),
                 pad_id: int = VOCAB - 1) -> RolloutBatch:
    """Rows with prompts of different lengths (left padding), two model turns with an observation
    between them, responses of different lengths (right padding)."""
    g = torch.Generator().manual_seed(seed)
    trs = []
    for i, (p, (a, b)) in enumerate(zip(prompt_lens, turn_lens, strict=True)):
        tr = Trajectory(prompt_ids=torch.randint(0, vocab - 2, (p,), generator=g).tolist(), sample_id=i,
                        group_id=i)
        tr.append_model_tokens(torch.randint(0, vocab - 2, (a,), generator=g).tolist(), [-1.0] * a, 0)
        tr.append_observation_tokens(torch.randint(0, vocab - 2, (3,), generator=g).tolist())
        tr.append_model_tokens(torch.randint(0, vocab - 2, (b,), generator=g).tolist(), [-1.0] * b, 0)
        tr.reward = float(i % 2)
        trs.append(tr)
    return to_batch(trs, pad_id)


def full_logits_scores(model: nn.Module, b: RolloutBatch, temperature: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Today's path (the reference): the full ``(B, P + T, V)`` logits, then the response columns;
    ``(log-probs, entropies)`` ``(B, T)``."""
    logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=b.position_ids).logits
    resp = logits[:, b.prompt_len - 1:-1]
    z = resp.float() / temperature
    entropy = -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1)
    return token_logprobs(resp, b.response_ids, temperature), entropy


def weighted_loss(logp: torch.Tensor, ent: torch.Tensor, b: RolloutBatch, seed: int = 5) -> torch.Tensor:
    """A loss touching every model token with its own weight (log-probs and entropies)."""
    g = torch.Generator().manual_seed(seed)
    w, u = torch.randn(logp.shape, generator=g), torch.randn(logp.shape, generator=g)
    m = b.loss_mask
    return (w * logp * m).sum() + 0.3 * (u * ent * m).sum()


def grads(model: nn.Module, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    gs = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
    return {n: g for (n, _), g in zip(named, gs, strict=True) if g is not None}


def assert_same_grads(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], rel: float = 1e-4) -> None:
    assert set(got) == set(want) and want, set(got) ^ set(want)
    bad = {n: float((got[n] - want[n]).norm() / want[n].norm()) for n in want
           if float((got[n] - want[n]).norm()) > rel * float(want[n].norm())}
    assert not bad, bad
    assert max(float(g.abs().max()) for g in want.values()) > 1e-3  # gradients are not ~0


def check_against_reference(model: nn.Module, b: RolloutBatch, temperature: float, chunk: int,
                            lp_tol: float = 1e-5) -> None:
    mask = b.loss_mask.bool()
    ref_lp, ref_ent = full_logits_scores(model, b, temperature)
    want = grads(model, weighted_loss(ref_lp, ref_ent, b))
    lp, ent = response_scores(model, b, temperature, chunk_tokens=chunk, entropy=True)
    assert lp.shape == ent.shape == mask.shape and lp.dtype == ent.dtype == torch.float32
    got = grads(model, weighted_loss(lp, ent, b))
    lp, ent, ref_lp, ref_ent = (t.detach() for t in (lp, ent, ref_lp, ref_ent))
    assert float((lp - ref_lp)[mask].abs().max()) <= lp_tol
    assert float((ent - ref_ent)[mask].abs().max()) <= 10 * lp_tol
    assert float(lp[~mask].abs().max()) == 0.0 and float(ent[~mask].abs().max()) == 0.0
    assert float(ref_lp[mask].std()) > 0.3 and float(ref_ent[mask].std()) > 0.03  # not constants
    assert_same_grads(got, want)


@pytest.mark.parametrize("arch,tied", [("qwen2", True), ("llama", True), ("llama", False)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [1, 5, 512])
def test_log_probs_entropies_and_gradients_equal_the_full_logits_path(arch, tied, temperature, chunk):
    b = padded_batch()
    assert b.loss_mask.sum() == 27 and b.loss_mask.shape[1] == 14  # 27 model tokens: no chunk divides them
    assert int((b.attention_mask == 0).sum()) > 0  # left and right padding
    check_against_reference(tiny_model(arch, tied=tied).train(), b, temperature, chunk)


def test_garbage_at_padding_and_masked_columns_changes_nothing():
    """Random ids at every padding position (left of the prompts, right of the responses) and random
    behaviour log-probs / rewards off the model tokens: the log-probs, entropies and gradients are
    the same; columns off the model tokens are 0."""
    model, b = tiny_model("llama"), padded_batch(seed=3)
    lp, ent = response_scores(model, b, 0.8, chunk_tokens=4, entropy=True)
    g0 = grads(model, weighted_loss(lp, ent, b))
    junk = RolloutBatch(**{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in vars(b).items()})
    gen = torch.Generator().manual_seed(11)
    pad = junk.attention_mask == 0
    junk.input_ids[pad] = torch.randint(0, VOCAB, (int(pad.sum()),), generator=gen)
    off = junk.loss_mask == 0
    junk.logp_mu[off] = torch.randn(int(off.sum()), generator=gen)
    lp2, ent2 = response_scores(model, junk, 0.8, chunk_tokens=4, entropy=True)
    assert not torch.equal(junk.input_ids, b.input_ids)
    assert_same_grads(grads(model, weighted_loss(lp2, ent2, junk)), g0, rel=1e-6)
    assert float((lp2 - lp).detach().abs().max()) <= 1e-6 and float((ent2 - ent).detach().abs().max()) <= 1e-6


def test_pure_tensor_scores_with_bias_scale_and_bfloat16():
    """``chunked_token_scores`` alone: bias, a logit multiplier, T != 1, a chunk not dividing N, float32
    and bfloat16 (the head runs in the parameter dtype, as the model's)."""
    g = torch.Generator().manual_seed(0)
    for dtype, rel in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        h = torch.randn(37, 16, generator=g).to(dtype).requires_grad_()
        w = torch.randn(53, 16, generator=g).to(dtype).requires_grad_()
        bias = torch.randn(53, generator=g).to(dtype).requires_grad_()
        t = torch.randint(0, 53, (37,), generator=g)
        logits = torch.nn.functional.linear(h, w, bias) * 0.5
        z = logits.float() / 1.3
        ref_lp, ref_ent = token_logprobs(logits, t, 1.3), -(z.softmax(-1) * z.log_softmax(-1)).sum(-1)
        coef = torch.randn(2, 37, generator=g)
        want = torch.autograd.grad((coef[0] * ref_lp + coef[1] * ref_ent).sum(), (h, w, bias))
        lp, ent = chunked_token_scores(h, w, t, bias=bias, temperature=1.3, scale=0.5, chunk_tokens=8,
                                       entropy=True)
        got = torch.autograd.grad((coef[0] * lp + coef[1] * ent).sum(), (h, w, bias))
        lp, ent, ref_lp, ref_ent = (x.detach() for x in (lp, ent, ref_lp, ref_ent))
        assert float((lp - ref_lp).abs().max()) <= 1e-5 and float((ent - ref_ent).abs().max()) <= 1e-4
        for a, e in zip(got, want, strict=True):
            assert a.dtype == e.dtype
            assert float((a.float() - e.float()).norm()) <= rel * float(e.float().norm())
    with pytest.raises(ValueError, match="chunk_tokens must be an int >= 1"):
        chunked_token_scores(h, w, t, chunk_tokens=0)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        chunked_token_scores(h, w, t, temperature=0.0)


def test_a_peft_lora_model_scores_as_its_own_forward():
    """A ``peft`` LoRA wrapper (adapters inside the decoder, frozen base): the same log-probs and LoRA
    gradients as the wrapper's own full-logits forward; LoRA on ``lm_head`` is refused."""
    peft = pytest.importorskip("peft")
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                          init_lora_weights=False)
    model = peft.get_peft_model(tiny_model("qwen2"), cfg)
    check_output_head(model)
    b = padded_batch(seed=4)
    check_against_reference(model.train(), b, 0.7, 5)
    assert all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    on_head = peft.get_peft_model(tiny_model("llama", tied=False),
                                  peft.LoraConfig(r=2, target_modules=["lm_head"]))
    with pytest.raises(ValueError, match=r"is not a plain nn\.Linear"):
        output_head(on_head)


def test_logit_scaling_is_honoured_soft_capping_and_hidden_transforms_are_refused():
    from transformers import Gemma2Config, Gemma2ForCausalLM, GraniteConfig, GraniteForCausalLM

    small = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    torch.manual_seed(0)
    granite = GraniteForCausalLM(GraniteConfig(**small, logits_scaling=4.0)).float()
    with torch.no_grad():
        granite.lm_head.weight.normal_(0.0, 0.8)
    assert output_head(granite).scale == 0.25
    check_output_head(granite)
    check_against_reference(granite.train(), padded_batch(seed=5), 0.9, 7)

    gemma = Gemma2ForCausalLM(Gemma2Config(**small, final_logit_softcapping=30.0)).float()
    with pytest.raises(ValueError, match=r"final_logit_softcapping=30.0 .* not supported"):
        output_head(gemma)

    class Doubled(type(tiny_model("llama"))):  # a forward that transforms its logits, no config says so
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 2.0
            return out

    odd = Doubled(tiny_model("llama").config)
    with pytest.raises(ValueError, match=r"Doubled: the output head .* does not give the model's logits"):
        TorchLearner(odd, copc.get_preset("copc"), LearnerConfig())


def test_token_scores_refuses_column_zero_and_bad_shapes():
    model, b = tiny_model(), padded_batch()
    bad = torch.zeros_like(b.input_ids, dtype=torch.bool)
    bad[0, 0] = True
    with pytest.raises(ValueError, match="column 0 cannot be scored"):
        token_scores(model, b.input_ids, b.attention_mask, b.position_ids, bad)
    with pytest.raises(ValueError, match="must have the shape of input_ids"):
        token_scores(model, b.input_ids, b.attention_mask, b.position_ids, bad[:, 1:])


def test_the_learner_logs_the_actor_entropy_and_its_log_probs_are_the_reference():
    """``actor/entropy`` is the mean entropy over the action tokens under the weights before the
    update (one mini-batch: its forward runs before the first optimizer step), whatever the
    micro-batch size (token-weighted); the recomputed ``logp_old`` equals the reference."""
    actor = tiny_model("qwen2", seed=3)
    b = padded_batch(seed=6)
    with torch.no_grad():
        ref_lp, ref_ent = full_logits_scores(actor, b, 0.7)
    m = b.loss_mask.bool()
    for mbs, chunk in ((3, 512), (1, 3)):
        learner = TorchLearner(tiny_model("qwen2", seed=3), copc.get_preset("copc"), LearnerConfig(
            optim=OptimizerSettings(actor_lr=1e-2), micro_batch_size=mbs, temperature=0.7,
            logprob_chunk_tokens=chunk))
        logp_old, _ = learner.recompute(b)
        assert float((logp_old - ref_lp)[m].abs().max()) <= 1e-5
        metrics = learner.step(b)
        assert metrics["actor/entropy"] == pytest.approx(float(ref_ent[m].mean()), abs=1e-5)
    assert 0.5 < float(ref_ent[m].mean()) < float(torch.log(torch.tensor(VOCAB)))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    return str(save_tiny_checkpoint(tmp_path_factory.mktemp("tiny_gc"),
                                    TinyModelConfig(hidden_size=32, intermediate_size=64, num_layers=2)))


def test_gradient_checkpointing_recomputes_the_decoder_with_the_same_update(tiny_dir):
    """``learner.backend_settings.gradient_checkpointing=true``: both models' decoder layers are
    checkpointed (each layer runs again in backward) and one SGD step gives the same metrics and weights."""
    common = ["preset=copc", "learner.optimizer=sgd", "train.actor_lr=1e-2", "train.critic_lr=1e-2",
              "train.micro_batch_size=2", "train.num_mini_batches=1"]
    b = padded_batch(vocab=256, pad_id=257)
    out = {}
    for gc in ("false", "true"):
        cfg = load_config(None, [*common, f"learner.backend_settings.gradient_checkpointing={gc}"])
        learner = make_learner(learner_spec(cfg), tiny_dir)
        calls: list[int] = []
        for model in (learner.actor.get_decoder(), learner.critic.backbone):
            assert all(layer.gradient_checkpointing == (gc == "true") for layer in model.layers)
            mlp = model.layers[0].mlp  # runs inside the checkpoint (module hooks do not rerun there)
            mlp.forward = (lambda f, c: lambda *a, **k: c.append(1) or f(*a, **k))(mlp.forward, calls)
        out[gc] = (learner.step(b), learner.actor.state_dict(), len(calls))
    (m0, w0, n0), (m1, w1, n1) = out["false"], out["true"]
    assert n1 == n0 + 4  # 2 micro-batches x (actor + critic) layer-0 recomputations in backward
    for k in m0:
        if not k.startswith("perf/"):
            assert m1[k] == pytest.approx(m0[k], abs=1e-6), k
    assert max(float((w1[k] - w0[k]).abs().max()) for k in w0) <= 1e-6


@pytest.mark.parametrize("override,match", [
    (["model.gradient_checkpointing=true"],
     r"^model.gradient_checkpointing: moved to learner.backend_settings.gradient_checkpointing$"),
    (["learner.backend_settings.logprob_chunk_tokens=0"],
     r"^learner.backend_settings.logprob_chunk_tokens=0: must be an int >= 1$"),
])
def test_config_keys_name_the_new_spelling(override, match, tmp_path):
    with pytest.raises(ConfigError, match=match):
        load_config(None, override)
    key, _, value = override[0].partition("=")
    *sections, name = key.split(".")
    nested = "".join(f"{'  ' * i}{s}:\n" for i, s in enumerate(sections))
    (tmp_path / "c.yaml").write_text(f"{nested}{'  ' * len(sections)}{name}: {value}\n")
    with pytest.raises(ConfigError, match=match.lstrip("^")):
        load_config(tmp_path / "c.yaml")
    cfg = load_config(None, ["learner.backend_settings.logprob_chunk_tokens=64"])
    assert plugin_settings(cfg, "learner.backend").logprob_chunk_tokens == 64


@pytest.mark.realmodel
def test_smollm2_chunked_path_equals_the_full_logits_path(realmodel_path: Path):
    """SmolLM2-135M-Instruct (vocabulary 49,152, tied embeddings): 2 rows of up to 64 tokens, left
    padding, T = 0.7, a chunk of 24 tokens (not dividing the 47 model tokens)."""
    model, tok = load_model_and_tokenizer(realmodel_path)
    check_output_head(model)
    b = padded_batch(vocab=tok.vocab_size, seed=7, prompt_lens=(12, 16), turn_lens=((20, 4), (17, 6)),
                     pad_id=tok.pad_token_id)
    assert b.input_ids.shape == (2, 16 + 20 + 3 + 4) and int(b.loss_mask.sum()) == 47
    check_against_reference(model.train(), b, 0.7, 24)
