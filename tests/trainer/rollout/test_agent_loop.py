"""Agent loop: multi-turn math_tool episodes with the real sandbox and a scripted tiny model."""

from __future__ import annotations

import asyncio
import logging
import math
import threading

import pytest
import torch
from scripted import scripted

import copc
from environments.math_tool import MathToolEnv
from trainer.engines.base import EngineError, SamplingParams
from trainer.engines.embedded import EmbeddedEngine
from trainer.logprobs import sequence_logprobs
from trainer.models.loading import load_model_and_tokenizer
from trainer.models.tiny import TinyModelConfig, save_tiny_checkpoint
from trainer.rollout.agent_loop import AgentLoopConfig, run_episode
from trainer.rollout.batch import to_batch
from trainer.rollout.groups import EnvPool, episode_seed, run_groups
from trainer.rollout.trajectory import FinishReason

SAMPLE = {"id": "m1", "problem": "What is 12345 * 6789?", "answer": "83810205"}
ACTIONS = [
    "Let me compute it.\n<code>\n```python\nx = 12345 * 6789\nx\n```\n</code>",
    "Check once more.\n<code>\n```python\nprint(x if 'x' in dir() else 12345 * 6789)\n```\n</code>",
    "So the answer is \\boxed{83810205}.",
]


def turn_of(prompt_text: str) -> int:
    """Scripted turn = interpreter replies so far (the prompt itself mentions the tag inline)."""
    return prompt_text.count("\n</interpreter>")


def recomputed(model, tr, temperature, top_p=1.0):
    ids = torch.tensor([tr.prompt_ids + tr.response_ids])
    return sequence_logprobs(model, ids, torch.ones_like(ids), temperature,
                             top_p=top_p)[0, len(tr.prompt_ids):]


def test_multiturn_math_episode_masks_logprobs_versions(model_tok, sandbox):
    model, tok = model_tok
    env = MathToolEnv(sandbox=sandbox)

    async def main():
        eng = EmbeddedEngine(model, tok, logits_processor=scripted(tok, ACTIONS, turn_of), version=5)
        tr = await run_episode(eng, env, tok, SAMPLE, SamplingParams(temperature=0.8, top_p=0.9,
                                                                     max_new_tokens=200))
        await eng.close()
        return tr

    tr = asyncio.run(main())
    assert tr.finish_reason == "terminated" and tr.reward == 1.0 and tr.turns == 3
    mask = torch.tensor(tr.loss_mask, dtype=torch.bool)
    ids = torch.tensor(tr.response_ids)
    # the model's text comes back from exactly the masked-in tokens (EOS ends the last turn)
    model_text = tok.decode(ids[mask].tolist(), skip_special_tokens=True)
    assert model_text == "".join(ACTIONS)
    # every observation token is masked out, and observations are the interpreter replies
    obs_text = tok.decode(ids[~mask].tolist())
    assert obs_text.count("<interpreter>") == 2 and "83810205" in obs_text
    assert "interpreter" not in model_text
    # each observation run decodes to a whole <interpreter>...</interpreter> reply
    runs, cur = [], []
    for t, m in zip(tr.response_ids, tr.loss_mask, strict=True):
        if not m:
            cur.append(t)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    assert len(runs) == 2 and all(r.strip().startswith("<interpreter>") and
                                  r.strip().endswith("</interpreter>") for r in runs)
    assert all(v == 5 for v, m in zip(tr.versions, tr.loss_mask, strict=True) if m)
    assert all(v == -1 for v, m in zip(tr.versions, tr.loss_mask, strict=True) if not m)
    # µ is over the top-p 0.9 support (issue 46 item 1); a token the scripted processor forced from
    # outside the raw support keeps its untruncated log-prob (µ stays finite; the learner's is -inf)
    lp, full = recomputed(model, tr, 0.8, top_p=0.9), recomputed(model, tr, 0.8)
    inside = mask & torch.isfinite(lp)
    assert (lp - torch.tensor(tr.logp_mu))[inside].abs().max().item() < 1e-5
    outside = mask & ~inside
    assert not outside.any() or (full - torch.tensor(tr.logp_mu))[outside].abs().max().item() < 1e-5
    batch = to_batch([tr], tok.pad_token_id)
    assert batch.rewards[0].nonzero().flatten().tolist() == [max(i for i, m in enumerate(tr.loss_mask) if m)]


