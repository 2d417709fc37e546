"""One settings regime for the learner backends and the Ray launcher (issue 41 items 2 and 3):

* the backend-specific ``learner.*`` keys live in the backend's own settings dataclass
  (``learner.backend_settings``: :class:`TorchSettings` for ``torch``,
  :class:`DistributedSettings` for ``fsdp`` / ``megatron``), and the Ray launcher's in
  ``launcher.settings`` (:class:`RayLauncherSettings`);
* every old central spelling is refused at load with one line naming the new one;
* a setting of one backend given to another is refused naming the key;
* one Ray connection helper, :func:`trainer.ray_util.connect_ray`, serves the Ray launcher, learner
  ranks started by Ray and ``copc sweep``.
"""

from __future__ import annotations

import ast
import asyncio
import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest

from trainer.config import ConfigError, load_config, plugin_settings
from trainer.config.sections import MOVED_KEYS
from trainer.config.specs import learner_config, learner_spec
from trainer.learner import DistributedSettings, TorchSettings
from trainer.learner.settings import STEP_FIELDS
from trainer.orchestration.launchers import LAUNCHERS, RayLauncherSettings
from trainer.ray_util import RayClusterSettings

REPO = Path(__file__).parent.resolve().parents[2]

#: The keys this change moved, with a value each may be set to (old spelling -> a valid value).
MOVED = {
    "learner.world_size": "2", "learner.tensor_parallel_size": "2", "learner.pipeline_parallel_size": "1",
    "learner.launch": "ray", "learner.dist_backend": "gloo", "learner.cpu_offload": "true",
    "learner.timeout_s": "60", "learner.gradient_checkpointing": "true", "learner.logprob_chunk_tokens": "64",
    "learner.autocast_dtype": "bfloat16", "learner.shared_prefix_tokens": "8",
    "learner.critic_freeze_attention": "true", "launcher.ray_address": "HEAD:6379",
    "launcher.num_rollout_workers": "2", "launcher.ray_num_cpus": "4",
}
TORCH_ONLY = sorted({f.name for f in dataclasses.fields(TorchSettings)}
                    - {f.name for f in dataclasses.fields(DistributedSettings)})
DISTRIBUTED_ONLY = sorted({f.name for f in dataclasses.fields(DistributedSettings)}
                          - {f.name for f in dataclasses.fields(TorchSettings)})
VALUES = {"autocast_dtype": "bfloat16", "shared_prefix_tokens": "8", "critic_freeze_attention": "true",
          "world_size": "2", "tensor_parallel_size": "1", "pipeline_parallel_size": "1", "launch": "ray",
          "ray_address": "HEAD:6379", "ray_num_cpus": "4", "dist_backend": "gloo", "cpu_offload": "true",
          "timeout_s": "60"}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_spelling_is_refused_in_one_line_naming_the_new_one(old, tmp_path):
    assert old in MOVED_KEYS
    section, name = old.split(".")
    new = MOVED_KEYS[old].split(" ")[0]
    assert new.startswith(f"{section}.backend_settings." if section == "learner" else "launcher.settings.")
    for source in ("override", "yaml"):
        with pytest.raises(ConfigError) as e:
            if source == "override":
                load_config(None, [f"{old}={MOVED[old]}"])
            else:
                (tmp_path / "c.yaml").write_text(f"{section}:\n  {name}: {MOVED[old]}\n")
                load_config(tmp_path / "c.yaml")
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith(f"{old}: moved to {new} "), msg


def test_the_new_spellings_load_and_reach_the_typed_settings():
    torch_cfg = load_config(None, ["learner.backend_settings={autocast_dtype: bfloat16, "
                                   "shared_prefix_tokens: 8, critic_freeze_attention: true, "
                                   "logprob_chunk_tokens: 64}"])
    own = plugin_settings(torch_cfg, "learner.backend")
    assert isinstance(own, TorchSettings) and own.shared_prefix_tokens == 8
    step = learner_config(torch_cfg)  # what the shared step code reads
    assert (step.autocast_dtype, step.shared_prefix_tokens, step.critic_freeze_attention,
            step.logprob_chunk_tokens) == ("bfloat16", 8, True, 64)
    fsdp = load_config(None, ["learner.backend=fsdp", "learner.backend_settings.world_size=2",
                              "learner.backend_settings.launch=ray",
                              "learner.backend_settings.ray_address=H:1",
                              "learner.backend_settings.logprob_chunk_tokens=32"])
    dist = plugin_settings(fsdp, "learner.backend")
    assert isinstance(dist, DistributedSettings) and (dist.world_size, dist.data_parallel_size) == (2, 2)
    step = learner_config(fsdp)  # fields the backend lacks keep LearnerConfig's defaults
    assert (step.logprob_chunk_tokens, step.autocast_dtype, step.shared_prefix_tokens) == (32, None, 0)
    assert set(STEP_FIELDS) <= {f.name for f in dataclasses.fields(TorchSettings)}
    ray = load_config(None, ["launcher.kind=ray",
                             "launcher.settings={address: 'H:1', num_rollout_workers: 3}"])
    assert plugin_settings(ray, "launcher.kind") == RayLauncherSettings(address="H:1", num_cpus=2,
                                                                        num_rollout_workers=3)


@pytest.mark.parametrize("backend,key", [("fsdp", k) for k in TORCH_ONLY]
                         + [("torch", k) for k in DISTRIBUTED_ONLY] + [("megatron", k) for k in TORCH_ONLY])
