"""Benchmark: COPC's step-time overhead over async PPO, and async vs synchronous pipelines.

Part 1 (the paper's Table 3 comparison, learner side): the same rollout batches
(real math_tool episodes from the CPU-tiny model) are trained on by a ``copc``
learner and a ``ppo_async`` learner from the same initial weights, interleaved,
several rounds; the median step times and their ratio are printed, plus the time
spent in the advantage estimator itself. Goal: COPC overhead <= 1 %.

Part 2: wall time per step of the whole asynchronous loop (max staleness 8) vs
the synchronous one (max staleness 0) on the same config. The paper reports 1.7x
on 8 GPUs; here rollouts and learner share 2 CPU cores, so overlap can only hide
the smaller of the two phases.

Part 3: the weight-sync attestation's cost (``train.sync_check_tolerance``,
:mod:`trainer.orchestration.attestation`): the asynchronous loop again with the check on; the
time the step spent on it (``perf/sync_check_wait_s`` + the learner's reference forward
``perf/sync_check_ref_s``; the engine's probe runs beside training) as a share of the step, and
the steady-state time per step against Part 2's (goal: <= 1 % of a step).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import statistics
import tempfile
import time

import torch

import copc
from environments.math_tool import MathToolEnv
from environments.sandbox import Sandbox, SandboxConfig
from trainer.engines.base import SamplingParams
from trainer.engines.embedded import EmbeddedEngine
from trainer.learner.backends.torch import TorchLearner
from trainer.learner.settings import LearnerConfig, OptimizerSettings
from trainer.models.loading import load_model_and_tokenizer
from trainer.models.tiny import TinyModelConfig, save_tiny_checkpoint
from trainer.orchestration.attestation import SyncCheck
from trainer.orchestration.loop import AsyncTrainingLoop, BoundedAdmission, LoopConfig
from trainer.orchestration.prompts import PromptStream
from trainer.orchestration.rollouts import LocalRollouts, LoopHooks, engine_handle
from trainer.rollout.agent_loop import AgentLoopConfig
from trainer.rollout.batch import to_batch
from trainer.rollout.groups import EnvPool, run_groups

PROMPT = "Use <code>```python ...```</code>; answer in \\boxed{{}}.\nProblem: {problem}\n"


def samples(n: int) -> list[dict]:
    """Arithmetic problems (answers exact)."""
    return [{"id": f"b{i}", "problem": f"What is {1000 + 37 * i} * {211 + 13 * i}?",
             "answer": str((1000 + 37 * i) * (211 + 13 * i))} for i in range(n)]


def main() -> None:
    """Run both parts and print the tables."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--loop-steps", type=int, default=8)
    args = ap.parse_args()
    d = tempfile.mkdtemp()
    save_tiny_checkpoint(d, TinyModelConfig(hidden_size=128, intermediate_size=256, num_layers=2))
    base, tok = load_model_and_tokenizer(d)
    sb = Sandbox(SandboxConfig(workers=2))
    make_env = lambda: MathToolEnv(sandbox=sb, prompt_template=PROMPT)  # noqa: E731
    sp = SamplingParams(max_new_tokens=48, seed=0)
    agent = AgentLoopConfig(max_turns=2, max_total_tokens=400)

    async def gen():
        eng = EmbeddedEngine(copy.deepcopy(base), tok)
        pool = EnvPool(make_env, 32)
        trs = await run_groups(eng, pool, tok, samples(args.batches * args.batch_size), 1, sp, agent)
        await pool.close()
        await eng.close()
        return trs

    trs = asyncio.run(gen())
    batches = [to_batch(trs[i * args.batch_size:(i + 1) * args.batch_size], tok.pad_token_id)
               for i in range(args.batches)]
    for b in batches:  # make the batch off-policy and rewarded so every code path does work
        b.rewards[b.loss_mask.bool()] = 0.0
        b.logp_mu += 0.05 * torch.randn(b.logp_mu.shape) * b.loss_mask
        last = b.loss_mask.shape[1] - 1 - b.loss_mask.flip(1).argmax(1)
        b.rewards[torch.arange(len(b)), last] = torch.tensor([float(i % 2) for i in range(len(b))])
    times: dict[str, list[float]] = {"copc": [], "ppo_async": []}
    adv: dict[str, list[float]] = {"copc": [], "ppo_async": []}
    ratios = []
    learners = {}
    for preset in ("copc", "ppo_async"):
        torch.manual_seed(0)
        learners[preset] = TorchLearner(copy.deepcopy(base), copc.get_preset(preset),
                                        LearnerConfig(
                                            optim=OptimizerSettings(actor_lr=1e-4, critic_lr=1e-3),
                                            micro_batch_size=8))
    v = 0
    for _ in range(args.rounds):  # interleaved on the same batch, so machine load hits both alike
        for b in batches:
            step = {}
            for preset in (("copc", "ppo_async") if v % 2 else ("ppo_async", "copc")):
                t0 = time.perf_counter()
                m = learners[preset].step(b, v)
                step[preset] = time.perf_counter() - t0
                times[preset].append(step[preset])
                adv[preset].append(m["perf/advantage_s"])
            ratios.append(step["copc"] / step["ppo_async"])
            v += 1
    p = statistics.median(times["ppo_async"])
    print(f"Part 1: learner step on identical batches (B={args.batch_size}, {args.batches} batches x "
          f"{args.rounds} rounds, interleaved, torch threads={torch.get_num_threads()})")
    print(f"{'preset':>10} | {'step ms (median)':>16} | {'advantage ms (median)':>21}")
    for k in ("ppo_async", "copc"):
        print(f"{k:>10} | {statistics.median(times[k]) * 1e3:>16.1f} | "
              f"{statistics.median(adv[k]) * 1e3:>21.3f}")
    est = (statistics.median(adv["copc"]) - statistics.median(adv["ppo_async"])) / p
    r = statistics.median(ratios)
    print(f"copc / ppo_async step time (median of per-batch ratios): {r:.4f} ({(r - 1) * 100:+.2f} %); "
          f"advantage-estimator difference: {est * 100:+.3f} % of a step  (goal: <= 1 %)")

    def loop_time(s: int, check: bool = False) -> tuple[float, float]:
        """Steady-state seconds per step and the mean time per step the attestation took from the
        step (the wait for an older check + the learner's reference forward; 0 when off)."""
        actor = copy.deepcopy(base)
        learner = TorchLearner(actor, copc.get_preset("copc"),
                               LearnerConfig(
                                   optim=OptimizerSettings(actor_lr=1e-4, critic_lr=1e-3),
                                   micro_batch_size=8))

        async def go():
            eng = EmbeddedEngine(copy.deepcopy(base), tok)
            rollouts = LocalRollouts(engine_handle(eng), make_env, tok, sp, agent, 32)
            stamps: list[float] = []
            waits: list[float] = []

            class Stamps(LoopHooks):
                def on_step(self, step: int, metrics: dict, uids: list[int]) -> None:
                    stamps.append(time.perf_counter())
                    waits.append(metrics.get("perf/sync_check_wait_s", 0.0)
                                 + metrics.get("perf/sync_check_ref_s", 0.0))

            loop = AsyncTrainingLoop(learner, rollouts, PromptStream(samples(400), 0),
                                     LoopConfig(total_steps=args.loop_steps, prompts_per_step=args.batch_size,
                                                n_samples_per_prompt=1, pad_token_id=tok.pad_token_id,
                                                staleness=BoundedAdmission(s),
                                                sync_check=SyncCheck(1e-3, 1.0) if check
                                                else None), Stamps())
            await loop.run()
            await rollouts.close()
            await eng.close()
            warm = 2  # steady state: skip the first steps (pipeline fill)
            return (stamps[-1] - stamps[warm - 1]) / (len(stamps) - warm), statistics.mean(waits[warm:])

        return asyncio.run(go())

    (sync, _), (asyn, _) = loop_time(0), loop_time(8)
    print(f"\nPart 2: whole loop, steady-state time per step (steps 3..{args.loop_steps}), "
          f"{args.batch_size} episodes per step")
    print(f"{'max staleness':>13} | {'s / step':>8}")
    print(f"{0:>13} | {sync:>8.2f}\n{8:>13} | {asyn:>8.2f}")
    print(f"async speed-up over synchronous: {sync / asyn:.2f}x (paper: 1.7x on 8 GPUs)")
    checked, wait = loop_time(8, check=True)
    print(f"\nPart 3: weight-sync attestation (max staleness 8): {checked:.2f} s / step with it vs "
          f"{asyn:.2f} without ({(checked / asyn - 1) * 100:+.1f} %); the step spent {wait * 1e3:.1f} ms "
          f"on it (wait + reference) = {wait / checked * 100:.2f} % of a step (goal: <= 1 %)")
    sb.close()


if __name__ == "__main__":
    main()