def test_weight_update_mid_episode_versions_per_token(model_tok, tiny_ckpt, sandbox, tmp_path):
    """The update lands between turns: turn 1 has version 0, later turns version 1."""
    model, tok = model_tok
    old_model, _ = load_model_and_tokenizer(tiny_ckpt)  # the engine's weights get overwritten
    new_model, _ = load_model_and_tokenizer(save_tiny_checkpoint(tmp_path / "v1", TinyModelConfig(seed=9)))
    env = MathToolEnv(sandbox=sandbox)

    async def main():
        loop = asyncio.get_running_loop()
        eng = EmbeddedEngine(model, tok, logits_processor=scripted(tok, ACTIONS, turn_of), version=0)
        real_step = env.step
        fired = threading.Event()

        def step_then_update(action):
            out = real_step(action)
            if not fired.is_set():
                fired.set()
                asyncio.run_coroutine_threadsafe(eng.update_weights(new_model.state_dict(), 1), loop).result()
            return out

        env.step = step_then_update
        tr = await run_episode(eng, env, tok, SAMPLE, SamplingParams(max_new_tokens=200))
        await eng.close()
        return tr

    tr = asyncio.run(main())
    model_versions = [v for v, m in zip(tr.versions, tr.loss_mask, strict=True) if m]
    first_turn = len(tok.encode(ACTIONS[0], add_special_tokens=False))
    assert set(model_versions[:first_turn]) == {0} and set(model_versions[first_turn:]) == {1}
    # each token's behavior log-prob is that of the weights that produced it
    mask = torch.tensor(tr.loss_mask, dtype=torch.bool)
    old_lp, new_lp = recomputed(old_model, tr, 1.0)[mask], recomputed(new_model, tr, 1.0)[mask]
    got = torch.tensor(tr.logp_mu)[mask]
    assert (old_lp[:first_turn] - got[:first_turn]).abs().max() < 1e-5
    assert (new_lp[first_turn:] - got[first_turn:]).abs().max() < 1e-5


class FlakyEngine:
    """The real engine behind a fault injector: the first ``fails`` calls raise EngineError."""

    def __init__(self, engine, fails):
        self.engine, self.fails, self.calls = engine, fails, 0

    @property
    def version(self):
        return self.engine.version

    async def generate(self, ids, params):
        self.calls += 1
        if self.calls <= self.fails:
            raise EngineError("injected failure")
        return await self.engine.generate(ids, params)


def test_engine_errors_are_retried_then_recorded(model_tok, sandbox):
    model, tok = model_tok

    async def main(fails):
        eng = EmbeddedEngine(model, tok, logits_processor=scripted(tok, ACTIONS, turn_of))
        flaky = FlakyEngine(eng, fails)
        tr = await run_episode(flaky, MathToolEnv(sandbox=sandbox), tok, SAMPLE,
                               SamplingParams(max_new_tokens=200),
                               AgentLoopConfig(engine_retries=2, retry_backoff_s=0.01))
        await eng.close()
        return tr

    ok = asyncio.run(main(2))
    assert ok.finish_reason == "terminated" and ok.reward == 1.0
    failed = asyncio.run(main(3))
    assert failed.finish_reason.startswith("engine_error") and failed.response_ids == []


def test_a_closed_engine_is_not_retried(model_tok, sandbox, caplog):
    """Closing is deliberate (the run is stopping): one call, no retry warnings, the episode ends."""
    model, tok = model_tok

    async def main():
        eng = EmbeddedEngine(model, tok, logits_processor=scripted(tok, ACTIONS, turn_of))
        await eng.close()
        counted = FlakyEngine(eng, 0)
        tr = await run_episode(counted, MathToolEnv(sandbox=sandbox), tok, SAMPLE,
                               SamplingParams(max_new_tokens=200),
                               AgentLoopConfig(engine_retries=3, retry_backoff_s=0.01))
        return tr, counted.calls

    with caplog.at_level(logging.WARNING):
        tr, calls = asyncio.run(main())
    assert calls == 1
    assert tr.finish_reason.startswith("engine_error") and "closed" in tr.finish_reason
    assert not [r for r in caplog.records if "retry" in r.getMessage()]


