"""The distributed learner runtime: sharded checkpoints inside our atomic checkpoint directory,
rank failures surfacing in the driver, and ``copc train`` with ``learner.backend=fsdp`` end to end
(spawn, resume after SIGKILL, Ray rank actors, torchrun). Real processes on 2 CPU cores (gloo)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch

from trainer.config import ConfigError, load_config, plugin_settings
from trainer.config.specs import learner_spec
from trainer.learner import make_learner, restore_learner
from trainer.learner.distributed.launch import RankError
from trainer.models.tiny import TinyModelConfig, save_tiny_checkpoint
from trainer.outputs.checkpoint import CheckpointManager, DirectoryState
from trainer.outputs.viewer.samples import read_samples
from trainer.rollout.batch import to_batch
from trainer.rollout.trajectory import Trajectory

REPO = Path(__file__).parent.resolve().parents[2]
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(save_tiny_checkpoint(tmp_path_factory.mktemp("tiny_rt"),
                                    TinyModelConfig(hidden_size=32, intermediate_size=64, num_layers=1)))


def small_batch(n: int = 4):
    g = torch.Generator().manual_seed(1)
    trs = []
    for i in range(n):
        tr = Trajectory(prompt_ids=[40 + i, 41], sample_id=i, group_id=i)
        tr.append_model_tokens(torch.randint(0, 255, (4 + i,), generator=g).tolist(), [-5.0] * (4 + i), 0)
        tr.reward = float(i % 2)
        trs.append(tr)
    return to_batch(trs, 0)


def fsdp_cfg(*extra: str):
    return load_config(None, ["learner.backend=fsdp", "learner.backend_settings.world_size=2",
                              "learner.backend_settings.timeout_s=120", "train.micro_batch_size=2", *extra])


# -- checkpoint directories (no processes) -------------------------------------------------------

def test_directory_state_is_written_inside_the_atomic_checkpoint(tmp_path):
    mgr = CheckpointManager(tmp_path / "ck", keep_last=1)

    def write(path: Path) -> None:
        (path / "rank0").mkdir()
        (path / "rank0" / "shard.bin").write_bytes(b"\x01\x02")
        assert path.parent.name.startswith(".tmp-step_00000003")  # written before the rename

    final = mgr.save(3, {"learner": {"v": 3}, "learner_shards": DirectoryState(write)})
    meta = json.loads((final / "COMPLETE").read_text())
    assert meta["keys"] == {"learner": "learner.pt"} and meta["dirs"] == {"learner_shards": "learner_shards"}
    state = mgr.load()
    assert state["learner"] == {"v": 3} and state["learner_shards"] == final / "learner_shards"
    assert (state["learner_shards"] / "rank0" / "shard.bin").read_bytes() == b"\x01\x02"

    def crash(path: Path) -> None:
        (path / "half").write_text("x")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        mgr.save(4, {"learner": {"v": 4}, "learner_shards": DirectoryState(crash)})
    assert mgr.latest() == final and not [p for p in (tmp_path / "ck").iterdir() if p.name.startswith(".tmp")]
    (final / "learner_shards" / "rank0" / "shard.bin").unlink()
    (final / "learner_shards" / "rank0").rmdir()
    (final / "learner_shards").rmdir()
    assert not CheckpointManager.is_complete(final)  # a listed directory is missing


def test_bf16_mixed_precision_and_checkpoint_kind_checks(tiny):
    """``model.dtype=bfloat16``: float32 sharded master weights, bf16 compute; losses near float32's,
    weights exported in bf16. A torch checkpoint resumed by fsdp is refused naming the backend."""
    batch = small_batch()
    torch_learner = make_learner(learner_spec(load_config(None, ["train.micro_batch_size=2"])), tiny)
    m_ref = torch_learner.step(batch)
    with make_learner(learner_spec(fsdp_cfg("model.dtype=bfloat16")), tiny) as lrn:
        m = lrn.step(batch)
        weights = dict(lrn.export_policy_weights())
        assert abs(m["actor/pg_loss"] - m_ref["actor/pg_loss"]) < 1e-3
        assert abs(m["critic/value_loss"] - m_ref["critic/value_loss"]) < 1e-3
        assert {w.dtype for w in weights.values()} == {torch.bfloat16}
        with pytest.raises(ConfigError, match=r"learner.backend='fsdp': the checkpoint was written by "
                                              r"backend 'torch'"):
            restore_learner(lrn, {"learner": torch_learner.state_dict()})
        with pytest.raises(ConfigError, match=r"learner.backend: the checkpoint lacks sharded learner state"):
            restore_learner(lrn, {"learner": lrn.state_dict()})
        with pytest.raises(ConfigError, match=r"launcher.kind='ray' with learner.backend='fsdp'"):
            make_learner(learner_spec(fsdp_cfg("launcher.kind=ray")), tiny)


def test_a_torch_learner_refuses_a_sharded_checkpoint_naming_the_settings_that_wrote_it(tiny, tmp_path):
    """``copc eval --checkpoint`` / ``--resume`` of a megatron run with the default ``torch`` backend:
    a ConfigError naming the settings to use (it was a KeyError deep in ``load_state_dict``), and
    the learner is left untouched."""
    lrn = make_learner(learner_spec(load_config(None, [])), tiny)
    before = {k: v.clone() for k, v in lrn.actor.state_dict().items()}
    state = {"learner": {"backend": "megatron", "world_size": 2, "tensor_parallel_size": 2,
                         "pipeline_parallel_size": 1, "policy_version": 3, "sharded": True},
             "learner_shards": tmp_path}
    with pytest.raises(ConfigError, match=r"learner.backend: the checkpoint holds sharded learner state "
                                          r"\(learner_shards/\) that this TorchLearner cannot read; .*: "
                                          r"learner.backend=megatron learner.backend_settings.world_size=2 "
                                          r"learner.backend_settings.tensor_parallel_size=2 "
                                          r"learner.backend_settings.pipeline_parallel_size=1$"):
        restore_learner(lrn, state)
    assert lrn.policy_version == 0
    assert all(torch.equal(v, before[k]) for k, v in lrn.actor.state_dict().items())


def test_spawned_ranks_get_no_torchrun_rendezvous_variables_and_spawn_under_torchrun_is_refused(monkeypatch):
    """Under torchrun, ``TORCHELASTIC_USE_AGENT_STORE=True`` inherited by spawned ranks made every rank wait
    for a rendezvous store nobody starts (a hang until ``learner.backend_settings.timeout_s``); several
    torchrun processes each spawning ranks would each run the whole experiment.
    ``learner.backend_settings.launch=torchrun`` without torchrun, or at another world size, is a config error
    (exit 2), not a ValueError."""
    from trainer.learner.distributed.launch import spawn_env
    from trainer.learner.distributed.runtime import check_launch
    from trainer.learner.distributed.worker import torchrun_spec

    torchrun = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "GROUP_RANK": "0",
                "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "none"}
    env = spawn_env({**torchrun, "PATH": "/usr/bin", "PYTHONPATH": "/x"}, "ab12")
    assert env == {"PATH": "/usr/bin", "COPC_RANK_AUTHKEY": "ab12", "PYTHONPATH": f"{REPO}{os.pathsep}/x"}
    spawn = plugin_settings(fsdp_cfg(), "learner.backend")  # the fsdp backend's DistributedSettings
    with pytest.raises(ConfigError, match=r"learner.backend_settings.launch='spawn': this process is one of "
                                          r"WORLD_SIZE=2 started by torchrun"):
        check_launch(spawn, torchrun)
    check_launch(spawn, {**torchrun, "WORLD_SIZE": "1"})  # torchrun --nproc-per-node 1: one driver
    check_launch(spawn, {})
    section = plugin_settings(fsdp_cfg("learner.backend_settings.launch=torchrun"), "learner.backend")
    check_launch(section, torchrun)

    for key in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(ConfigError, match=r"learner.backend_settings.launch='torchrun': RANK/WORLD_SIZE are "
                                          r"not set"):
        torchrun_spec(section)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ConfigError, match=r"learner.backend_settings.world_size=2 but torchrun started "
                                          r"WORLD_SIZE=4"):
        torchrun_spec(section)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    spec = torchrun_spec(section)
    assert (spec.rank, spec.world_size, spec.local_rank, spec.init_method) == (1, 2, 1, "env://")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_nccl_without_cuda_is_a_config_error_naming_the_key():
    from trainer.learner.distributed.worker import resolve_dist_backend

    assert resolve_dist_backend("auto") == "gloo" and resolve_dist_backend("gloo") == "gloo"
    with pytest.raises(ConfigError, match=r"learner.backend_settings.dist_backend='nccl' needs CUDA"):
        resolve_dist_backend("nccl")


# -- failures ------------------------------------------------------------------------------------

def test_a_setting_a_rank_refuses_is_a_config_error_in_the_driver(tiny):
    """A ConfigError raised while a rank builds its learner (megatron refuses
    ``learner.backend_settings.cpu_offload``) reaches the driver as a ConfigError (``copc train`` exits 2),
    not a RankError with a traceback; no rank process is left."""
    import trainer.learner.backends.megatron  # noqa: F401 - registers the megatron backend

    cfg = load_config(None, ["learner.backend=megatron", "learner.backend_settings.world_size=2",
                             "learner.backend_settings.tensor_parallel_size=2",
                             "learner.backend_settings.cpu_offload=true",
                             "learner.backend_settings.timeout_s=120"])
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=r"^learner.backend_settings.cpu_offload=true: an fsdp option"):
        make_learner(learner_spec(cfg), tiny)
    assert time.monotonic() - t0 < 60
    ranks = [c for c in psutil.Process().children(recursive=True)
             if "rank_main" in " ".join(c.cmdline()) and c.status() != psutil.STATUS_ZOMBIE]
    assert ranks == []


def test_a_rank_raising_mid_step_raises_in_the_driver_with_its_traceback(tiny):
    bad = small_batch()
    bad.input_ids[0, 3] = 10_000  # not in the 258-token vocabulary: the embedding lookup fails
    lrn = make_learner(learner_spec(fsdp_cfg()), tiny)
    pids = lrn.rank_pids
    t0 = time.monotonic()
    with pytest.raises(RankError, match=r"(?s)learner rank \d raised during 'step'.*IndexError"):
        lrn.step(bad)
    assert time.monotonic() - t0 < 30
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)
    with pytest.raises(RankError, match="closed"):
        lrn.step(small_batch())


def test_a_rank_killed_mid_step_raises_promptly_and_leaves_no_rank_behind(tiny):
    lrn = make_learner(learner_spec(fsdp_cfg()), tiny)
    lrn.step(small_batch())  # warm: the next step is the one interrupted
    pids = lrn.rank_pids
    err: list[BaseException] = []

    def run() -> None:
        try:
            for _ in range(50):
                lrn.step(small_batch(8))
        except BaseException as e:
            err.append(e)

    th = threading.Thread(target=run)
    th.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    os.kill(pids[1], signal.SIGKILL)
    th.join(timeout=60)
    assert not th.is_alive() and err, "the driver hung after a rank died"
    assert time.monotonic() - t0 < 20  # far below backend_settings.timeout_s=120: noticed, not timed out
    assert isinstance(err[0], RankError) and "learner rank" in str(err[0]), err[0]
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)


# -- copc train end to end -----------------------------------------------------------------------

def train_overrides(out: Path, steps: int, *extra: str) -> list[str]:
    return [f"output_dir={out}", "learner.backend=fsdp", "learner.backend_settings.world_size=2",
            f"train.total_steps={steps}", "train.prompts_per_step=2", "train.micro_batch_size=2",
            "train.critic_warmup_steps=0",
            "model.tiny.hidden_size=32", "model.tiny.intermediate_size=64", "model.tiny.num_layers=1",
            "rollout.max_new_tokens=12", "rollout.max_turns=2", "rollout.concurrency=4",
            "warm_start.enabled=false", "eval.enabled=false", "logging.progress=false", "logging.plots=false",
            "logging.tensorboard=false", "checkpoint.every_steps=1", "checkpoint.keep_last=2", *extra]


def copc_train(args: list[str], *, launcher: list[str] | None = None, timeout: float = 600):
    cmd = [*(launcher or [sys.executable, "-m"]), "trainer.cli", "train",
           "--config", "configs/math_tool/cpu_tiny.yaml", *args]
    return subprocess.run(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
                          text=True, timeout=timeout)


def trained_steps(out: Path) -> list[int]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows if "actor/pg_loss" in r]


@pytest.mark.slow
def test_copc_train_fsdp_world_size_2_runs_end_to_end(tmp_path):
    out = tmp_path / "run"
    res = copc_train(train_overrides(out, 3, "logging.samples_per_step=64"))
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["duplicate_trained_uids"] == 0
    assert trained_steps(out) == [1, 2, 3]
    # copc view's samples come from rank 0's step inputs: every row sampled, so the mean sampled
    # advantage over model tokens is the step's advantage/mean
    recs = read_samples(out)
    assert sorted({r["step"] for r in recs}) == [1, 2, 3]
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    for m in (m for m in metrics if "advantage/mean" in m):
        adv = [a for r in recs if r["step"] == m["step"]
               for a, k in zip(r["advantage"], r["loss_mask"], strict=True) if k]
        assert adv and np.mean(adv) == pytest.approx(m["advantage/mean"], rel=2e-3, abs=2e-4)
        assert all(x is not None and x > 0 for r in recs if r["step"] == m["step"]
                   for x, k in zip(r["ratio"], r["loss_mask"], strict=True) if k)
    latest = CheckpointManager(out / "checkpoints").latest()
    assert CheckpointManager.step_of(latest) == 3
    assert (latest / "learner_shards" / "dcp" / ".metadata").is_file()
    state = CheckpointManager(out / "checkpoints").load(keys=["learner"])
    assert state["learner"]["backend"] == "fsdp" and state["learner"]["policy_version"] == 3


KILL_SCRIPT = """
import sys
from trainer.config import load_config
from trainer.app.run import run_experiment
run_experiment(load_config("configs/math_tool/cpu_tiny.yaml", sys.argv[2:]), resume=sys.argv[1] == "resume")
"""


@pytest.mark.slow
def test_fsdp_resume_after_sigkill_same_steps_no_repeated_prompts_same_next_step_loss(tmp_path, tiny):
    out = tmp_path / "run"
    args = train_overrides(out, 6)
    script = tmp_path / "job.py"
    script.write_text(KILL_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, str(script), "fresh", *args], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    ckpts = CheckpointManager(out / "checkpoints")
    deadline = time.monotonic() + 400
    while True:  # kill the driver once step >= 2 is checkpointed, in the middle of later work
        latest = ckpts.latest()
        if latest is not None and CheckpointManager.step_of(latest) >= 2:
            break
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.monotonic() < deadline, "no checkpoint in time"
        time.sleep(0.05)
    ranks = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = CheckpointManager.step_of(ckpts.latest())
    assert killed_at < 6, "the run finished before it could be killed; make it longer"
    deadline = time.monotonic() + 30  # the orphaned ranks notice their parent is gone and exit
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in ranks):
        assert time.monotonic() < deadline, "learner ranks outlived the killed driver"
        time.sleep(0.2)

    # the checkpoint the resume starts from: its learner state gives the same next-step loss twice
    cfg = load_config("configs/math_tool/cpu_tiny.yaml", args)
    model_dir = out / "init_model"
    losses = []
    for _ in range(2):
        with make_learner(learner_spec(cfg), model_dir) as lrn:
            restore_learner(lrn, ckpts.load())
            assert lrn.policy_version == killed_at
            losses.append(lrn.step(small_batch())["actor/pg_loss"])
    assert losses[0] == losses[1]

    res = subprocess.run([sys.executable, str(script), "resume", *args], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 6
    assert summary["trained_uids"] == 12 and summary["duplicate_trained_uids"] == 0
    uids = ckpts.load(keys=["trained_uids"])["trained_uids"]
    assert len(uids) == len(set(uids)) == 12
    assert trained_steps(out) == [1, 2, 3, 4, 5, 6]


@pytest.mark.slow
def test_ray_rank_actors_match_spawned_ranks(tiny):
    """``learner.backend_settings.launch=ray``: 2 rank actors in a placement group (a local Ray cluster of
    ``learner.backend_settings.ray_num_cpus``); same step as spawned ranks."""
    batch = small_batch()
    with make_learner(learner_spec(fsdp_cfg()), tiny) as lrn:
        m_spawn = lrn.step(batch)
        w_spawn = dict(lrn.export_policy_weights())
    ray_cfg = fsdp_cfg("learner.backend_settings.launch=ray", "learner.backend_settings.ray_num_cpus=2")
    with make_learner(learner_spec(ray_cfg), tiny) as lrn:
        m_ray = lrn.step(batch)
        w_ray = dict(lrn.export_policy_weights())
    assert abs(m_ray["actor/pg_loss"] - m_spawn["actor/pg_loss"]) < 1e-6
    assert abs(m_ray["critic/value_loss"] - m_spawn["critic/value_loss"]) < 1e-6
    assert max(float((w_ray[k] - w_spawn[k]).abs().max()) for k in w_spawn) < 1e-6


@pytest.mark.slow
def test_copc_train_under_torchrun(tmp_path):
    """``torchrun --nproc-per-node 2 -m trainer.cli train ... learner.backend_settings.launch=torchrun``:
    rank 0 runs the experiment, rank 1 serves as a learner rank."""
    out = tmp_path / "tr"
    torchrun = [str(Path(sys.executable).parent / "torchrun"), "--nproc-per-node", "2", "--master-port",
                str(29_500 + os.getpid() % 1000), "-m"]
    res = copc_train(train_overrides(out, 2, "learner.backend_settings.launch=torchrun"), launcher=torchrun)
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads((out / "summary.json").read_text())["steps"] == 2
    assert trained_steps(out) == [1, 2]


@pytest.mark.slow
def test_torchrun_without_launch_torchrun_is_refused_and_one_process_spawns_its_ranks(tmp_path):
    """``torchrun --nproc-per-node 2`` without ``learner.backend_settings.launch=torchrun``: exit 2
    naming ``learner.backend_settings.launch`` (it used to hang until
    ``learner.backend_settings.timeout_s``: the spawned ranks inherited torchrun's agent-store setting).
    ``--nproc-per-node 1`` with spawned ranks runs."""
    torchrun = [str(Path(sys.executable).parent / "torchrun"), "--master-port",
                str(29_500 + os.getpid() % 1000)]
    t0 = time.monotonic()
    res = copc_train(train_overrides(tmp_path / "two", 1, "learner.backend_settings.timeout_s=120"),
                     launcher=[*torchrun, "--nproc-per-node", "2", "-m"], timeout=300)
    assert res.returncode != 0 and time.monotonic() - t0 < 110, res.stderr[-3000:]
    assert ("config error: learner.backend_settings.launch='spawn': this process is one of WORLD_SIZE=2"
            in res.stderr)
    out = tmp_path / "one"
    res = copc_train(train_overrides(out, 1, "learner.backend_settings.timeout_s=120"),
                     launcher=[*torchrun, "--nproc-per-node", "1", "-m"], timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert trained_steps(out) == [1]
