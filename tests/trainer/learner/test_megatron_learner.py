"""The megatron rank learner (2 gloo ranks on CPU: TP = 2, and TP = 1 × DP = 2) against the
single-process torch backend, and its ``dist_checkpointing`` resume.

Real components: a tiny Qwen2 (tied embeddings) saved with ``save_pretrained``, Megatron
``GPTModel`` s built through mbridge, Megatron DDP, the torch backend as the reference. The
batch has two PPO mini-batches of 3 rows (micro-batch 1), so at DP = 2 every update splits
2 + 1 rows over the ranks; ``grad_clip`` is small enough to clip, so the global gradient norm
across tensor-parallel shards matters.
"""

from __future__ import annotations

import pytest
import torch

from trainer.config import load_config
from trainer.config.specs import learner_spec
from trainer.learner import make_learner
from trainer.models.tiny import TinyModelConfig, save_tiny_checkpoint
from trainer.rollout.batch import RolloutBatch, to_batch
from trainer.rollout.trajectory import Trajectory

try:
    from .test_megatron_group import RankPool
except ImportError:  # run by path inside a rank process (RankPool's loader): no package, siblings by name
    from test_megatron_group import RankPool

pytestmark = pytest.mark.usefixtures("one_torch_thread")

#: Metrics that depend on how rows are grouped into micro-batches (not on the backend): an ESS is
#: not additive over micro-batches; at DP = 2 the rank split regroups them.
MICRO_BATCH_DEPENDENT = {"actor/ratio_ess"}


@pytest.fixture(scope="module")
def pool():
    p = RankPool(2, timeout_s=300)
    yield p
    p.close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(save_tiny_checkpoint(tmp_path_factory.mktemp("tiny_megatron"),
                                    TinyModelConfig(hidden_size=32, intermediate_size=64, num_layers=2)))


def multiturn_batch(n: int = 6) -> RolloutBatch:
    """``n`` two-turn episodes of different lengths (an observation between the turns), µ off-policy,
    rewards 0/1, groups of 2."""
    g = torch.Generator().manual_seed(0)
    trs = []
    for i in range(n):
        tr = Trajectory(prompt_ids=[40 + i, 41], sample_id=i, group_id=i // 2)
        ids = torch.randint(0, 255, (5 + i,), generator=g).tolist()
        tr.append_model_tokens(ids[:3], [-5.0] * 3, 0)
        tr.append_observation_tokens(ids[3:4])
        tr.append_model_tokens(ids[4:], [-5.5] * len(ids[4:]), 0)
        tr.reward = float(i % 2)
        trs.append(tr)
    return to_batch(trs, 0)


def overrides(preset: str, optimizer: str, **extra: str) -> list[str]:
    base = {"preset": preset, "train.actor_lr": "1e-2", "train.critic_lr": "1e-2",
            "train.micro_batch_size": "1", "train.num_mini_batches": "2", "train.grad_clip": "0.5",
            "learner.optimizer": optimizer, "rollout.n_samples_per_prompt": "2"}
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def torch_gradients(learner) -> dict[str, torch.Tensor]:
    out = {f"actor.{n}": p.grad for n, p in learner.actor.named_parameters() if p.grad is not None}
    if learner.critic is not None:
        out.update({f"critic.{n}": p.grad for n, p in learner.critic.named_parameters()
                    if p.grad is not None})
    return out


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b), set(a) ^ set(b)
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


#: Metrics the torch reference logs that the megatron backend does not compute: the actor's entropy
#: (the torch / fsdp chunked LM head gives it; megatron's vocab-parallel log-probs do not).
NOT_MEGATRON = {"actor/entropy"}


def assert_same_metrics(ref: dict, got: dict, tol: float = 1e-5, skip: set[str] = frozenset()) -> None:
    keys = {k for k in ref if not k.startswith("perf/")} - set(skip) - (NOT_MEGATRON - set(got))
    assert keys <= set(got), keys - set(got)
    bad = {k: (ref[k], got[k]) for k in keys if abs(ref[k] - got[k]) > tol * max(1.0, abs(ref[k]))}
    assert not bad, bad


# -- rank side ---------------------------------------------------------------------------------
def _r_build(state: dict, key: str, exp_cfg, path: str, tp: int) -> int:
    """Build a MegatronRankLearner at tensor-parallel size ``tp`` and keep it as ``state[key]``."""
    import torch.distributed as dist

    from trainer.learner.backends.megatron import build_rank_learner
    from trainer.learner.distributed.base import RankContext

    r, w = state["rank"], state["world_size"]
    ctx = RankContext(rank=r, world_size=w, tp_size=tp, cpu_group=dist.group.WORLD,
                      **RankContext.layout(r, w, tp))
    state[key] = build_rank_learner(learner_spec(exp_cfg), path, ctx)
    return state[key].policy_version


