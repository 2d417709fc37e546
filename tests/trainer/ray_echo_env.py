"""A picklable environment factory for Ray launcher tests (Ray workers rebuild envs from it).

The test registers this module for pickling by value (``ray.cloudpickle.register_pickle_by_value``),
so Ray worker processes need not import it from the tests folder.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from environments.base import ToolEnv


class EchoEnv(ToolEnv):
    """A real (pure-Python) one-turn env.

    Reward: 1 if the action contains the letter 'a'; with ``dense``, ``len(action) / 10`` instead,
    so every batch has a non-zero return and the actor is updated from the first step (the
    critic's value head starts at zero, so an all-zero-reward batch gives zero advantages).
    """

    def __init__(self, step_delay_s: float = 0.0, dense: bool = False) -> None:
        super().__init__(tools=[], invalid_action_reply=None)
        self.step_delay_s, self.dense = step_delay_s, dense

    def build_prompt(self, sample):
        return f"Say something {sample['id']}:"

    def extract_answer(self, action):
        return action

    def score(self, sample, response, answer, tool_calls):
        return (len(response) / 10.0 if self.dense else float("a" in response)), {}

    def step(self, action):
        time.sleep(self.step_delay_s)
        return super().step(action)


@dataclass(frozen=True)
class EchoEnvFactory:
    """Zero-argument factory of :class:`EchoEnv` (picklable: a plain dataclass, no closure)."""

    step_delay_s: float = 0.0
    dense: bool = False

    def __call__(self) -> EchoEnv:
        return EchoEnv(self.step_delay_s, self.dense)
