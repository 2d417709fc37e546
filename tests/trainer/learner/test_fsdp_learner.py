"""The fsdp backend (FSDP2, DP = 2 gloo ranks on CPU) against the single-process torch backend.

Real components end to end: a tiny Qwen2 (tied embeddings) saved with ``save_pretrained``, real
rank processes (``learner.backend_settings.launch=spawn``), the torch backend as the reference. The
batch has two PPO mini-batches of 3 rows, so each update splits 2 + 1 rows over the ranks and the
second rank runs one zero-weight padding pass (equal collective counts); ``grad_clip`` is small
enough to clip, so the global gradient norm across shards matters.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trainer.config import ConfigError, load_config
from trainer.config.specs import learner_spec
from trainer.evaluate.policy import checkpoint_policy_weights
from trainer.learner import DistributedSettings, learner_checkpoint_state, make_learner, restore_learner
from trainer.learner.distributed.runtime import DistributedLearner, check_model_parallel
from trainer.learner.distributed.shard import dp_rows, micro_plan
from trainer.models.tiny import TinyModelConfig, save_tiny_checkpoint
from trainer.outputs.checkpoint import CheckpointManager
from trainer.rollout.batch import RolloutBatch, to_batch
from trainer.rollout.trajectory import Trajectory

pytestmark = pytest.mark.usefixtures("one_torch_thread")

#: Metrics the torch backend itself computes per micro-batch and combines by token weight, so they
#: depend on how rows are grouped into micro-batches (not on the backend): ``actor/ratio_ess`` is an
#: ESS (not additive).
MICRO_BATCH_DEPENDENT = {"actor/ratio_ess"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(save_tiny_checkpoint(tmp_path_factory.mktemp("tiny_fsdp"),
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


def fsdp_overrides(preset: str, optimizer: str, **extra: str) -> list[str]:
    return overrides(preset, optimizer,
                     **{"learner.backend": "fsdp", "learner.backend_settings.world_size": "2", **extra})


def torch_gradients(learner) -> dict[str, torch.Tensor]:
    out = {f"actor.{n}": p.grad for n, p in learner.actor.named_parameters() if p.grad is not None}
    if learner.critic is not None:
        out.update({f"critic.{n}": p.grad for n, p in learner.critic.named_parameters()
                    if p.grad is not None})
    return out


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b), set(a) ^ set(b)
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def assert_same_metrics(ref: dict, got: dict, tol: float = 1e-5) -> None:
    keys = {k for k in ref if not k.startswith("perf/")} - MICRO_BATCH_DEPENDENT
    assert keys <= set(got), keys - set(got)
    bad = {k: (ref[k], got[k]) for k in keys if abs(ref[k] - got[k]) > tol * max(1.0, abs(ref[k]))}
    assert not bad, bad


@pytest.mark.parametrize("preset", ["copc", "areal", "dapo"])
def test_fsdp_dp2_sgd_step_equals_the_torch_backend(tiny, preset):
    batch = multiturn_batch()
    ref = make_learner(learner_spec(load_config(None, overrides(preset, "sgd"))), tiny)
    init = {k: v.clone() for k, v in ref.actor.state_dict().items()}
    m_ref = ref.step(batch)
    with make_learner(learner_spec(load_config(None, fsdp_overrides(preset, "sgd"))), tiny) as lrn:
        assert isinstance(lrn, DistributedLearner) and lrn.policy_version == 0
        m = lrn.step(batch)
        grads, weights = lrn.named_gradients(), dict(lrn.export_policy_weights())
    assert lrn.policy_version == 1
    assert_same_metrics(m_ref, m)
    assert abs(m["actor/pg_loss"] - m_ref["actor/pg_loss"]) < 1e-5
    if preset != "dapo":
        assert abs(m["critic/value_loss"] - m_ref["critic/value_loss"]) < 1e-5
        assert any(k.startswith("critic.") for k in grads)
    assert m_ref["actor/grad_norm"] > 0.5  # clipping was active: the global norm over shards mattered
    ref_grads = torch_gradients(ref)
    assert max_diff(grads, ref_grads) < 1e-5
    assert max(float(g.abs().max()) for g in ref_grads.values()) > 1e-3  # gradients are not ~0
    ref_w = ref.actor.state_dict()
    assert set(weights) == set(ref_w)  # Hugging Face names, tied lm_head included
    assert max_diff(weights, ref_w) < 1e-5
    assert max_diff(init, ref_w) > 1e-4  # the step moved the weights


def test_fsdp_dp2_gradient_checkpointing_step_equals_the_torch_backend(tiny):
    """``learner.backend_settings.gradient_checkpointing=true`` on both backends (checkpointed decoder
    layers inside their FSDP units; the actor's chunked LM head through the root unit's registered
    forward method): the same metrics (``actor/entropy`` included), gradients and SGD-updated weights."""
    batch, gc = multiturn_batch(), {"learner.backend_settings.gradient_checkpointing": "true"}
    ref = make_learner(learner_spec(load_config(None, overrides("copc", "sgd", **gc))), tiny)
    m_ref = ref.step(batch)
    with make_learner(learner_spec(load_config(None, fsdp_overrides("copc", "sgd", **gc))), tiny) as lrn:
        m = lrn.step(batch)
        grads, weights = lrn.named_gradients(), dict(lrn.export_policy_weights())
    assert m_ref["actor/entropy"] > 1.0  # the byte model's entropy, logged by both backends
    assert_same_metrics(m_ref, m)
    assert max_diff(grads, torch_gradients(ref)) < 1e-5
    assert max_diff(weights, ref.actor.state_dict()) < 1e-5


def test_fsdp_adamw_cpu_offload_step_and_sharded_checkpoint_round_trip(tiny, tmp_path):
    """AdamW with CPU offload: weights after one step equal the torch backend's within 1e-4; the DCP
    checkpoint restores model, Adam moments, schedulers and the step count exactly: step 2 after
    a reload repeats step 2 bit for bit. ``copc eval --checkpoint`` reads the sharded checkpoint's
    policy weights (a second learner restored from it) bit for bit."""
    b1, b2 = multiturn_batch(6), multiturn_batch(5)
    ref = make_learner(learner_spec(load_config(None, overrides("copc", "adamw",
                                                                **{"train.warmup_steps": "3"}))), tiny)
    cfg = load_config(None, fsdp_overrides("copc", "adamw", **{
        "train.warmup_steps": "3", "learner.backend_settings.cpu_offload": "true"}))
    ckpts = CheckpointManager(tmp_path / "checkpoints")
    with make_learner(learner_spec(cfg), tiny) as lrn:
        m_ref, m = ref.step(b1), lrn.step(b1)
        assert_same_metrics(m_ref, m)
        w1 = dict(lrn.export_policy_weights())
        assert max_diff(w1, ref.actor.state_dict()) < 1e-4
        path = ckpts.save(1, learner_checkpoint_state(lrn))
        assert (path / "learner_shards" / "dcp" / ".metadata").is_file()
        m2 = lrn.step(b2)
        w2 = dict(lrn.export_policy_weights())
        m2_ref = ref.step(b2)
        assert_same_metrics(m2_ref, m2, tol=1e-4)
        assert m2["actor/lr"] == pytest.approx(1e-2 * 3 / 3) and m["actor/lr"] == pytest.approx(1e-2 * 2 / 3)
        restore_learner(lrn, ckpts.load(path))
        assert lrn.policy_version == 1
        m2_again = lrn.step(b2)
        assert lrn.policy_version == 2
        assert {k: v for k, v in m2_again.items() if not k.startswith("perf/")} == \
            {k: v for k, v in m2.items() if not k.startswith("perf/")}
        assert max_diff(dict(lrn.export_policy_weights()), w2) == 0.0
    assert max_diff(checkpoint_policy_weights(learner_spec(cfg), path, Path(tiny)), w1) == 0.0


def test_data_parallel_row_split_and_equal_pass_counts():
    for n in range(0, 12):
        for dp in (1, 2, 3, 4):
            parts = [dp_rows(n, r, dp) for r in range(dp)]
            assert [i for s in parts for i in range(s.start, s.stop)] == list(range(n))
            assert max(s.stop - s.start for s in parts) - min(s.stop - s.start for s in parts) <= 1
            for mbs in (1, 2, 5):
                plans = [micro_plan(n, r, dp, mbs) for r in range(dp)]
                assert len({len(p) for p in plans}) == 1  # every rank runs the same number of passes
                assert [i for p in plans for s in p if s is not None for i in range(s.start, s.stop)] == \
                    list(range(n))
                assert all(s.stop - s.start <= mbs for p in plans for s in p if s is not None)
    assert micro_plan(5, 1, 2, 1) == [slice(3, 4), slice(4, 5), None]
    with pytest.raises(ValueError, match="dp_rank=2"):
        dp_rows(4, 2, 2)


BS = "learner.backend_settings"


@pytest.mark.parametrize("override,match", [
    (["learner.backend=fsdp", f"{BS}.world_size=3", f"{BS}.tensor_parallel_size=2"],
     r"learner.backend_settings.world_size=3: must be divisible by tensor_parallel_size × "
     r"pipeline_parallel_size = 2 × 1"),
    (["learner.backend=fsdp", f"{BS}.world_size=2", f"{BS}.tensor_parallel_size=2"],
     r"learner.backend_settings.tensor_parallel_size=2: learner.backend='fsdp' is data parallel only"),
    # a one-process backend has no rank layout: its settings lack the key
    ([f"{BS}.world_size=2"], r"learner.backend_settings.world_size=2: unknown setting of TorchSettings"),
    ([f"{BS}.cpu_offload=true"],
     r"learner.backend_settings.cpu_offload=True: unknown setting of TorchSettings"),
    (["learner.backend=fsdp", f"{BS}.launch=mpirun"],
     r"learner.backend_settings.launch='mpirun': must be 'spawn', 'ray'"),
    (["learner.backend=fsdp", "learner.optimizer=lion"], r"learner.optimizer='lion': must be 'adamw'"),
    (["learner.backend=fsdp", f"{BS}.world_size=0"],
     r"learner.backend_settings.world_size=0: must be an int >= 1"),
    (["learner.backend=fsdp", f"{BS}.dist_backend=mpi"], r"learner.backend_settings.dist_backend='mpi'"),
    (["learner.backend=megatron", f"{BS}.world_size=2", f"{BS}.pipeline_parallel_size=2"],
     r"learner.backend_settings.pipeline_parallel_size=2: learner.backend='megatron' runs pipeline size 1 "
     r"only"),
])
def test_bad_learner_settings_name_the_key(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, override)


def test_model_dependent_parallel_sizes_name_the_key(tiny):
    """The tiny model has 4 attention heads, 2 key/value heads and 2 layers."""
    def section(tp=1, pp=1):
        return DistributedSettings(world_size=tp * pp, tensor_parallel_size=tp, pipeline_parallel_size=pp)

    check_model_parallel(section(tp=2), tiny)  # 4 heads, 2 kv heads: fine
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=4: must divide the model's 2 key/value"):
        check_model_parallel(section(tp=4), tiny)
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=8: must divide the model's 4 attention"):
        check_model_parallel(section(tp=8), tiny)
    with pytest.raises(ConfigError, match=r"pipeline_parallel_size=3: more stages than the model's 2"):
        check_model_parallel(section(pp=3), tiny)


def test_fsdp_learner_refuses_a_crafted_dcp_checkpoint_without_running_it(tiny, tmp_path):
    """Issue 44 item 3: a real fsdp checkpoint whose DCP ``.metadata`` is replaced by a pickle that would
    write a file when unpickled, its ``COMPLETE`` marker rewritten to match (as a crafted checkpoint
    would be): restoring it is refused in one line naming the file, and the code never runs (stock
    ``dcp.load`` in the ranks ran it before)."""
    import hashlib
    import json
    import pickle

    pwned = tmp_path / "pwned"

    class WritesMarker:
        def __reduce__(self):
            return exec, (f"open({str(pwned)!r}, 'w').write('pwned')",)

    cfg = load_config(None, fsdp_overrides("copc", "sgd"))
    ckpts = CheckpointManager(tmp_path / "checkpoints")
    with make_learner(learner_spec(cfg), tiny) as lrn:
        path = ckpts.save(1, learner_checkpoint_state(lrn))
        meta_file = path / "learner_shards" / "dcp" / ".metadata"
        meta_file.write_bytes(pickle.dumps(WritesMarker()))
        marker = json.loads((path / "COMPLETE").read_text())
        marker["files"]["learner_shards/dcp/.metadata"] = {
            "size": meta_file.stat().st_size, "sha256": hashlib.sha256(meta_file.read_bytes()).hexdigest()}
        (path / "COMPLETE").write_text(json.dumps(marker))
        state = ckpts.load(path)  # intact as far as the marker can tell
        with pytest.raises(ConfigError) as err:
            restore_learner(lrn, state)
    assert str(err.value) == (f"{meta_file}: refused, it would call builtins.exec when unpickled "
                              "(not DCP metadata; a crafted checkpoint?)")
    assert not pwned.exists()