def _r_build_error(state: dict, exp_cfg, path: str, tp: int, pp: int) -> str:
    """The ConfigError message of building a learner that must be refused (the pool stays up)."""
    import torch.distributed as dist

    from trainer.errors import ConfigError
    from trainer.learner.backends.megatron import build_rank_learner
    from trainer.learner.distributed.base import RankContext

    r, w = state["rank"], state["world_size"]
    ctx = RankContext(rank=r, world_size=w, tp_size=tp, pp_size=pp, cpu_group=dist.group.WORLD,
                      **RankContext.layout(r, w, tp, pp))
    try:
        build_rank_learner(learner_spec(exp_cfg), path, ctx)
    except ConfigError as e:
        return str(e)
    return "built"


def _r_call(state: dict, key: str, method: str, *args):
    """``state[key].<method>(*args)`` (or the attribute ``method``); an iterator result (weights)
    comes back as a dict."""
    from trainer.learner.backends.megatron.rank_learner import init_parallel_state

    lrn = state[key]
    init_parallel_state(lrn.ctx)  # the learners of one test module may use different TP sizes
    out = getattr(lrn, method)
    out = out(*args) if callable(out) else out
    if hasattr(out, "__next__"):
        out = dict(out)
    return out


def _r_step_counting_layer_calls(state: dict, key: str, batch: RolloutBatch) -> tuple[dict, int, int]:
    """One step of ``state[key]``; returns its metrics and how often the actor's and the critic's
    first transformer layer ran forward during it (activation recompute re-runs a layer in the
    backward pass)."""
    from trainer.learner.backends.megatron.rank_learner import init_parallel_state

    lrn = state[key]
    init_parallel_state(lrn.ctx)
    counts = [0, 0]
    hooks = []
    for i, model in enumerate((lrn.actor, lrn.critic)):
        def hook(*_args, i=i) -> None:
            counts[i] += 1
        hooks.append(model.module.decoder.layers[0].register_forward_hook(hook))
    try:
        metrics = lrn.step(batch)
    finally:
        for h in hooks:
            h.remove()
    return metrics, counts[0], counts[1]


def build(pool: RankPool, key: str, exp_cfg, path: str, tp: int) -> None:
    assert pool.run(_r_build, key, exp_cfg, path, tp) == [0, 0]


def call(pool: RankPool, key: str, method: str, *args):
    """Rank 0's result of a collective learner call."""
    return pool.run(_r_call, key, method, *args)[0]


# -- tests -------------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", ["copc", "areal", "dapo"])
def test_megatron_sgd_step_equals_the_torch_backend(pool, tiny, preset):
    """Losses, metrics, actor/critic gradients (HF / ValueModel names) and SGD-updated weights of one
    step equal the torch backend's within 1e-5, at TP = 2 and at DP = 2."""
    batch, cfg = multiturn_batch(), load_config(None, overrides(preset, "sgd"))
    ref = make_learner(learner_spec(cfg), tiny)
    init = {k: v.clone() for k, v in ref.actor.state_dict().items()}
    m_ref = ref.step(batch)
    ref_grads, ref_w = torch_gradients(ref), ref.actor.state_dict()
    assert m_ref["actor/grad_norm"] > 0.5  # clipping was active: the global norm over shards matters
    assert max(float(g.abs().max()) for g in ref_grads.values()) > 1e-3  # gradients are not ~0
    assert max_diff(init, ref_w) > 1e-4  # the step moved the weights
    for tp in (2, 1):  # TP = 2 × DP = 1, then TP = 1 × DP = 2
        key = f"{preset}-sgd-tp{tp}"
        build(pool, key, cfg, tiny, tp)
        m = call(pool, key, "step", batch)
        grads, weights = call(pool, key, "named_gradients"), call(pool, key, "export_policy_weights")
        assert_same_metrics(m_ref, m, skip=MICRO_BATCH_DEPENDENT if tp == 1 else set())
        assert abs(m["actor/pg_loss"] - m_ref["actor/pg_loss"]) < 1e-5
        if preset != "dapo":
            assert abs(m["critic/value_loss"] - m_ref["critic/value_loss"]) < 1e-5
            assert any(k.startswith("critic.backbone.") for k in grads) and "critic.value_head.bias" in grads
        else:
            assert not any(k.startswith("critic.") for k in grads)
        assert max_diff(grads, ref_grads) < 1e-5
        assert set(weights) == set(ref_w)  # Hugging Face names, tied lm_head included
        assert max_diff(weights, ref_w) < 1e-5
        assert call(pool, key, "policy_version") == 1


