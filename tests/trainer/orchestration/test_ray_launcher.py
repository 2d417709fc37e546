"""Ray launcher: a few-step async run on a local Ray cluster (rollout workers + learner as actors)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import time

import pytest
import torch

import copc
from trainer.config import load_config
from trainer.config.specs import engine_spec, learner_spec
from trainer.engines.base import SamplingParams
from trainer.errors import TrainingError
from trainer.learner.backends.torch import TorchLearner
from trainer.learner.settings import LearnerConfig, OptimizerSettings
from trainer.models.loading import load_model_and_tokenizer
from trainer.models.tiny import TinyModelConfig, save_tiny_checkpoint
from trainer.orchestration.attestation import SyncCheck
from trainer.orchestration.loop import AsyncTrainingLoop, BoundedAdmission, FixedLag, LoopConfig
from trainer.orchestration.prompts import PromptStream
from trainer.orchestration.ray_launcher import RayLearner, RayRollouts, RayRolloutSpec, WorkerSpec
from trainer.orchestration.rollouts import LoopHooks
from trainer.rollout.agent_loop import AgentLoopConfig
from trainer.rollout.groups import episode_sampling

ray = pytest.importorskip("ray")

SAMPLES = [{"id": f"s{i}"} for i in range(100)]


@pytest.fixture(scope="module")
def ray_cluster(request):
    """A local 2-CPU Ray cluster, shut down when the module's tests are done."""
    import ray_echo_env  # tests/trainer is on sys.path (conftest)

    ray.cloudpickle.register_pickle_by_value(ray_echo_env)  # workers cannot import tests/
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    request.addfinalizer(ray.shutdown)
    request.addfinalizer(lambda: ray.cloudpickle.unregister_pickle_by_value(ray_echo_env))
    return ray_echo_env


@pytest.fixture(scope="module")
def tiny32(tmp_path_factory):
    return str(save_tiny_checkpoint(tmp_path_factory.mktemp("tiny32ray"),
                                    TinyModelConfig(hidden_size=32, intermediate_size=64, num_layers=1)))


def _exp(model_dir, **extra):
    """An ExperimentConfig for the workers' engine and the learner actor's backend."""
    ov = {"model.path": model_dir, "rollout.engine_max_batch_size": "8", "train.actor_lr": "1e-3",
          "train.critic_lr": "1e-3", "train.micro_batch_size": "4", **extra}
    return load_config(None, [f"{k}={v}" for k, v in ov.items()])


def _worker(exp, kind=None, plugins=(), work_dir=None):
    """The workers' spec of ``exp`` (engine only: the tests give an environment factory); ``kind``
    another registered engine (from ``plugins``), ``work_dir`` the engines' work directory."""
    spec = dataclasses.replace(engine_spec(exp, exp.model.path, None), work_dir=work_dir)
    return WorkerSpec(kind or exp.rollout.engine, spec, plugins=tuple(plugins))


def _flat(state):
    return torch.cat([v.detach().float().flatten() for _, v in sorted(state.items())])


class _Hooks(LoopHooks):
    """Records every step; at a checkpoint, the learner state a checkpoint would hold."""

    def __init__(self):
        self.seen: list[dict] = []
        self.ckpts: list[tuple[int, int, int]] = []
        self.learner = None  # the Ray-hosted learner, set once started

    def on_step(self, step, metrics, uids):
        self.seen.append({"step": step, "uids": uids, **metrics})

    def save_checkpoint(self, step, loop_state):  # what copc train saves: the learner actor's state
        self.ckpts.append((step, self.learner.state_dict()["steps_done"], loop_state["step"]))
        return True


async def _ray_run(exp, learner, tok, cfg, env_factory, hooks, max_new_tokens=6, worker=None):
    """Start a Ray-hosted learner from ``learner`` and 2 rollout workers (``worker``: their
    :class:`WorkerSpec`, default :func:`_worker`), run the loop, copy the final state into ``learner``
    (as the ray launcher does); return the loop, the workers' versions and engine weights and the
    learner actor's weights."""
    ray_learner = RayLearner.start(learner_spec(exp), exp.model.path, learner.state_dict())
    sampling = SamplingParams(max_new_tokens=max_new_tokens, seed=0)
    rollouts = RayRollouts(RayRolloutSpec(worker or _worker(exp), exp.model.path, sampling,
                                          AgentLoopConfig(max_turns=1), env_factory=env_factory,
                                          num_workers=2, concurrency=4), learner, 0)
    hooks.learner = ray_learner
    try:
        loop = AsyncTrainingLoop(ray_learner, rollouts, PromptStream(SAMPLES, 0), cfg, hooks)
        await loop.run()
        learner.load_state_dict(ray_learner.state_dict())
        versions = await asyncio.gather(*(w.version.remote() for w in rollouts.workers))
        engines = await asyncio.gather(*(w.engine_state_dict.remote() for w in rollouts.workers))
        learned = await ray_learner.actor.policy_weights.remote()
        return loop, versions, engines, learned
    finally:
        await rollouts.close()
        ray_learner.close()


