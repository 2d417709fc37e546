"""Minimal synchronous COPC: a tool environment, the embedded engine, the torch learner.

The reading path through the house, with the public API only and no config file:

1. ``environments``: a :class:`~environments.ToolEnv` with one :class:`~environments.RegexTool`
   (``<calc>2+3</calc>`` -> ``<result>5</result>``) that rewards ``<answer>N</answer>`` = a + b;
2. ``trainer.models``: a tiny random transformer saved and loaded like a Hugging Face checkpoint;
3. ``trainer.engines``: the embedded engine samples the policy's turns (token ids, behavior
   log-probs, policy versions); ``trainer.rollout.run_episode`` plays one episode into a
   :class:`~trainer.rollout.trajectory.Trajectory` and ``to_batch`` pads a group of them;
4. ``copc``: the ``copc`` preset (coupled advantage/return, :func:`copc.coupled_advantage_return`,
   with the clipped policy loss) drives :class:`~trainer.learner.backends.torch.TorchLearner`;
5. after each update the engine receives the new weights and version (synchronous: staleness 0).

Run: ``python examples/minimal_copc.py --steps 3 --out /tmp/copc_min``. A random model rarely
answers right; its reward is mostly the 0.1 bonus for writing a digit. The point is the path. ``main`` returns
each step's metrics so a test can check them.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

import copc
from environments import EnvLimits, RegexTool, ToolEnv
from trainer.engines.base import SamplingParams
from trainer.engines.embedded import EmbeddedEngine
from trainer.learner import LearnerConfig, OptimizerSettings, TorchLearner
from trainer.models.loading import load_model_and_tokenizer
from trainer.models.tiny import TinyModelConfig, save_tiny_checkpoint
from trainer.rollout.agent_loop import AgentLoopConfig, run_episode
from trainer.rollout.batch import to_batch
from trainer.rollout.trajectory import Trajectory

ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


class CalcTool(RegexTool):
    """``<calc>EXPR</calc>``: the sum of ``+``-separated integers (an error text otherwise)."""

    name = "calc"
    pattern = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)

    def run(self, payload: str) -> str:
        """Sum of the integers in ``payload`` split on ``+``; never raises (bad input: an error text)."""
        try:
            return str(sum(int(part) for part in payload.split("+")))
        except ValueError:
            return f"error: {payload!r} is not a sum of integers"

    def render(self, result: str) -> str:
        """The observation appended after the call."""
        return f"<result>{result}</result>"


class AdditionEnv(ToolEnv):
    """Rows ``{"id", "a", "b"}``; reward 1.0 when the last ``<answer>`` equals ``a + b``, plus 0.1
    when the response writes any digit (a shaping bonus, so a random tiny model sees a signal)."""

    stop_strings = ("</calc>", "</answer>")

    def __init__(self, samples: list[dict[str, Any]], max_turns: int = 2) -> None:
        super().__init__([CalcTool()], EnvLimits(max_turns=max_turns), samples=samples,
                         invalid_action_reply="Use <calc>a+b</calc> or give <answer>N</answer>.")

    def build_prompt(self, sample: Mapping[str, Any]) -> str:
        """The question text."""
        return f"What is {sample['a']}+{sample['b']}? Use <calc>...</calc>, then <answer>N</answer>.\n"

    def extract_answer(self, action: str) -> str | None:
        """The last ``<answer>`` of one action, stripped (``None`` when there is none)."""
        found = ANSWER.findall(action)
        return found[-1].strip() if found else None

    def score(self, sample: Mapping[str, Any], response: str, answer: str | None,
              tool_calls: int) -> tuple[float, dict[str, float]]:
        """``(correct + 0.1 * wrote_a_digit, components)``."""
        correct = float(answer is not None and answer == str(int(sample["a"]) + int(sample["b"])))
        digit = float(re.search(r"[0-9]", response) is not None)
        return correct + 0.1 * digit, {"correct": correct, "digit": digit}


def make_samples(n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` addition rows with small operands (reproducible for ``seed``)."""
    rng = random.Random(seed)
    return [{"id": i, "a": rng.randint(0, 9), "b": rng.randint(0, 9)} for i in range(n)]