def test_megatron_adamw_step_and_dist_checkpoint_resume(pool, tiny, tmp_path):
    """AdamW at TP = 2: weights after one step equal the torch backend's within 1e-4. The
    dist_checkpointing save restores model, Adam moments, warm-up schedule, step count and the
    value-bias EMA: a fresh learner loading it repeats step 2 bit for bit; a fresh learner at
    TP = 1 × DP = 2 loading the TP = 2 checkpoint (resharded) repeats it within 1e-4 (Adam)."""
    b1, b2 = multiturn_batch(6), multiturn_batch(5)
    cfg = load_config(None, overrides("copc", "adamw", **{"train.warmup_steps": "3"}))
    ref = make_learner(learner_spec(cfg), tiny)
    build(pool, "adam", cfg, tiny, 2)
    m_ref, m = ref.step(b1), call(pool, "adam", "step", b1)
    assert_same_metrics(m_ref, m)
    assert max_diff(call(pool, "adam", "export_policy_weights"), ref.actor.state_dict()) < 1e-4
    shards = tmp_path / "shards"
    call(pool, "adam", "save", shards)
    assert (shards / "actor").is_dir() and (shards / "critic").is_dir()
    assert (shards / "learner_state.pt").is_file()
    m2 = call(pool, "adam", "step", b2)
    w2 = call(pool, "adam", "export_policy_weights")
    assert_same_metrics(ref.step(b2), m2, tol=1e-4)
    assert m2["actor/lr"] == pytest.approx(1e-2) and m["actor/lr"] == pytest.approx(1e-2 * 2 / 3)
    assert "critic/value_bias_drift" in m2
    for key, tp in (("adam-resumed", 2), ("adam-resharded", 1)):
        build(pool, key, cfg, tiny, tp)
        call(pool, key, "load", shards)
        assert call(pool, key, "policy_version") == 1
        m2_again = call(pool, key, "step", b2)
        w2_again = call(pool, key, "export_policy_weights")
        if tp == 2:
            assert {k: v for k, v in m2_again.items() if not k.startswith("perf/")} == \
                {k: v for k, v in m2.items() if not k.startswith("perf/")}
            assert max_diff(w2_again, w2) == 0.0
        else:
            assert_same_metrics(m2, m2_again, tol=1e-4, skip=MICRO_BATCH_DEPENDENT)  # Adam-updated
            assert max_diff(w2_again, w2) < 1e-4
        assert call(pool, key, "policy_version") == 2


@pytest.mark.parametrize("extra,tp,pp,match", [
    (["learner.backend_settings.cpu_offload=true"], 2, 1,
     "learner.backend_settings.cpu_offload=true: an fsdp option"),
    (["model.dtype=bfloat16"], 2, 1, "model.dtype=bfloat16: the megatron backend on CPU runs float32 only"),
    # the config refuses pipeline_parallel_size=2 at load; the rank learner checks its context too
    ([], 1, 2, "learner.backend_settings.pipeline_parallel_size=2: the megatron backend runs pipeline "
               "size 1"),
])
def test_unsupported_settings_are_refused_naming_the_key(pool, tiny, extra, tp, pp, match):
    cfg = load_config(None, overrides("copc", "adamw") + extra + [
        "learner.backend=megatron", "learner.backend_settings.world_size=2",
        f"learner.backend_settings.tensor_parallel_size={tp}"])
    assert all(match in msg for msg in pool.run(_r_build_error, cfg, tiny, tp, pp))


def test_gradient_checkpointing_is_megatron_activation_recompute_with_the_same_gradients(pool, tiny):
    """``learner.backend_settings.gradient_checkpointing=true`` (set by the paper configs) turns on Megatron's
    full recompute: each layer re-runs in the backward pass, and the step (metrics, actor and critic
    gradients, SGD-updated weights) is bit-identical to the step without recompute (TP = 2).

    Layer forward passes per rank (TP = 2: every rank sees all 6 rows; micro-batch 1): without
    recompute, 6 no-grad passes for logp_old / values_old + 6 training passes = 12 per model; with
    recompute each of the 6 training passes re-runs the layer once more in backward = 18."""
    batch = multiturn_batch()
    plain_cfg = load_config(None, overrides("copc", "sgd"))
    rc_cfg = load_config(None, overrides("copc", "sgd",
                                         **{"learner.backend_settings.gradient_checkpointing": "true"}))
    out = {}
    for key, cfg in (("plain", plain_cfg), ("recompute", rc_cfg)):
        build(pool, key, cfg, tiny, 2)
        per_rank = pool.run(_r_step_counting_layer_calls, key, batch)
        metrics, actor_calls, critic_calls = per_rank[0]
        assert all(r[1:] == (actor_calls, critic_calls) for r in per_rank)
        out[key] = (metrics, actor_calls, critic_calls, call(pool, key, "named_gradients"),
                    call(pool, key, "export_policy_weights"))
    m0, a0, c0, g0, w0 = out["plain"]
    m1, a1, c1, g1, w1 = out["recompute"]
    assert m0["actor/updated"] == 1.0 and (a0, c0) == (12, 12) and (a1, c1) == (18, 18)
    assert {k: v for k, v in m1.items() if not k.startswith("perf/")} == \
        {k: v for k, v in m0.items() if not k.startswith("perf/")}
    assert max(float(g.abs().max()) for g in g0.values()) > 1e-3  # the gradients are not ~0
    assert max_diff(g1, g0) == 0.0 and max_diff(w1, w0) == 0.0
