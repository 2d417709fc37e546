"""LoRA in the learner (``learner.lora`` / ``learner.critic_lora``): only adapter parameters (and the
critic's value head) train, are optimised and checkpointed; the merged export equals the adapter model;
resume is exact (adapters and optimizer state); bad settings and missing target modules fail with one
line naming the key.

Real components: tiny transformers models with real peft adapters, the real TorchLearner, the real
checkpoint manager, the HF export, ``copc eval``'s checkpoint reader and the ``copc`` CLI.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import copc
from trainer.config import ConfigError, load_config
from trainer.config.specs import learner_spec
from trainer.evaluate.policy import checkpoint_policy_weights
from trainer.learner import learner_checkpoint_state, make_learner
from trainer.learner.backends.torch import TorchLearner, response_logprobs
from trainer.learner.settings import LearnerConfig, OptimizerSettings
from trainer.models.export import save_hf_weights
from trainer.models.loading import load_model_and_tokenizer
from trainer.models.lora import LoraSettings
from trainer.models.tiny import TinyModelConfig, save_tiny_checkpoint
from trainer.outputs.checkpoint import CheckpointManager

from ..app.test_run_e2e import REPO
from ..orchestration.test_loop_learner import _batch

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ACTOR = LoraSettings(rank=4, alpha=8.0, dropout=0.1, target_modules=("q_proj", "v_proj", "up_proj"))
CRITIC = LoraSettings(rank=2, alpha=4.0, target_modules=("k_proj", "down_proj"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(save_tiny_checkpoint(tmp_path_factory.mktemp("tiny_lora"), TinyModelConfig(
        hidden_size=32, intermediate_size=64, num_layers=2)))


def _learner(path, lora=ACTOR, critic_lora=CRITIC, lr=3e-2, preset="copc"):
    actor, tok = load_model_and_tokenizer(path)
    cfg = LearnerConfig(optim=OptimizerSettings(actor_lr=lr, critic_lr=lr), micro_batch_size=3, lora=lora,
                        critic_lora=critic_lora)
    return TorchLearner(actor, copc.get_preset(preset), cfg), tok


def _names(params, model):
    ids = {id(p) for p in params}
    return sorted(n for n, p in model.named_parameters() if id(p) in ids)


def test_only_adapters_and_value_head_train_and_are_optimised(tiny):
    learner, tok = _learner(tiny)
    base = {k: v.clone() for k, v in load_model_and_tokenizer(tiny)[0].state_dict().items()}
    actor_trainable = [n for n, p in learner.actor.named_parameters() if p.requires_grad]
    critic_trainable = [n for n, p in learner.critic.named_parameters() if p.requires_grad]
    assert actor_trainable and all(".lora_A." in n or ".lora_B." in n for n in actor_trainable)
    assert {n.split(".")[4] for n in actor_trainable} == {"q_proj", "v_proj", "up_proj"}
    assert len(actor_trainable) == 2 * 3 * 2  # A and B, 3 modules, 2 layers
    assert [n for n in critic_trainable if "lora_" not in n] == ["value_head.weight", "value_head.bias"]
    assert {n.split(".")[4] for n in critic_trainable if "lora_" in n} == {"k_proj", "down_proj"}
    # the optimizers hold exactly those parameters
    assert _names(learner.actor_opt.params, learner.actor) == sorted(actor_trainable)
    assert _names(learner.critic_opt.params, learner.critic) == sorted(critic_trainable)
    groups = [p for g in learner.actor_opt.optimizer.param_groups for p in g["params"]]
    assert {id(p) for p in groups} == {id(p) for p in learner.actor_opt.params}
    # one copy of the frozen base: the critic's backbone holds the actor's tensors
    a_emb = learner.actor.get_decoder().embed_tokens.weight
    assert learner.critic.backbone.embed_tokens.weight is a_emb and not a_emb.requires_grad
    batch = _batch(tok)
    for _ in range(3):
        m = learner.step(batch)
    assert m["actor/updated"] == 1.0 and m["actor/grad_norm"] > 0 and m["critic/grad_norm"] > 0
    now = {k.replace(".base_layer.", "."): v for k, v in learner.actor.state_dict().items()
           if "lora_" not in k}
    assert now.keys() == base.keys()
    assert all(torch.equal(now[k], v) for k, v in base.items())  # the base weights did not move by one bit
    lora_b = [p.detach() for n, p in learner.actor.named_parameters() if ".lora_B." in n]
    assert all(float(p.abs().max()) > 0 for p in lora_b)  # started at zero, trained


def test_merged_export_equals_the_adapter_model(tiny, tmp_path):
    learner, tok = _learner(tiny)
    batch = _batch(tok)
    learner.step(batch)
    learner.step(batch)
    learner.actor.eval()
    with torch.no_grad():
        ref = response_logprobs(learner.actor, batch, 1.0)
        weights = dict(learner.export_policy_weights())
        assert not any("lora_" in k or "base_layer" in k for k in weights)
        out = save_hf_weights(weights.items(), tiny, tmp_path / "export")
        merged, _ = load_model_and_tokenizer(out)
        got = response_logprobs(merged, batch, 1.0)
        ids = batch.input_ids
        logits_a = learner.actor(input_ids=ids, attention_mask=batch.attention_mask,
                                 position_ids=batch.position_ids).logits
        logits_m = merged(input_ids=ids, attention_mask=batch.attention_mask,
                          position_ids=batch.position_ids).logits
        base, _ = load_model_and_tokenizer(tiny)
        base_lp = response_logprobs(base, batch, 1.0)
    m = batch.loss_mask.bool()
    assert (logits_a - logits_m).abs().max() < 1e-5
    assert (ref - got)[m].abs().max() < 1e-5
    assert (ref - base_lp)[m].abs().max() > 1e-3  # the adapter does change the model
    assert set(merged.state_dict()) == set(base.state_dict())  # an ordinary checkpoint


def test_checkpoint_holds_adapters_only_and_resume_is_exact(tiny, tmp_path):
    learner, tok = _learner(tiny)
    batch = _batch(tok)
    learner.step(batch)
    learner.step(batch)
    mgr = CheckpointManager(tmp_path / "ck")
    path = mgr.save(2, learner_checkpoint_state(learner))
    state = mgr.load(path)["learner"]
    assert "actor" not in state and "critic" not in state
    saved = {**state["actor_lora"]["tensors"],
             **{f"c.{k}": v for k, v in state["critic_lora"]["tensors"].items()}}
    assert all("lora_" in k or "value_head" in k for k in saved)
    full = sum(v.numel() for v in learner.actor.state_dict().values())
    assert sum(v.numel() for v in saved.values()) < full / 5
    assert state["actor_lora"]["settings"] == ACTOR.to_dict()
    # a fresh learner from the same base, resumed, continues bit for bit like the original
    resumed, _ = _learner(tiny)
    resumed.load_state_dict(state)
    assert resumed.policy_version == 2
    for a, b in ((learner.actor_opt, resumed.actor_opt), (learner.critic_opt, resumed.critic_opt)):
        sa, sb = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
        assert sa.keys() == sb.keys()
        assert all(torch.equal(sa[i]["exp_avg_sq"], sb[i]["exp_avg_sq"]) for i in sa)
    torch.manual_seed(1)
    m1 = learner.step(batch)
    torch.manual_seed(1)
    m2 = resumed.step(batch)
    assert m1["actor/pg_loss"] == m2["actor/pg_loss"] and m1["critic/value_loss"] == m2["critic/value_loss"]
    for a, b in ((learner.actor, resumed.actor), (learner.critic, resumed.critic)):
        for (n, p), (n2, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
            assert n == n2 and torch.equal(p, q), n
    # other LoRA settings, or none, are refused naming the key
    other, _ = _learner(tiny, lora=LoraSettings(rank=8, alpha=8.0, target_modules=ACTOR.target_modules))
    with pytest.raises(ConfigError, match=r"^learner\.lora=.*'rank': 8.*the checkpoint's actor adapter has .*"
                                          r"'rank': 4"):
        other.load_state_dict(state)
    full_ft, _ = _learner(tiny, lora=None, critic_lora=None)
    with pytest.raises(ConfigError, match=r"^learner\.lora: the checkpoint's actor is a LoRA adapter"):
        full_ft.load_state_dict(state)
    with pytest.raises(ConfigError, match=r"^learner\.lora: the checkpoint's actor was fully fine-tuned"):
        resumed.load_state_dict(full_ft.state_dict())


def test_critic_lora_follows_the_actor_or_trains_fully(tiny):
    cfg = load_config(None, [f"model.path={tiny}", "learner.lora.rank=2",
                             "learner.lora.target_modules=[q_proj]"])
    learner = make_learner(learner_spec(cfg), tiny)
    assert learner.cfg.lora == learner.cfg.critic_lora == LoraSettings(rank=2, target_modules=("q_proj",))
    assert {n.split(".")[4] for n, p in learner.critic.named_parameters() if "lora_" in n} == {"q_proj"}
    cfg = load_config(None, [f"model.path={tiny}", "learner.lora.rank=2",
                             "learner.critic_lora.enabled=false"])
    learner = make_learner(learner_spec(cfg), tiny)
    assert learner.cfg.critic_lora is None
    assert all(p.requires_grad for p in learner.critic.parameters())  # its own full copy
    emb = learner.critic.backbone.embed_tokens.weight
    assert emb is not learner.actor.get_decoder().embed_tokens.weight
    assert "critic" in learner.state_dict() and "actor_lora" in learner.state_dict()


def test_eval_checkpoint_reads_the_merged_policy(tiny, tmp_path):
    cfg = load_config(None, [f"model.path={tiny}", "learner.lora.rank=4",
                             "learner.lora.target_modules=[q_proj,v_proj]", f"output_dir={tmp_path}"])
    learner = make_learner(learner_spec(cfg), tiny)
    _, tok = load_model_and_tokenizer(tiny)
    learner.step(_batch(tok))
    path = CheckpointManager(tmp_path / "checkpoints").save(1, learner_checkpoint_state(learner))
    weights = checkpoint_policy_weights(learner_spec(cfg), path, tiny)
    expected = dict(learner.export_policy_weights())
    assert weights.keys() == expected.keys()
    assert all(torch.equal(weights[k], expected[k]) for k in expected)
    base = load_model_and_tokenizer(tiny)[0].state_dict()
    assert any(not torch.equal(v, base[k]) for k, v in weights.items())


@pytest.mark.parametrize("override, message", [
    ("learner.lora.rank=0", "learner.lora.rank=0: must be an int >= 1"),
    ("learner.lora.alpha=0", "learner.lora.alpha=0.0: must be a finite number > 0"),
    ("learner.lora.dropout=1.0", "learner.lora.dropout=1.0: must be in [0, 1)"),
    ("learner.lora.target_modules=[]",
     "learner.lora.target_modules=[]: must be a non-empty list of module names"),
    ("learner.lora.target_modules=[all-linear,q_proj]",
     "learner.lora.target_modules=['all-linear', 'q_proj']: 'all-linear' stands alone"),
    ("learner.critic_lora.rank=-2", "learner.critic_lora.rank=-2: must be an int >= 1"),
    ("learner.lora.rnk=3", "learner.lora.rnk: Key 'rnk' not in 'LoraSection'"),
])
def test_bad_lora_settings_name_the_key(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_lora_with_a_backend_that_cannot_train_adapters_is_refused():
    with pytest.raises(ConfigError, match=r"^learner\.lora: learner\.backend='fsdp' does not train LoRA "
                                          r"adapters \(backends that do: \[.*'torch'.*\]\)"):
        load_config(None, ["learner.lora.rank=4", "learner.backend=fsdp",
                           "learner.backend_settings.world_size=2"])


def test_missing_target_modules_fail_at_model_load_naming_the_key(tiny):
    with pytest.raises(ConfigError, match=r"^learner\.lora\.target_modules: no module named 'qkv', 'fc1' in "
                                          r"the model \(Qwen2ForCausalLM\); its linear layers: down_proj, "
                                          r"gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj$"):
        _learner(tiny, lora=LoraSettings(target_modules=("q_proj", "qkv", "fc1")))
    with pytest.raises(ConfigError,
                       match=r"^learner\.critic_lora\.target_modules: no module named 'lm_head'"):
        _learner(tiny, lora=None, critic_lora=LoraSettings(target_modules=("lm_head",)))
    with pytest.raises(ConfigError, match=r"^learner\.lora\.target_modules: 'lm_head' is tied to the input "
                                          r"embeddings"):
        _learner(tiny, lora=LoraSettings(target_modules=("lm_head",)))


def test_cli_train_with_missing_target_modules_exits_2_with_one_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    res = subprocess.run([sys.executable, "-m", "trainer.cli", "train", "--config",
                          "configs/math_tool/cpu_tiny.yaml", "warm_start.enabled=false", "eval.enabled=false",
                          f"output_dir={tmp_path / 'o'}", "learner.lora.target_modules=[q_proj,c_attn]"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, res.stderr[-2000:]
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("copc train: config error: learner.lora.target_modules: no module named 'c_attn' "
                           "in the model (Qwen2ForCausalLM); its linear layers: ")
    assert "Traceback" not in res.stderr


def test_adapters_train_under_activation_checkpointing(tiny):
    """Activation checkpointing (``learner.backend_settings.gradient_checkpointing``) gives the adapters
    exactly the updates they get without it (the critic's from step 2 on: its value head starts at 0)."""
    _, tok = load_model_and_tokenizer(tiny)
    batch, trained = _batch(tok), {}
    lora = LoraSettings(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"))
    for mode in ("off", "on"):
        torch.manual_seed(0)  # the same random lora_A
        actor, _ = load_model_and_tokenizer(tiny)
        if mode == "on":
            actor.gradient_checkpointing_enable()
        learner = TorchLearner(actor, copc.get_preset("copc"), LearnerConfig(
            optim=OptimizerSettings(actor_lr=1e-2, critic_lr=1e-2), micro_batch_size=6, lora=lora,
            critic_lora=lora))
        for _ in range(2):
            learner.step(batch)
        trained[mode] = {f"{role}.{n}": p.detach().clone() for role, model in (("a", learner.actor),
                                                                               ("c", learner.critic))
                         for n, p in model.named_parameters() if p.requires_grad}
    assert trained["on"].keys() == trained["off"].keys()
    assert all((trained["on"][n] - trained["off"][n]).abs().max() < 1e-6 for n in trained["off"])
    assert all(float(v.abs().max()) > 0 for n, v in trained["off"].items() if ".lora_B." in n)


def test_bfloat16_base_trains_float32_adapters_and_value_head(tiny):
    """``model.dtype: bfloat16`` + LoRA: the frozen base stays bfloat16, the adapters and the value head
    are float32, and an update of ``lr = 1e-6`` (the actor's usual rate) moves them; in bfloat16 an
    AdamW step of ~1e-6 on a lora_A entry of ~0.1 rounds away (8 significant bits)."""
    torch.manual_seed(0)  # lora_A's random initialisation
    actor, tok = load_model_and_tokenizer(tiny, dtype=torch.bfloat16)
    cfg = LearnerConfig(optim=OptimizerSettings(actor_lr=1e-6, critic_lr=1e-6), micro_batch_size=3,
                        lora=ACTOR, critic_lora=CRITIC)
    learner = TorchLearner(actor, copc.get_preset("copc"), cfg)
    for model in (learner.actor, learner.critic):
        trained = {n: p.dtype for n, p in model.named_parameters() if p.requires_grad}
        frozen = {p.dtype for p in model.parameters() if not p.requires_grad}
        assert trained and set(trained.values()) == {torch.float32}, trained
        assert frozen == {torch.bfloat16}
    assert learner.critic.value_head.weight.dtype == torch.float32
    lora_a = {n: p.detach().clone() for n, p in learner.actor.named_parameters() if ".lora_A." in n}
    batch = _batch(tok)
    m = {}
    for _ in range(2):
        m = learner.step(batch)
    assert m["actor/updated"] == 1.0 and m["actor/grad_norm"] > 0
    moved = {n: float((p.detach() - lora_a[n]).abs().max()) for n, p in learner.actor.named_parameters()
             if n in lora_a}
    assert all(0 < d < 1e-4 for d in moved.values()), moved  # moved by ~lr per step, not rounded away
    now = {n: p.detach() for n, p in learner.actor.named_parameters() if n in lora_a}
    # the same update in bfloat16 weights: nearly every entry rounds back to where it started
    kept = torch.cat([(v.bfloat16() == lora_a[n].bfloat16()).flatten() for n, v in now.items()])
    assert float(kept.float().mean()) > 0.95, float(kept.float().mean())
    assert all(not torch.equal(v, lora_a[n]) for n, v in now.items())


def test_full_fine_tune_of_a_bfloat16_model_is_refused_naming_model_dtype(tiny):
    actor, _ = load_model_and_tokenizer(tiny, dtype=torch.bfloat16)
    with pytest.raises(ConfigError, match=r"^model\.dtype: the actor's trained parameter model\.embed_tokens"
                                          r"\.weight is bfloat16; this backend updates float32 weights only: "
                                          r"use learner\.lora .* or learner\.backend=fsdp"):
        TorchLearner(actor, copc.get_preset("copc"), LearnerConfig(micro_batch_size=3))
    actor, _ = load_model_and_tokenizer(tiny, dtype=torch.bfloat16)  # LoRA actor, fully trained critic
    with pytest.raises(ConfigError, match=r"^model\.dtype: the critic's trained parameter"):
        TorchLearner(actor, copc.get_preset("copc"), LearnerConfig(micro_batch_size=3, lora=ACTOR))