async def rollout_group(engine: EmbeddedEngine, tokenizer: Any, sample: Mapping[str, Any],
                        group_size: int, sampling: SamplingParams, seed: int) -> list[Trajectory]:
    """``group_size`` episodes of one prompt (each on its own environment, seeds ``seed + i``)."""
    loop_cfg = AgentLoopConfig(max_turns=2, max_total_tokens=224)
    episodes = []
    for i in range(group_size):
        env = AdditionEnv([dict(sample)])
        params = SamplingParams(temperature=sampling.temperature, max_new_tokens=sampling.max_new_tokens,
                                seed=seed + i)
        episodes.append(run_episode(engine, env, tokenizer, sample, params, loop_cfg, group_id=sample["id"]))
    return list(await asyncio.gather(*episodes))


async def train(out: Path, steps: int, prompts_per_step: int, group_size: int,
                seed: int) -> list[dict[str, float]]:
    """Synchronous COPC for ``steps`` updates; returns each step's learner metrics (plus ``reward``)."""
    torch.manual_seed(seed)
    model_dir = save_tiny_checkpoint(out / "tiny", TinyModelConfig(hidden_size=32, intermediate_size=64,
                                                                   num_layers=1, num_heads=2, num_kv_heads=1,
                                                                   max_position_embeddings=256, seed=seed))
    actor, tokenizer = load_model_and_tokenizer(model_dir)  # trained by the learner
    policy, _ = load_model_and_tokenizer(model_dir)  # served by the engine; gets the new weights
    algo = copc.get_preset("copc")  # coupled advantage/return + critic + clipped policy loss
    learner = TorchLearner(actor, algo, LearnerConfig(optim=OptimizerSettings(actor_lr=1e-4, critic_lr=1e-4),
                                                      micro_batch_size=4, seed=seed))
    engine = EmbeddedEngine(policy, tokenizer, version=learner.policy_version)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=48)
    samples = make_samples(prompts_per_step * steps, seed)
    history = []
    try:
        for step in range(steps):
            rows = samples[step * prompts_per_step:(step + 1) * prompts_per_step]
            groups = [await rollout_group(engine, tokenizer, row, group_size, sampling, seed=1000 * step + j)
                      for j, row in enumerate(rows)]
            trajs = [t for g in groups for t in g if not t.infra_failed]
            if any(t.env_failed for t in trajs):
                raise RuntimeError(f"environment bug: {next(t for t in trajs if t.env_failed).finish_reason}")
            batch = to_batch(trajs, pad_token_id=tokenizer.pad_token_id)
            metrics = learner.step(batch)
            await engine.update_weights(dict(learner.export_policy_weights()), learner.policy_version)
            metrics["reward"] = sum(t.reward for t in trajs) / len(trajs)
            metrics["policy_version"], metrics["engine_version"] = learner.policy_version, engine.version
            history.append(metrics)
            print(f"step {step}: version {learner.policy_version}, reward {metrics['reward']:.2f}, "
                  f"actor loss {metrics.get('actor/pg_loss', float('nan')):.4f}, "
                  f"critic loss {metrics.get('critic/value_loss', float('nan')):.4f}")
    finally:
        await engine.close()
    return history


def main(argv: list[str] | None = None) -> list[dict[str, float]]:
    """Command line: ``--steps``, ``--prompts``, ``--group``, ``--seed``, ``--out`` (default: a temp dir)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=2, help="prompts per step")
    parser.add_argument("--group", type=int, default=2, help="episodes per prompt")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.out is not None:
        return asyncio.run(train(args.out, args.steps, args.prompts, args.group, args.seed))
    with tempfile.TemporaryDirectory() as tmp:
        return asyncio.run(train(Path(tmp), args.steps, args.prompts, args.group, args.seed))


if __name__ == "__main__":
    main()