def test_env_error_ends_episode_with_reason(model_tok, sandbox):
    model, tok = model_tok
    env = MathToolEnv(sandbox=sandbox)

    def boom(action):
        raise RuntimeError("tool exploded")

    env.step = boom

    async def main():
        eng = EmbeddedEngine(model, tok, logits_processor=scripted(tok, ACTIONS, turn_of))
        tr = await run_episode(eng, env, tok, SAMPLE, SamplingParams(max_new_tokens=200))
        await eng.close()
        return tr

    tr = asyncio.run(main())
    assert tr.finish_reason == "env_error: RuntimeError: tool exploded"
    assert tr.finish_kind is FinishReason.ENV_ERROR and tr.finish_detail == "RuntimeError: tool exploded"
    assert tr.env_failed and not tr.infra_failed
    assert tr.num_model_tokens > 0 and tr.reward == 0.0


def test_budgets_total_tokens_and_observation_truncation(model_tok, sandbox):
    model, tok = model_tok

    async def main(cfg):
        eng = EmbeddedEngine(model, tok, logits_processor=scripted(tok, ACTIONS, turn_of))
        tr = await run_episode(eng, MathToolEnv(sandbox=sandbox), tok, SAMPLE,
                               SamplingParams(max_new_tokens=200), cfg)
        await eng.close()
        return tr

    short = asyncio.run(main(AgentLoopConfig(max_total_tokens=len(tok.encode(
        MathToolEnv().build_prompt(SAMPLE), add_special_tokens=False)) + 30)))
    assert short.finish_reason == "max_total_tokens" and len(short.response_ids) == 30
    obs_cut = asyncio.run(main(AgentLoopConfig(max_observation_tokens=5)))
    obs_lens = []
    run = 0
    for m in [*obs_cut.loss_mask, 1]:
        if m == 0:
            run += 1
        elif run:
            obs_lens.append(run)
            run = 0
    # (cut replies hide the interpreter tag, so the script repeats turn 1 until max_turns = 8)
    assert obs_lens == [5] * 7 and obs_cut.finish_reason == "truncated"
    one_turn = asyncio.run(main(AgentLoopConfig(max_turns=1)))
    assert one_turn.finish_reason == "max_turns" and one_turn.turns == 1


def test_many_episodes_run_concurrently(model_tok, sandbox):
    model, tok = model_tok
    samples = [dict(SAMPLE, id=f"m{i}") for i in range(6)]

    async def main():
        eng = EmbeddedEngine(model, tok, logits_processor=scripted(tok, ACTIONS, turn_of))
        pool = EnvPool(lambda: MathToolEnv(sandbox=sandbox), 6)
        trs = await run_groups(eng, pool, tok, samples, 2, SamplingParams(max_new_tokens=200, seed=0), None)
        envs = len(pool._all)
        await pool.close()
        await eng.close()
        return trs, envs

    trs, envs = asyncio.run(main())
    assert envs <= 6  # environments are reused, never more than the pool's size
    assert [t.sample_id for t in trs] == [f"m{i}" for i in range(6) for _ in range(2)]
    assert [t.info["uid"] for t in trs] == [i for i in range(6) for _ in range(2)]
    assert all(t.reward == 1.0 and t.turns == 3 for t in trs)
    batch = to_batch(trs, tok.pad_token_id)
    assert batch.group_ids.tolist() == [i for i in range(6) for _ in range(2)]
    # the one seed rule: seed + 7919 * uid + k
    assert episode_seed(0, 5, 1) == 7919 * 5 + 1 and episode_seed(None, 5, 1) is None