@pytest.mark.slow
def test_ray_few_step_run_staleness_versions_and_weight_sync(ray_cluster, tiny32):
    s, steps, per_step, n = 1, 4, 2, 2
    actor, tok = load_model_and_tokenizer(tiny32)
    initial = _flat(actor.state_dict())
    learner = TorchLearner(actor, copc.get_preset("copc"), LearnerConfig(
        optim=OptimizerSettings(actor_lr=1e-3, critic_lr=1e-3), micro_batch_size=4))
    hooks = _Hooks()
    cfg = LoopConfig(total_steps=steps, prompts_per_step=per_step, n_samples_per_prompt=n,
                     pad_token_id=tok.pad_token_id, staleness=BoundedAdmission(s), checkpoint_every=2)
    t0 = time.perf_counter()
    loop, versions, engines, learned = asyncio.run(
        _ray_run(_exp(tiny32), learner, tok, cfg, ray_cluster.EchoEnvFactory(0.02, dense=True), hooks))
    seen, ckpts = hooks.seen, hooks.ckpts
    print(f"ray few-step run: {time.perf_counter() - t0:.1f} s")
    assert [m["step"] for m in seen] == list(range(1, steps + 1)) and loop.version == steps
    for m in seen:  # per-token staleness of the trained batch, and finite metrics
        assert m["staleness/max"] <= s and all(0 <= h <= s for h in m["staleness/per_token"])
        assert m["rollout/episodes"] == per_step * n and m["rollout/reward_mean"] > 0
        assert all(math.isfinite(v) for v in m.values() if isinstance(v, float))
    uids = [u for m in seen for u in m["uids"]]
    assert len(uids) == len(set(uids)) == steps * per_step
    # versions on tokens come from the workers' engines: they must follow the learner (step k is
    # trained at version k-1, so with s = 1 its tokens are from versions >= k-2)
    token_versions = [[m["step"] - 1 - h for h in m["staleness/per_token"]] for m in seen]
    assert min(token_versions[-1]) >= steps - 1 - s and max(token_versions[-1]) >= 2
    # every worker got the final weights, which are the trained ones (not the initial ones)
    assert versions == [steps, steps]
    for eng in engines:
        assert torch.equal(_flat(eng), _flat(learned))
    assert (_flat(learned) - initial).abs().max() > 1e-4
    # checkpoints hold the learner actor's state of that step; the driver learner gets it at the end
    assert ckpts == [(2, 2, 2), (4, 4, 4)]
    assert learner.steps_done == steps and torch.equal(_flat(learner.actor.state_dict()), _flat(learned))


def test_episode_sampling_matches_local_seed_derivation():
    sp = SamplingParams(seed=5, max_new_tokens=3)
    assert episode_sampling(sp, uid=2, k=1).seed == 5 + 7919 * 2 + 1
    assert episode_sampling(sp, 2, 1).max_new_tokens == 3
    unseeded = SamplingParams(seed=None)
    assert episode_sampling(unseeded, 9, 9) is unseeded


def test_bad_worker_count_is_rejected(tiny32):
    with pytest.raises(ValueError, match="num_rollout_workers=0"):
        RayRolloutSpec(_worker(_exp(tiny32)), tiny32, SamplingParams(), AgentLoopConfig(),
                       env_factory=lambda: None, num_workers=0)


