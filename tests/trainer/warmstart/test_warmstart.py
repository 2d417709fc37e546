"""Warm start: arithmetic problems, traces from the real MathToolEnv, the Search-R1 question pool, SFT.

The Search-R1 traces (real SearchEnv and retriever) are tested in test_search_traces.py."""

from __future__ import annotations

import ast
import asyncio
import operator
import re

import pytest
import torch
from scripted import scripted
from search_server import QA_DIR

from environments.math_tool import MathToolEnv
from environments.math_tool.reward import MathRewardConfig
from trainer.engines.base import SamplingParams
from trainer.engines.embedded import EmbeddedEngine
from trainer.models.tiny import TinyModelConfig, build_byte_tokenizer, build_tiny_model
from trainer.rollout.agent_loop import AgentLoopConfig, run_episode
from trainer.rollout.observation import truncate_observation_ids
from trainer.tasks.math_tool import (
    SHORT_MATH_PROMPT,
    arithmetic_splits,
    retool_arithmetic_samples,
    retool_traces,
)
from trainer.tasks.search import search_r1_samples
from trainer.warmstart import TraceError, sft_warm_start, tokenize_trace

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _value(node: ast.AST) -> int:
    """Reference evaluator of +, -, * integer expressions (independent of the generator)."""
    if isinstance(node, ast.Expression):
        return _value(node.body)
    if isinstance(node, ast.BinOp):
        return _OPS[type(node.op)](_value(node.left), _value(node.right))
    assert isinstance(node, ast.Constant) and isinstance(node.value, int)
    return node.value


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def math_env_factory(sandbox):
    return lambda: MathToolEnv(sandbox=sandbox, prompt_template=SHORT_MATH_PROMPT,
                               reward=MathRewardConfig(mode="dapo_strict"))


def test_arithmetic_samples_exact_deterministic_disjoint():
    rows = retool_arithmetic_samples(300, seed=7)
    assert rows == retool_arithmetic_samples(300, seed=7)
    assert rows != retool_arithmetic_samples(300, seed=8)
    assert len({r["problem"] for r in rows}) == 300 and len({r["id"] for r in rows}) == 300
    for r in rows:
        expr = r["problem"].removeprefix("What is ").removesuffix("?")
        assert r["problem"] == f"What is {expr}?"
        assert r["answer"] == str(_value(ast.parse(expr, mode="eval")))
        # too hard for the head: at least one product with a >= 3-digit factor, >= 4-digit result
        assert "*" in expr and max(len(t) for t in expr.split()) >= 3 and abs(int(r["answer"])) >= 1000
    # offsets index one stream: rows [100, 150) of the stream are rows 100..149 of a longer read
    assert retool_arithmetic_samples(50, seed=7, offset=100) == rows[100:150]
    train, held = arithmetic_splits(200, 100, seed=7)
    assert train == rows[:200] and held == rows[200:300]
    assert not {r["problem"] for r in train} & {r["problem"] for r in held}
    with pytest.raises(ValueError, match="offset=-1"):
        retool_arithmetic_samples(3, seed=0, offset=-1)


def test_retool_traces_from_real_sandbox(math_env_factory):
    rows = retool_arithmetic_samples(20, seed=1)
    traces = retool_traces(rows, math_env_factory)
    assert len(traces) == 20
    for row, (prompt, pieces) in zip(rows, traces, strict=True):
        assert prompt == SHORT_MATH_PROMPT.format(problem=row["problem"])
        assert [k for k, _ in pieces] == ["action", "observation", "action"]
        expr = row["problem"].removeprefix("What is ").removesuffix("?")
        assert pieces[0][1] == f"Let me compute it.\n<code>\n```python\n{expr}\n```\n</code>"
        # the observation is the sandbox's real reply (the value printed by Python)
        assert pieces[1][1] == f"\n<interpreter>\n{row['answer']}\n</interpreter>\n"
        assert pieces[2][1] == f"\\boxed{{{row['answer']}}}"


def test_retool_traces_refuse_a_wrong_episode(math_env_factory):
    bad = {"id": "x", "problem": "What is 12 * 12?", "answer": "145"}
    with pytest.raises(TraceError, match="scored"):
        retool_traces([bad], math_env_factory)
    with pytest.raises(ValueError, match="What is <expression>"):
        retool_traces([{"id": "y", "problem": "12*12", "answer": "144"}], math_env_factory)