def test_a_setting_of_one_backend_is_refused_under_another_naming_the_key(backend, key):
    if backend == "megatron":
        pytest.importorskip("trainer.learner.backends.megatron")
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"learner.backend={backend}", f"learner.backend_settings.{key}={VALUES[key]}"])
    msg = str(e.value)
    cls = "TorchSettings" if backend == "torch" else "DistributedSettings"
    assert "\n" not in msg and msg.startswith(f"learner.backend_settings.{key}=")
    assert f"unknown setting of {cls}; known: [" in msg


def test_a_launcher_setting_is_refused_by_a_launcher_without_it():
    with pytest.raises(ConfigError, match=r"^launcher.settings=\{'num_cpus': 2\}: launcher 'local' takes no "
                                          r"settings$"):
        load_config(None, ["launcher.settings.num_cpus=2"])
    with pytest.raises(ConfigError, match=r"^launcher.settings.num_rollout_workers=0: must be an int >= 1$"):
        load_config(None, ["launcher.kind=ray", "launcher.settings.num_rollout_workers=0"])


def test_a_distributed_backend_needs_distributed_settings():
    from trainer.learner import LEARNERS, RANK_LEARNERS, register_rank_learner

    @dataclasses.dataclass
    class Own:
        size: int = 1

    with pytest.raises(ValueError, match=r"must be DistributedSettings or a subclass"):  # a RegistryError
        register_rank_learner("own_dist", lambda *a: None, settings=Own)

    @dataclasses.dataclass
    class MoreRanks(DistributedSettings):
        extra: int = 0

    register_rank_learner("more_ranks", lambda *a: None, settings=MoreRanks)
    try:
        cfg = load_config(None, ["learner.backend=more_ranks",
                                 "learner.backend_settings={world_size: 2, extra: 1}"])
        assert plugin_settings(cfg, "learner.backend") == MoreRanks(world_size=2, extra=1)
    finally:
        LEARNERS.unregister("more_ranks")
        RANK_LEARNERS.unregister("more_ranks")


# -- one Ray connection helper -------------------------------------------------------------------

class ConnectedError(Exception):
    """Raised by the stand-in for :func:`connect_ray` once it has recorded its call."""


@pytest.fixture
def calls(monkeypatch):
    """Replace :func:`trainer.ray_util.connect_ray` (every caller imports it from there at call time)
    by a recorder that stops the caller right after the call."""
    import trainer.ray_util

    seen: list[tuple] = []

    def fake(address="", num_cpus=None, *, log_to_driver=True):
        seen.append((address, num_cpus, log_to_driver))
        raise ConnectedError

    monkeypatch.setattr(trainer.ray_util, "connect_ray", fake)
    return seen


def test_the_ray_launcher_connects_through_connect_ray_with_its_settings(calls):
    pytest.importorskip("ray")
    from trainer.orchestration.ray_launcher import launch_ray

    spec = SimpleNamespace(cfg=None, settings=RayLauncherSettings(address="HEAD:6379", num_cpus=3))

    async def enter() -> None:
        async with launch_ray(spec):
            pass

    with pytest.raises(ConnectedError):
        asyncio.run(enter())
    assert calls == [("HEAD:6379", 3, True)]


def test_ray_learner_ranks_connect_through_connect_ray_with_the_backend_settings(calls, tmp_path):
    pytest.importorskip("ray")
    from trainer.learner.distributed.launch import RayGroup

    cfg = load_config(None, ["learner.backend=fsdp", "learner.backend_settings={world_size: 2, launch: ray, "
                             "ray_address: 'HEAD:6379', ray_num_cpus: 5}"])
    with pytest.raises(ConnectedError):
        RayGroup(learner_spec(cfg), tmp_path)
    assert calls == [("HEAD:6379", 5, True)]


def test_the_sweep_connects_through_connect_ray_with_the_launcher_settings(calls):
    pytest.importorskip("ray")
    from trainer.sweep.execute import ray_cluster
    from trainer.sweep.runner import RayPool

    base = load_config(None, ["launcher.kind=ray", "launcher.settings={address: 'HEAD:6379', num_cpus: 6}"])
    address, num_cpus = ray_cluster(SimpleNamespace(base=base))
    assert (address, num_cpus) == ("HEAD:6379", 6)
    with pytest.raises(ConnectedError):
        RayPool(address, num_cpus)
    assert calls == [("HEAD:6379", 6, False)]  # the runs' output goes to their logs


def test_a_ray_cluster_launcher_without_cluster_settings_is_refused_by_the_sweep():
    from trainer.sweep.execute import ray_cluster

    LAUNCHERS.register("elsewhere", lambda spec: None, ray_cluster=True)
    try:
        base = load_config(None, ["launcher.kind=elsewhere"])
        with pytest.raises(ConfigError, match=r"^launcher.kind='elsewhere': a ray_cluster launcher's "
                                              r"settings must be a trainer.ray_util.RayClusterSettings"):
            ray_cluster(SimpleNamespace(base=base))
    finally:
        LAUNCHERS.unregister("elsewhere")
    assert issubclass(RayLauncherSettings, RayClusterSettings)


def test_nothing_but_connect_ray_starts_or_joins_ray():
    """Every ``ray.init`` call of the package code is in :mod:`trainer.ray_util`, and the three Ray
    callers name :func:`connect_ray`."""
    inits = []
    for path in (REPO / "trainer").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            func = node.func if isinstance(node, ast.Call) else None
            if isinstance(func, ast.Attribute) and func.attr == "init" and isinstance(func.value, ast.Name) \
                    and func.value.id == "ray":
                inits.append(str(path.relative_to(REPO)))
    assert inits == ["trainer/ray_util.py"]
    for caller in ("trainer/orchestration/ray_launcher.py", "trainer/learner/distributed/launch.py",
                   "trainer/sweep/runner.py"):
        assert "connect_ray(" in (REPO / caller).read_text(), caller