@pytest.mark.slow
def test_copc_train_with_ray_launcher_end_to_end(ray_cluster, tmp_path):
    """``run_experiment`` with ``launcher.kind=ray``: real math_tool env + sandbox in each worker."""
    from trainer.app.run import run_experiment
    from trainer.config import load_config
    from trainer.outputs.checkpoint import CheckpointManager

    out = tmp_path / "ray_run"
    plugin = tmp_path / "ray_plugin.py"  # registers a learner backend: the Ray actors must import it too
    plugin.write_text("from trainer.learner import TorchLearner, register_learner\n"
                      "register_learner('torch_from_plugin', TorchLearner.from_spec, overwrite=True)\n")
    ov = {
        "plugins": f"[{plugin}]", "learner.backend": "torch_from_plugin",
        "preset": "copc", "output_dir": str(out), "launcher.kind": "ray",
        "launcher.settings.num_rollout_workers": "1",
        "model.tiny.hidden_size": "32", "model.tiny.intermediate_size": "64", "model.tiny.num_layers": "1",
        "task.env": "math_tool", "task.train_data": "[math_train]", "task.max_train_samples": "40",
        "task.env_kwargs": "{prompt_template: 'Q: {problem}\n'}",
        "train.total_steps": "3", "train.prompts_per_step": "2", "train.micro_batch_size": "4",
        "train.actor_lr": "1e-4", "train.critic_lr": "1e-3", "train.staleness.max": "2",
        "rollout.max_new_tokens": "12", "rollout.max_turns": "2", "rollout.max_total_tokens": "1024",
        "rollout.concurrency": "4", "rollout.n_samples_per_prompt": "1",
        "eval.enabled": "false", "warm_start.enabled": "false", "logging.progress": "false",
        "logging.plots": "false", "checkpoint.every_steps": "1", "checkpoint.keep_last": "2",
        "logging.samples_per_step": "2",
    }
    summary = run_experiment(load_config(None, [f"{k}={v}" for k, v in ov.items()]))
    assert summary["steps"] == 3 and summary["trained_uids"] == 6 and summary["duplicate_trained_uids"] == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "actor/pg_loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        assert r["staleness/max"] <= 2 and len(r["staleness/hist"]) - 1 <= 2
        assert r["perf/learner_malloc_trim_s"] >= 0  # the learner actor's heap (learner.malloc_trim)
    ckpt = CheckpointManager(out / "checkpoints")
    assert CheckpointManager.step_of(ckpt.latest()) == 3
    state = ckpt.load()
    assert state["learner"]["steps_done"] == 3  # the learner actor's state reached the checkpoint
    # the training samples come from the learner actor's step inputs, as with the local launcher
    from trainer.outputs.viewer.samples import read_samples
    recs = read_samples(out)
    assert sorted({r["step"] for r in recs}) == [1, 2, 3] and all(len(r["advantage"]) == len(r["tokens"])
                                                                for r in recs)
    assert all(any(r["loss_mask"]) and len(r["ratio"]) == len(r["tokens"]) for r in recs)


def test_ray_fixed_lag_staleness_is_exact_and_workers_end_on_the_newest(ray_cluster, tiny32):
    """``train.staleness.mode=fixed`` with Ray workers: snapshots come from the learner actor, each batch
    is generated by version ``max(n − k, 0)`` on every worker, workers end with the final weights."""
    k, steps, per_step = 2, 5, 2
    actor, tok = load_model_and_tokenizer(tiny32)
    learner = TorchLearner(actor, copc.get_preset("copc"), LearnerConfig(
        optim=OptimizerSettings(actor_lr=1e-2, critic_lr=1e-3), micro_batch_size=4))
    hooks = _Hooks()
    cfg = LoopConfig(total_steps=steps, prompts_per_step=per_step, n_samples_per_prompt=1,
                     pad_token_id=tok.pad_token_id, staleness=FixedLag(k))
    loop, versions, engines, learned = asyncio.run(
        _ray_run(_exp(tiny32), learner, tok, cfg, ray_cluster.EchoEnvFactory(0.0, dense=True), hooks))
    seen = hooks.seen
    assert [m["step"] for m in seen] == list(range(1, steps + 1))
    for m in seen:
        assert set(m["staleness/per_token"]) == {min(m["step"] - 1, k)}
    assert versions == [steps, steps]
    for eng in engines:
        assert torch.equal(_flat(eng), _flat(learned))
    # the kept snapshot of version 3 is not the final weights (the lag is real, not a re-label)
    assert not torch.equal(_flat(loop.state.history.get(3).weights), _flat(learned))