def test_tokenization_and_loss_mask_match_the_agent_loop(math_env_factory):
    """Token by token: SFT ids/mask == what the real agent loop builds for the same actions."""
    tok = build_byte_tokenizer()
    row = retool_arithmetic_samples(1, seed=3)[0]
    trace = retool_traces([row], math_env_factory)[0]
    cfg = AgentLoopConfig(max_observation_tokens=12)  # the loop's observation cut applies too
    ids, mask = tokenize_trace(tok, trace, cfg)
    prompt_ids = tok.encode(trace.prompt, add_special_tokens=False)
    assert ids[: len(prompt_ids)] == prompt_ids and set(mask[: len(prompt_ids)]) == {0}
    actions = [t for k, t in trace.pieces if k == "action"]
    model_ids = [i for i, m in zip(ids, mask, strict=True) if m]
    assert model_ids == [*tok.encode("".join(actions), add_special_tokens=False), tok.eos_token_id]
    obs_ids = [i for i, m in zip(ids[len(prompt_ids):], mask[len(prompt_ids):], strict=True) if not m]
    # the agent loop's cut (12 bytes < the closing tag: its last 12 tokens), exactly the budget
    assert obs_ids == truncate_observation_ids(tok, trace.pieces[1][1], 12) and len(obs_ids) == 12
    assert tok.decode(obs_ids) == "nterpreter>\n"

    model = build_tiny_model(TinyModelConfig(), len(tok), tok.eos_token_id, tok.pad_token_id)

    async def main():
        eng = EmbeddedEngine(model, tok, logits_processor=scripted(
            tok, actions, lambda p: min(p.count("nterpreter>"), 1)))  # turn 2 once a reply is in
        env = math_env_factory()
        tr = await run_episode(eng, env, tok, row, SamplingParams(max_new_tokens=100), cfg)
        env.close()
        await eng.close()
        return tr

    tr = asyncio.run(main())
    assert tr.reward == 1.0
    assert tr.prompt_ids + tr.response_ids == ids
    assert [0] * len(tr.prompt_ids) + tr.loss_mask == mask
    with pytest.raises(ValueError, match="must end with an action"):
        tokenize_trace(tok, ("p", [("action", "a"), ("observation", "o")]))
    with pytest.raises(ValueError, match="kind='tool'"):
        tokenize_trace(tok, ("p", [("tool", "a"), ("action", "o")]))


def test_sft_mask_comes_from_the_trajectory_chokepoint_hand_checked(math_env_factory):
    """A real multi-turn trace (code call, the sandbox's reply, boxed answer) through
    trace_trajectory: the mask is the Trajectory's own (the rollouts' producer), the same as before
    the change, at hand-counted byte positions (byte tokenizer: one token per UTF-8 byte)."""
    from trainer.rollout.batch import to_batch
    from trainer.rollout.trajectory import NO_VERSION
    from trainer.warmstart import trace_trajectory

    tok = build_byte_tokenizer()
    row = retool_arithmetic_samples(1, seed=3)[0]
    trace = retool_traces([row], math_env_factory)[0]
    assert trace.pieces == [("action", "Let me compute it.\n<code>\n```python\n9916 * 233\n```\n</code>"),
                            ("observation", "\n<interpreter>\n2310428\n</interpreter>\n"),
                            ("action", "\\boxed{2310428}")]
    # prompt: "Compute with Python in <code>, answer in \boxed{}.\n" (51 bytes) + "What is 9916 * 233?\n" (20)
    # action 1: 19 + 7 + 10 + 11 + 4 + 7 = 58 bytes; observation: 1 + 13 + 1 + 7 + 1 + 14 + 1 = 38;
    # action 2: "\boxed{2310428}" = 15 bytes + EOS
    traj = trace_trajectory(tok, trace)
    assert (len(traj.prompt_ids), traj.turns) == (71, 2)
    assert traj.loss_mask == [1] * 58 + [0] * 38 + [1] * 16
    assert set(traj.logp_mu) == {0.0} and traj.min_version() == NO_VERSION  # scripted: no policy
    ids, mask = tokenize_trace(tok, trace)
    assert (ids, mask) == traj.sequence() and len(ids) == 183
    assert mask == [0] * 71 + [1] * 58 + [0] * 38 + [1] * 16
    assert ids[-1] == tok.eos_token_id and ids[71 + 57] == ord(">") and ids[71 + 58] == ord("\n")
    # the observation cut of the agent loop: 12 tokens kept (the end of the closing tag)
    _, cut = tokenize_trace(tok, trace, AgentLoopConfig(max_observation_tokens=12))
    assert cut == [0] * 71 + [1] * 58 + [0] * 12 + [1] * 16
    # the batch the learner gets from this trajectory carries the same mask on its response columns
    batch = to_batch([traj], tok.pad_token_id)
    assert batch.loss_mask[0].tolist() == [float(m) for m in traj.loss_mask]