def test_long_tool_output_cut_keeps_reply_well_formed(model_tok, sandbox):
    """A ~500-character interpreter reply with max_observation_tokens=64: the observation is
    exactly 64 tokens with ``<interpreter>``, a visible marker and ``</interpreter>``, so the
    episode goes on (the scripted model sees the closing tag and answers)."""
    model, tok = model_tok
    actions = ["<code>\n```python\nprint('\\n'.join(f'line {i:03d}' for i in range(54)))\n```\n</code>",
               "So the answer is \\boxed{83810205}."]
    reply = "\n<interpreter>\n" + "\n".join(f"line {i:03d}" for i in range(54)) + "\n</interpreter>\n"

    async def main(cfg):
        eng = EmbeddedEngine(model, tok, logits_processor=scripted(tok, actions, turn_of))
        tr = await run_episode(eng, MathToolEnv(sandbox=sandbox), tok, SAMPLE,
                               SamplingParams(max_new_tokens=200), cfg)
        await eng.close()
        return tr

    tr = asyncio.run(main(AgentLoopConfig(max_observation_tokens=64)))
    assert tr.finish_reason == "terminated" and tr.reward == 1.0 and tr.turns == 2
    obs = [t for t, m in zip(tr.response_ids, tr.loss_mask, strict=True) if not m]
    text = tok.decode(obs)
    assert len(reply) == 516 and len(obs) == 64  # byte tokenizer: 516 tokens cut to 64
    # head (the first 19 bytes) + marker (30) + closing tag (15); 516 - 19 - 15 bytes left out
    head = reply[:19]
    assert head == "\n<interpreter>\nline"
    assert text == head + "\n...[truncated 482 tokens]...\n" + "</interpreter>\n"
    full = asyncio.run(main(AgentLoopConfig(max_observation_tokens=516)))  # fits: unchanged
    assert tok.decode([t for t, m in zip(full.response_ids, full.loss_mask, strict=True) if not m]) == reply


class StepRewardEnv:
    """Pure-Python two-step env: a non-terminal step rewarded ``first``, then a terminal one
    rewarded ``final`` (issue 10: non-terminal rewards must reach the batch)."""

    stop_strings = ()

    def __init__(self, first=0.5, final=1.0):
        self.first, self.final, self.turn = first, final, 0

    def reset(self, options=None):
        self.turn = 0
        return "Q:", {}

    def step(self, action):
        self.turn += 1
        if self.turn == 1:
            return "<obs>hint</obs>", self.first, False, False, {"turn": 1}
        return "", self.final, True, False, {"turn": 2}


STEP_ACTIONS = ["think", "answer"]


def step_turn_of(prompt_text: str) -> int:
    return min(prompt_text.count("</obs>"), 1)


def play(model, tok, env, cfg=None):
    async def main():
        eng = EmbeddedEngine(model, tok, logits_processor=scripted(tok, STEP_ACTIONS, step_turn_of),
                             version=0)
        tr = await run_episode(eng, env, tok, {"id": "s1"}, SamplingParams(max_new_tokens=20), cfg)
        await eng.close()
        return tr

    return asyncio.run(main())


def test_non_terminal_step_reward_reaches_the_batch_and_copc(model_tok):
    model, tok = model_tok
    tr = play(model, tok, StepRewardEnv())
    assert tr.finish_reason == "terminated" and tr.turns == 2 and tr.reward == 1.5
    n1 = len(tok.encode("think", add_special_tokens=False)) + 1  # + EOS
    n_obs = len(tok.encode("<obs>hint</obs>", add_special_tokens=False))
    n2 = len(tok.encode("answer", add_special_tokens=False)) + 1
    assert tr.loss_mask == [1] * n1 + [0] * n_obs + [1] * n2
    assert tr.step_rewards == [(n1 - 1, 0.5), (n1 + n_obs + n2 - 1, 1.0)]
    batch = to_batch([tr], tok.pad_token_id)
    T = n1 + n_obs + n2
    want = [0.0] * T
    want[n1 - 1], want[T - 1] = 0.5, 1.0  # turn 1's last token (before the obs); the last token
    assert batch.rewards.tolist() == [want]
    assert batch.scores.tolist() == [1.5]  # the episode return (GRPO/SAO score)
    # the copc preset at γ = λ = 1 with V = 0: on-policy (ρ̄ = 1) the returns are the
    # reward-to-go, 1.5 on turn 1 and 1.0 on turn 2; the advantage equals the return (V = 0)
    cfg = copc.get_preset("copc", gamma=1.0, lam=1.0)
    zeros = torch.zeros(1, T)

    def adv_ret(logp_old):
        return copc.compute_advantages(copc.AdvantageInputs(
            rewards=batch.rewards, loss_mask=batch.loss_mask, values=zeros, logp_old=logp_old,
            logp_mu=batch.logp_mu, scores=batch.scores, group_ids=batch.group_ids), cfg)

    adv, ret = adv_ret(batch.logp_mu)
    expect = [1.5] * n1 + [0.0] * n_obs + [1.0] * n2
    assert torch.allclose(ret, torch.tensor([expect])) and torch.allclose(adv, ret)
    # π_old = 2 µ on every token: ρ̄ = u_A = 1.28 weights every residual; with V = 0,
    # δ = r, so v̂ = 1.28·(0.5 + 1.0) on turn 1 and 1.28·1.0 on turn 2, and the advantage of
    # turn 1's last token keeps its own residual unweighted: 0.5 + 1.28·1.0
    adv, ret = adv_ret(batch.logp_mu + math.log(2.0) * batch.loss_mask)
    u = 1.0 + 0.5 * 0.56
    expect = [u * 1.5] * n1 + [0.0] * n_obs + [u * 1.0] * n2
    assert torch.allclose(ret, torch.tensor([expect]))
    assert adv[0, n1 - 1].item() == pytest.approx(0.5 + u * 1.0)
    assert adv[0, T - 1].item() == pytest.approx(1.0)