def test_ray_lora_syncs_adapters_to_the_workers(ray_cluster, tiny32):
    """``learner.lora`` with Ray workers: workers serve the base with the learner's adapter (started with
    it, then adapter-only syncs through the object store, kept fixed-lag adapters included); they end
    on the learner actor's final adapter."""
    from trainer.models.lora import LoraSettings

    k, steps = 1, 3
    lora = LoraSettings(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"))
    exp = _exp(tiny32, **{"learner.lora.rank": "4", "learner.lora.alpha": "8",
                          "learner.lora.target_modules": "[q_proj,v_proj]", "train.actor_lr": "1e-2"})
    actor, tok = load_model_and_tokenizer(tiny32)
    learner = TorchLearner(actor, copc.get_preset("copc"), LearnerConfig(
        optim=OptimizerSettings(actor_lr=1e-2, critic_lr=1e-3), micro_batch_size=4, lora=lora,
        critic_lora=lora))
    hooks = _Hooks()
    cfg = LoopConfig(total_steps=steps, prompts_per_step=2, n_samples_per_prompt=1,
                     pad_token_id=tok.pad_token_id, staleness=FixedLag(k))
    loop, versions, engines, _ = asyncio.run(
        _ray_run(exp, learner, tok, cfg, ray_cluster.EchoEnvFactory(0.0, dense=True), hooks))
    assert [set(m["staleness/per_token"]) for m in hooks.seen] == [{0}, {1}, {1}]
    assert versions == [steps, steps]
    final = learner.export_adapter()  # the driver's learner got the actor's final state
    assert all(float(v.abs().max()) > 0 for n, v in final.tensors.items() if ".lora_B." in n)
    for eng in engines:
        served = {n.replace(".default.", "."): v for n, v in eng.items() if "lora_" in n}
        assert served.keys() == final.tensors.keys()
        assert all(torch.equal(served[n], final.tensors[n]) for n in served)
    assert all(loop.state.history.get(v).export_adapter() is not None for v in loop.state.history.versions())


#: A plug-in engine: the embedded engine, except that the engine of rollout worker 1 (its work
#: directory ``rollout_worker_1``) loads its initial weights at every sync and reports the new version.
STALE_PLUGIN = """
import dataclasses
from trainer.engines import register_engine
from trainer.engines.builtin import embedded_engine

def stale_on_worker_1(spec):
    handle = embedded_engine(spec)
    if spec.work_dir is None or spec.work_dir.name != "rollout_worker_1":
        return handle
    initial = {k: v.clone() for k, v in handle.engine.model.state_dict().items()}

    async def stale(weights, version):
        await handle.engine.update_weights(initial, version)
    return dataclasses.replace(handle, sync=stale)

register_engine("stale_on_worker_1", stale_on_worker_1, overwrite=True)
"""


def _attested_run(envs, tiny32, tmp_path, worker_kind=None):
    """4 steps, bounded staleness 1, 2 Ray workers, ``train.sync_check_tolerance=1e-4``: the loop."""
    plugin = tmp_path / "stale_plugin.py"
    plugin.write_text(STALE_PLUGIN)
    exp = _exp(tiny32)
    actor, tok = load_model_and_tokenizer(tiny32)
    learner = TorchLearner(actor, copc.get_preset("copc"), LearnerConfig(
        optim=OptimizerSettings(actor_lr=1e-2, critic_lr=1e-3), micro_batch_size=4))
    cfg = LoopConfig(total_steps=4, prompts_per_step=2, n_samples_per_prompt=2, pad_token_id=tok.pad_token_id,
                     staleness=BoundedAdmission(1), sync_check=SyncCheck(1e-4, 1.0))
    worker = _worker(exp, worker_kind, [str(plugin)] if worker_kind else (), tmp_path / "work")
    hooks = _Hooks()
    return asyncio.run(_ray_run(exp, learner, tok, cfg, envs.EchoEnvFactory(0.0, dense=True),
                                hooks, worker=worker))[0], hooks


def test_ray_workers_syncs_are_attested_on_every_worker(ray_cluster, tiny32, tmp_path):
    """The attestation runs with Ray rollout workers: the learner actor takes the reference, every
    worker's engine answers the probe, every synced version is checked within float32 noise."""
    loop, hooks = _attested_run(ray_cluster, tiny32, tmp_path)
    assert loop.attestor.enabled and sorted(loop.attestor.checked) == [1, 2, 3, 4], loop.attestor.checked
    assert all(0.0 <= d <= 1e-5 for d in loop.attestor.checked.values()), loop.attestor.checked
    assert all(m["actor/grad_norm"] > 0 for m in hooks.seen)  # the policy moved: new weights were compared


def test_a_ray_worker_that_keeps_its_old_weights_stops_the_run_naming_the_version(ray_cluster, tiny32,
                                                                                   tmp_path):
    """Worker 0 syncs honestly, worker 1 keeps its initial weights under the new version: the probe
    reaches every worker, so the first sync (version 1) fails its check, in one line."""
    with pytest.raises(TrainingError) as e:
        _attested_run(ray_cluster, tiny32, tmp_path, worker_kind="stale_on_worker_1")
    msg = str(e.value)
    assert msg.startswith("weight sync check failed: after the sync the engine log-probs differ by ")
    assert "at policy version 1 (train.sync_check_tolerance=0.0001)" in msg and "\n" not in msg