def test_sft_loss_decreases_and_ignores_observations(math_env_factory):
    tok = build_byte_tokenizer()
    traces = retool_traces(retool_arithmetic_samples(64, seed=2), math_env_factory)
    model = build_tiny_model(TinyModelConfig(seed=1), len(tok), tok.eos_token_id, tok.pad_token_id)
    m = sft_warm_start(model, tok, traces, steps=30, batch_size=8, lr=3e-3, seed=0, progress=False)
    assert m["sft/steps"] == 30 and m["sft/traces"] == 64 and m["sft/seconds"] > 0
    # random init of a 258-token vocabulary: ~ln(258) = 5.55 nats; a lot lower after 30 steps
    assert abs(m["sft/loss_first"] - 5.55) < 0.3 and m["sft/loss_last"] < 0.6 * m["sft/loss_first"]
    assert not model.training

    # the loss is the mean NLL of exactly the action tokens: reference through the learner's
    # log-prob function (trainer.logprobs), on a batch of two traces of different lengths
    from trainer.logprobs import sequence_logprobs
    from trainer.warmstart.sft import _batch, action_token_loss

    rows = [tokenize_trace(tok, t) for t in traces[:2]]
    ids, attn, lm = _batch(rows, tok.pad_token_id)
    with torch.no_grad():
        got = float(action_token_loss(model, ids, attn, lm))
        ref_lp = torch.cat([sequence_logprobs(model, torch.tensor([x]),
                                              torch.ones(1, len(x), dtype=torch.long))[0] for x, _ in rows])
    ref_mask = torch.tensor([m for _, x in rows for m in x], dtype=torch.bool)
    assert abs(got - float(-ref_lp[ref_mask].mean())) < 1e-4
    assert int(lm.sum()) == sum(sum(m) for _, m in rows)
    with pytest.raises(ValueError, match="steps=0"):
        sft_warm_start(model, tok, traces, steps=0, batch_size=8, lr=1e-3, seed=0)
    with pytest.raises(ValueError, match="traces is empty"):
        sft_warm_start(model, tok, [], steps=1, batch_size=8, lr=1e-3, seed=0)


def test_sft_with_a_shared_few_shot_prefix_is_the_plain_sft(math_env_factory):
    """``shared_prefix_tokens``: traces whose prompts share a long few-shot prefix (here 200 tokens)
    train exactly as without it (the prefix run once per batch instead of once per trace): the same
    losses and weights to float32 rounding after 4 steps; bf16 autocast trains too (losses within
    0.05 nats of float32's)."""
    tok = build_byte_tokenizer()
    few_shot = "Example: 12*34 is 408. Example: 56*78 is 4368. " * 4  # 200 bytes = 200 tokens
    traces = [type(t)(few_shot + t.prompt, t.pieces)
              for t in retool_traces(retool_arithmetic_samples(16, seed=4), math_env_factory)]
    runs = {}
    for name, kw in {"plain": {}, "shared": {"shared_prefix_tokens": 64},
                     "bf16": {"shared_prefix_tokens": 64, "autocast_dtype": torch.bfloat16}}.items():
        model = build_tiny_model(TinyModelConfig(seed=3, max_position_embeddings=512), len(tok),
                                 tok.eos_token_id, tok.pad_token_id)
        losses, embedded = [], []  # embedded: tokens through the embedding per forward
        hook = model.get_decoder().embed_tokens.register_forward_hook(
            lambda _m, args, _out, out=embedded: out.append(args[0].numel()))
        sft_warm_start(model, tok, traces, steps=4, batch_size=4, lr=3e-3, seed=0, progress=False,
                       on_step=lambda _, loss, out=losses: out.append(loss), **kw)
        hook.remove()
        runs[name] = (losses, torch.cat([p.detach().flatten() for p in model.parameters()]), sum(embedded))
    assert max(abs(a - b) for a, b in zip(runs["plain"][0], runs["shared"][0], strict=True)) < 1e-5
    assert float((runs["plain"][1] - runs["shared"][1]).abs().max()) < 1e-5
    assert max(abs(a - b) for a, b in zip(runs["plain"][0], runs["bf16"][0], strict=True)) < 0.05
    assert float((runs["plain"][1] - runs["bf16"][1]).abs().max()) > 0  # bf16 compute: not bit-equal
    # the prefix really ran once per batch: 4 batches x 3 traces x >= 200 prefix tokens fewer embedded
    assert runs["plain"][2] - runs["shared"][2] >= 4 * 3 * 200, (runs["plain"][2], runs["shared"][2])