def test_step_rewards_on_cut_failed_and_bad_reward_episodes(model_tok):
    model, tok = model_tok
    n1 = len(tok.encode("think", add_special_tokens=False)) + 1
    n_obs = len(tok.encode("<obs>hint</obs>", add_special_tokens=False))
    prompt = len(tok.encode("Q:", add_special_tokens=False))
    # cut by max_total_tokens in turn 2: the turn-1 reward is kept, the cut turn earns nothing
    cut = play(model, tok, StepRewardEnv(), AgentLoopConfig(max_total_tokens=prompt + n1 + n_obs + 2))
    assert cut.finish_reason == "max_total_tokens" and cut.reward == 0.5
    assert to_batch([cut], tok.pad_token_id).rewards[0].nonzero().flatten().tolist() == [n1 - 1]
    # max_turns = 1: the non-terminal reward of the only step is kept
    one = play(model, tok, StepRewardEnv(), AgentLoopConfig(max_turns=1))
    assert one.finish_reason == "max_turns" and one.reward == 0.5 and one.step_rewards == [(n1 - 1, 0.5)]
    # a NaN reward is an environment bug: env_error, rewards cleared
    nan = play(model, tok, StepRewardEnv(final=math.nan))
    assert nan.finish_reason == "env_error: bad reward: reward nan is not finite"
    assert nan.env_failed and nan.reward == 0.0 and nan.step_rewards == []
    # an environment that raises after a rewarded step: rewards cleared (never trained on)
    env = StepRewardEnv()
    real = env.step

    def boom_second(action):
        if env.turn == 1:
            raise RuntimeError("tool exploded")
        return real(action)

    env.step = boom_second
    failed = play(model, tok, env)
    assert failed.finish_reason == "env_error: RuntimeError: tool exploded"
    assert failed.reward == 0.0 and failed.step_rewards == []


def test_invalid_actions_and_tool_calls_are_counted_per_episode(model_tok, sandbox):
    """Scripted: a code call then a turn with neither a call nor an answer (MathToolEnv ends the
    episode on it) -> 1 invalid action in 2 turns, 1 tool call; the step's rollout metrics average
    them over episodes (tool calls) and over turns (invalid-action rate)."""
    from trainer.orchestration.step_metrics import rollout_metrics
    from trainer.rollout.trajectory import Trajectory

    model, tok = model_tok
    env = MathToolEnv(sandbox=sandbox)
    actions = [ACTIONS[0], "I am not sure."]

    async def main():
        eng = EmbeddedEngine(model, tok, logits_processor=scripted(tok, actions, turn_of), version=0)
        tr = await run_episode(eng, env, tok, SAMPLE, SamplingParams(temperature=1.0, max_new_tokens=200))
        await eng.close()
        return tr

    tr = asyncio.run(main())
    assert tr.finish_reason == "terminated" and tr.turns == 2 and tr.reward == 0.0
    assert tr.info["invalid_actions"] == 1 and tr.info["tool_calls"] == 1 and tr.info["invalid"]
    clean = Trajectory(prompt_ids=[1], turns=2, info={"tool_calls": 0, "invalid_actions": 0})
    m = rollout_metrics([tr, clean], version=1)
    assert m["rollout/tool_calls"] == 0.5 and m["rollout/invalid_action_rate"] == 1 / 4
