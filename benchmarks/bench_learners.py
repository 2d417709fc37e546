"""Benchmark: distributed learner backends vs the single-process torch backend (CPU, gloo).

The same batch (multi-turn episodes, two PPO mini-batches) is trained on by

* ``torch``: one process (the reference), ``torch_threads`` = all cores;
* ``fsdp DP=2``: two rank processes (FSDP2), one thread each;
* ``megatron TP=2`` (when the ``megatron`` backend is registered: the ``megatron`` extra).

Reported per backend: the median learner step time over ``--steps`` steps (after one warm-up
step) and its ratio to torch (no goal on 2 cores), and the memory per rank of the persistent
training state.

Memory measure: bytes of the distinct tensor storages holding parameters, gradients and optimizer
state in each rank after an AdamW step
(:func:`trainer.learner.distributed.shard.training_state_bytes`: a DTensor counts its local
shard, padding included; each storage once). This is what FSDP shards; activations, the
temporarily all-gathered layer during forward/backward and the ~0.3 GB of interpreter and
libraries per process are left out (psutil RSS would be dominated by the latter for this tiny
model and would not show the sharding). Gate: fsdp per-rank state <= 0.6 x the single process's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.config import load_config
from trainer.config.specs import learner_spec
from trainer.learner import RANK_LEARNERS, make_learner
from trainer.learner.distributed.launch import RankError
from trainer.learner.distributed.shard import training_state_bytes
from trainer.models.tiny import TinyModelConfig, save_tiny_checkpoint
from trainer.rollout.batch import RolloutBatch, to_batch
from trainer.rollout.trajectory import Trajectory

#: FSDP must shard: per-rank training state at most this fraction of one process's at DP = 2.
MEMORY_GATE = 0.6

#: (label, learner overrides) of the distributed rows; a backend's helper may append its own.
DISTRIBUTED_ROWS: list[tuple[str, list[str]]] = [
    ("fsdp DP=2", ["learner.backend=fsdp", "learner.backend_settings.world_size=2"]),
]
if "megatron" in RANK_LEARNERS.names():
    DISTRIBUTED_ROWS.append(("megatron TP=2", ["learner.backend=megatron",
                                               "learner.backend_settings.world_size=2",
                                               "learner.backend_settings.tensor_parallel_size=2"]))


def bench_batch(n: int, prompt_len: int, response_len: int) -> RolloutBatch:
    """``n`` two-turn episodes (an observation between the turns), rewards 0/1, groups of 2."""
    g = torch.Generator().manual_seed(0)
    trs = []
    for i in range(n):
        tr = Trajectory(prompt_ids=torch.randint(0, 255, (prompt_len,), generator=g).tolist(), sample_id=i,
                        group_id=i // 2)
        half = response_len // 2 - 4 + i % 4
        tr.append_model_tokens(torch.randint(0, 255, (half,), generator=g).tolist(), [-5.0] * half, 0)
        tr.append_observation_tokens(torch.randint(0, 255, (8,), generator=g).tolist())
        tr.append_model_tokens(torch.randint(0, 255, (half,), generator=g).tolist(), [-5.5] * half, 0)
        tr.reward = float(i % 2)
        trs.append(tr)
    return to_batch(trs, 0)


def timed_steps(learner, batch: RolloutBatch, steps: int) -> float:
    """Median seconds of ``steps`` learner steps after one warm-up step."""
    learner.step(batch)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        learner.step(batch)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def mib(n: int) -> str:
    return f"{n / 2**20:8.2f}"


def main() -> int:
    """Run the rows, print the table; non-zero exit if a row fails or fsdp misses the memory gate."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rows", type=int, default=16, help="episodes per batch")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    model_dir = save_tiny_checkpoint(tempfile.mkdtemp(), TinyModelConfig(
        hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_layers=args.layers))
    batch = bench_batch(args.rows, prompt_len=32, response_len=96)
    common = ["preset=copc", "train.micro_batch_size=4", "train.num_mini_batches=2", "train.actor_lr=1e-5",
              "train.critic_lr=1e-5"]
    print(f"model: tiny qwen2 hidden {args.hidden}, {args.layers} layers; actor + critic, AdamW; batch "
          f"{len(batch)} x {batch.input_ids.shape[1]} tokens; median of {args.steps} steps")

    torch_lrn = make_learner(learner_spec(load_config(None, common)), model_dir)
    t_ref = timed_steps(torch_lrn, batch, args.steps)
    ref = training_state_bytes([torch_lrn.actor, torch_lrn.critic],
                               [torch_lrn.actor_opt.optimizer, torch_lrn.critic_opt.optimizer])
    ref_total = sum(ref.values())
    header = (f"{'backend':<16}{'step s':>9}{'x torch':>9}{'params MiB':>12}{'grads MiB':>11}"
              f"{'optim MiB':>11}{'total MiB':>11}{'x single':>10}")
    print(header)
    print(f"{'torch (1 proc)':<16}{t_ref:9.3f}{1.0:9.2f}{mib(ref['params']):>12}{mib(ref['grads']):>11}"
          f"{mib(ref['optimizer']):>11}{mib(ref_total):>11}{1.0:10.2f}")
    rc = 0
    for label, overrides in DISTRIBUTED_ROWS:
        cfg = load_config(None, common + overrides + ["train.torch_threads=1"])
        try:
            with make_learner(learner_spec(cfg), model_dir) as lrn:
                t = timed_steps(lrn, batch, args.steps)
                try:
                    per_rank = lrn.rank_state_bytes()
                except RankError as e:  # a backend without MemoryProbe.state_bytes: time only
                    per_rank, why = [], str(e).strip().splitlines()[-1][:120]
        except Exception as e:  # report the row, keep benchmarking the others
            print(f"{label:<16} failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            rc = 1
            continue
        if not per_rank:
            print(f"{label:<16}{t:9.3f}{t / t_ref:9.2f}  memory n/a ({why})")
            continue
        for r, mem in enumerate(per_rank):
            total = sum(mem.values())
            print(f"{f'{label} r{r}':<16}{t:9.3f}{t / t_ref:9.2f}{mib(mem['params']):>12}"
                  f"{mib(mem['grads']):>11}{mib(mem['optimizer']):>11}{mib(total):>11}"
                  f"{total / ref_total:10.2f}")
        worst = max(sum(m.values()) for m in per_rank) / ref_total
        if label.startswith("fsdp"):
            ok = worst <= MEMORY_GATE
            print(f"fsdp sharding gate: worst rank {worst:.2f} x single process (goal <= {MEMORY_GATE}): "
                  f"{'PASS' if ok else 'FAIL'}")
            rc = rc or (0 if ok else 1)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