def test_short_sft_reproduces_the_trace_format_in_the_real_agent_loop(math_env_factory):
    """After a short SFT, greedy decoding through the real loop + engine + env calls the tool and
    the sandbox runs the code (a number comes back in <interpreter>)."""
    from trainer.evaluate.heldout import run_eval_episodes

    tok = build_byte_tokenizer()
    train = retool_arithmetic_samples(64, seed=5, kinds=("mul",))
    held = retool_arithmetic_samples(4, seed=5, offset=64, kinds=("mul",))
    traces = retool_traces(train, math_env_factory)
    model = build_tiny_model(TinyModelConfig(seed=2, max_position_embeddings=512), len(tok),
                             tok.eos_token_id, tok.pad_token_id)
    m = sft_warm_start(model, tok, traces, steps=60, batch_size=8, lr=1e-2, seed=0, progress=False)
    assert m["sft/loss_last"] < 0.25 * m["sft/loss_first"]

    async def main():
        eng = EmbeddedEngine(model, tok)
        try:
            return await run_eval_episodes(eng, math_env_factory, tok, held, agent_cfg=AgentLoopConfig(
                max_turns=2, max_total_tokens=300), max_new_tokens=60, concurrency=4)
        finally:
            await eng.close()

    trajs = asyncio.run(main())
    ran = 0
    for tr in trajs:
        text = tok.decode(tr.model_token_ids(), skip_special_tokens=True)
        obs = tok.decode([t for t, k in zip(tr.response_ids, tr.loss_mask, strict=True) if not k])
        assert text.startswith("Let me compute it.\n<code>\n```python\n")
        number_back = re.fullmatch(r"\s*<interpreter>\n-?\d+\n</interpreter>\s*", obs)
        ran += tr.info.get("tool_calls", 0) >= 1 and number_back is not None
    assert ran >= 3


@pytest.mark.skipif(not (QA_DIR / "qa" / "nq.jsonl").is_file(), reason=f"QA sets not found under {QA_DIR}")
def test_search_r1_samples_shuffled_pool_with_disjoint_ranges():
    qs = search_r1_samples(("nq", "hotpotqa"), n=6, seed=3, data_dir=str(QA_DIR))
    assert qs == search_r1_samples(("nq", "hotpotqa"), n=6, seed=3, data_dir=str(QA_DIR))
    rest = search_r1_samples(("nq", "hotpotqa"), n=10, seed=3, offset=6, data_dir=str(QA_DIR))
    assert not {q["id"] for q in qs} & {q["id"] for q in rest}
    everything = search_r1_samples(("nq", "hotpotqa"), seed=3, data_dir=str(QA_DIR))
    assert len(everything) == 1000 and {q["data_source"] for q in everything} == {"nq", "hotpotqa"}
    assert len({q["id"] for q in everything}) == 1000
    # ranges index one shuffled pool: [0, 6) and [6, 16) are its first 16 rows
    assert everything[:16] == qs + rest
    for q in qs:
        name, _, _ = q["id"].partition("/")
        assert name == q["data_source"] and q["question"] and q["golden_answers"]
    with pytest.raises(ValueError, match="exceeds the 1000 questions"):
        search_r1_samples(("nq", "hotpotqa"), n=10, offset=995, data_dir=str(QA_DIR))
