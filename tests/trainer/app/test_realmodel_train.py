"""``copc train`` on the real pretrained model: one asynchronous COPC step of SmolLM2-135M-Instruct
with LoRA actor and critic, through the real bubblewrap sandbox (math) and the real BM25 retriever
over the shared Wikipedia corpus (search), with the shipped SmolLM2 prompts (configs/eval/).

Each run checks what only a real run shows: the tool really ran (a sampled episode made a tool
call and its tool output is in the trajectory), the tool output is masked from the loss (every
token from the opening ``<interpreter>`` / ``<information>`` tag to its closing tag has loss mask
0, the model's own tokens 1), the step trained (finite losses), only adapters and the value head
were checkpointed, and the adapters moved (peft initialises ``lora_B`` to zero: after one
optimizer step the actor's is not; the critic's zero-initialised value head is not)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from search_server import CORPUS, QA_DIR  # tests/trainer on sys.path

import copc
from trainer.app.run import run_experiment
from trainer.config import load_config
from trainer.outputs.checkpoint import CheckpointManager
from trainer.outputs.viewer.samples import read_samples

REPO = Path(__file__).parent.resolve().parents[2]
pytestmark = [pytest.mark.realmodel, pytest.mark.slow]

#: (config, tool output's opening and closing tags, overrides). A step needs a nonzero reward to
#: move anything (the value head starts at zero: all-zero rewards give zero returns, advantages and
#: gradients), so math scores a wrong answer -1 (DAPO's scale), and search trains on NQ questions
#: the model answered right greedily in the 200-question evaluation (README "A real model"),
#: written to ``{nq_rows}`` at test time.
CASES = {
    "math": ("configs/eval/smollm2_math.yaml", "<interpreter>", "</interpreter>",
             ["task.train_data=[math_train]", "task.env_kwargs.reward.incorrect_reward=-1"]),
    "search": ("configs/eval/smollm2_search.yaml", "<information>", "</information>",
               ["task.train_data=[{nq_rows}]"]),
}
SEARCH_ROWS = ("test_2051", "test_3107", "test_2493", "test_2721")


def _search_rows(path: Path) -> Path:
    """A JSONL of :data:`SEARCH_ROWS` from the shared NQ file (not committed: read at test time)."""
    rows = [x for x in (QA_DIR / "qa" / "nq.jsonl").read_text().splitlines()
            if json.loads(x)["id"] in SEARCH_ROWS]
    assert len(rows) == len(SEARCH_ROWS)
    path.write_text("\n".join(rows) + "\n")
    return path


def _overrides(model: Path, out: Path) -> list[str]:
    return [f"model.path={model}", f"output_dir={out}", "preset=copc",
            "learner.lora.rank=8", "learner.lora.alpha=16",
            "learner.lora.target_modules=[q_proj,v_proj]",
            "task.max_train_samples=8",
            "train.total_steps=1", "train.prompts_per_step=4", "train.micro_batch_size=4",
            "rollout.n_samples_per_prompt=1", "rollout.concurrency=4", "rollout.temperature=0.5",
            "rollout.max_new_tokens=96", "train.staleness.max=1",
            "logging.samples_per_step=8", "logging.progress=false",
            "eval.enabled=false", "warm_start.enabled=false", "checkpoint.every_steps=1",
            # the eval configs' eager float32 model at 4 x 2048 tokens: ~33 GiB at worst (the
            # memory check refuses it); this test's rows stay under ~700 tokens
            "learner.memory_check=false"]


def _tool_spans_masked(rec: dict, open_tag: str, close_tag: str) -> int:
    """Number of tool-output spans in ``rec``'s tokens; asserts every token overlapping a span is
    masked and that the model's own tokens before it (its tool call) are trained. An opening tag
    the model sampled itself (a trained token: SmolLM2 sometimes imitates the few-shot prompt's
    ``<interpreter>`` and is then cut by ``max_new_tokens``) is the model's text, not a tool output."""
    toks, mask = rec["tokens"], rec["loss_mask"]
    bounds, text = [], ""
    for t in toks:
        bounds.append((len(text), len(text) + len(t)))
        text += t
    spans, pos = 0, 0
    while (i := text.find(open_tag, pos)) >= 0:
        first = next(k for k, (a, b) in enumerate(bounds) if b > i)
        if mask[first] == 1:  # the model wrote the tag itself: not a tool output
            pos = i + len(open_tag)
            continue
        j = text.find(close_tag, i) + len(close_tag)
        assert j > i + len(open_tag), f"unclosed {open_tag} in {rec['sample_id']}"
        inside = [k for k, (a, b) in enumerate(bounds) if b > i and a < j]
        assert inside and all(mask[k] == 0 for k in inside), rec["sample_id"]
        assert any(mask[k] == 1 for k in range(inside[0]))  # the model's call before it is trained
        spans, pos = spans + 1, j
    return spans


@pytest.mark.parametrize("case", sorted(CASES))
def test_one_lora_copc_step_through_the_real_tool(realmodel_path, tmp_path, case):
    if case == "search" and not (CORPUS.is_file() and (QA_DIR / "qa" / "nq.jsonl").is_file()):
        pytest.skip(f"shared data not found under {QA_DIR}")
    config, open_tag, close_tag, extra = CASES[case]
    if case == "search":
        extra = [x.format(nq_rows=_search_rows(tmp_path / "nq_rows.jsonl")) for x in extra]
    out = tmp_path / case
    summary = run_experiment(load_config(str(REPO / config), [*_overrides(realmodel_path, out), *extra]))
    assert summary["steps"] == 1 and summary["trained_uids"] == 4
    step = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"actor/pg_loss"' in x]
    assert len(step) == 1 and all(math.isfinite(step[0][k]) for k in ("actor/pg_loss", "critic/value_loss"))
    assert step[0]["time/rollout_env_s"] > 0  # the sandbox / retriever was called

    recs = read_samples(out)
    assert len(recs) == 4
    assert sum(r["tool_calls"] for r in recs) >= 1
    assert sum(_tool_spans_masked(r, open_tag, close_tag) for r in recs) == sum(r["tool_calls"] for r in recs)

    ckpt = CheckpointManager(out / "checkpoints")
    state = ckpt.load(ckpt.latest())["learner"]
    assert "actor" not in state and "critic" not in state  # adapters (+ value head) only
    actor_b = [t for n, t in state["actor_lora"]["tensors"].items() if "lora_B" in n]
    assert actor_b and any(torch.count_nonzero(t) > 0 for t in actor_b)
    # the critic: its value head starts at zero, so step 1 moves the head (its LoRA B gets a gradient
    # through the head from step 2 on)
    head = [t for n, t in state["critic_lora"]["tensors"].items() if "lora_" not in n]
    assert head and any(torch.count_nonzero(t) > 0 for t in head)
    assert any("lora_B" in n for n in state["critic_lora"]["tensors"])


def test_two_rl_steps_of_the_search_main_job(realmodel_path, tmp_path, capsys):
    """``configs/search/cpu_smollm.yaml`` (the search main job) as committed, cut to 2 RL steps of 2
    prompts (4 prompts, groups of 4 episodes, 4 groups in flight): the real retriever was queried, every
    ``<information>`` block is masked from the loss, both roles' LoRA adapters moved, the heap was
    trimmed after each step, dynamic sampling counted its drops (at most 2 per batch here, so the
    test's time is bounded), the held-out evaluation (one question here) showed its progress bar
    and wrote its EM, tool-call and invalid-action rates before and after RL to ``summary.json``."""
    if not (CORPUS.is_file() and (QA_DIR / "qa" / "nq.jsonl").is_file()):
        pytest.skip(f"shared data not found under {QA_DIR}")
    nq = [json.loads(x) for x in (QA_DIR / "qa" / "nq.jsonl").read_text().splitlines()]
    rows = [r for r in nq if r["id"] == "test_3283"] + [r for r in nq if r["id"] in SEARCH_ROWS]
    assert len(rows) == 5  # row 0 is the one held out (held_out_every 100); the 4 others train
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    cfg = load_config(str(REPO / "configs/search/cpu_smollm.yaml"), [
        f"model.path={realmodel_path}", f"output_dir={out}", f"task.train_data=[{data}]",
        f"task.eval_data=[{data}]", "task.settings.held_out_every=100", "eval.num_samples=1",
        "train.total_steps=2", "train.prompts_per_step=2", "train.micro_batch_size=4",
        "train.max_filtered_groups_per_batch=2",
        "train.staleness={mode: fixed, lag: 4, groups_in_flight: 4}",  # 2x the batch's groups, as 8 for 4
        "rollout.concurrency=8", "logging.samples_per_step=8", "logging.progress=true",
        "checkpoint.every_steps=2"])
    # the job's own settings
    job = load_config(str(REPO / "configs/search/cpu_smollm.yaml"), [f"model.path={realmodel_path}"])
    assert job.train.staleness == {"mode": "fixed", "lag": 4, "groups_in_flight": 8}
    assert job.model.dtype == "bfloat16" and cfg.learner.lora is not None
    assert cfg.train.filter_groups and cfg.rollout.n_samples_per_prompt == 4
    summary = run_experiment(cfg)
    assert summary["steps"] == 2 and summary["trained_uids"] == 4
    lines = (out / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(x) for x in lines if '"actor/pg_loss"' in x]
    assert len(steps) == 2 and all(s["time/rollout_env_s"] > 0 for s in steps)  # the retriever answered
    assert all(s["perf/malloc_trim_s"] >= 0 for s in steps)  # learner.malloc_trim, on by default
    assert all(s["rollout/episodes"] == 8 for s in steps)  # 2 groups of 4 trained per step
    # each batch dropped at most 2 rewardless groups, all counted (cumulative = sum of the steps')
    dropped = steps[-1]["rollout/filtered_groups"]
    assert 0 <= dropped == sum(s["rollout/filtered_groups_step"] for s in steps) <= 4
    surplus = steps[-1]["rollout/surplus_groups"]  # kept groups beyond a batch's 2: counted, not trained
    assert 0 <= surplus == sum(s["rollout/surplus_groups_step"] for s in steps)
    assert steps[-1]["rollout/episodes_total"] >= 4 * (2 * 2 + dropped + surplus)  # every group generated
    err = capsys.readouterr().err
    assert "eval before_rl" in err and "eval after_rl" in err and "1/1" in err, err[-2000:]
    recs = read_samples(out)
    calls = sum(r["tool_calls"] for r in recs)
    assert calls >= 1 and sum(_tool_spans_masked(r, "<information>", "</information>") for r in recs) == calls
    for key in ("eval_before", "eval_after"):
        assert {"tool_call_rate", "invalid_action_rate", "mean_tool_calls"} <= set(summary[key]), summary[key]

    ckpt = CheckpointManager(out / "checkpoints")
    state = ckpt.load(ckpt.latest())["learner"]
    for role in ("actor_lora", "critic_lora"):  # after 2 steps the critic's B has had a gradient too
        b = [t for n, t in state[role]["tensors"].items() if "lora_B" in n]
        assert b and any(torch.count_nonzero(t) > 0 for t in b), role


def test_two_rl_steps_of_the_math_main_job(realmodel_path, tmp_path):
    """``configs/math_tool/cpu_smollm.yaml`` (the math job on the real model, issue 45 item 5) as
    committed, cut to a warm-start of 8 steps on 32 GSM8K-solution traces and 2 RL steps of 2 prompts
    (4 GSM8K training rows, groups of 4 episodes): the warm-start ran on the real sandbox's traces,
    the RL episodes called the real sandbox, every ``<interpreter>`` block is masked from the loss,
    both roles' LoRA adapters moved, and the held-out evaluation (one problem) wrote its accuracy,
    tool-call, answer and invalid-action rates before and after RL to ``summary.json``."""
    rows = (REPO / "data" / "gsm8k_train.jsonl").read_text().splitlines()[:5]
    data = tmp_path / "rows.jsonl"
    data.write_text("\n".join(rows[:4]) + "\n")
    held = tmp_path / "held.jsonl"
    held.write_text(rows[4] + "\n")
    out = tmp_path / "run"
    overrides = [f"model.path={realmodel_path}", f"output_dir={out}", f"task.train_data=[{data}]",
                 f"task.eval_data=[{held}]", "eval.num_samples=1", "task.max_eval_samples=1",
                 "warm_start.num_examples=32", "warm_start.steps=8", "warm_start.batch_size=4",
                 "train.total_steps=2", "train.prompts_per_step=2", "train.micro_batch_size=4",
                 "rollout.max_new_tokens=160", "logging.samples_per_step=8", "logging.progress=false",
                 "checkpoint.every_steps=2",
                 # 8 SFT steps leave the model near 0 accuracy: with 1/0 rewards every return and
                 # advantage would be 0 and nothing would move; DAPO's -1 for a wrong answer gives both
                 # roles a gradient (as test_one_lora_copc_step_through_the_real_tool's math case)
                 "task.env_kwargs.reward.incorrect_reward=-1"]
    job = load_config(str(REPO / "configs/math_tool/cpu_smollm.yaml"), [f"model.path={realmodel_path}"])
    assert job.train.staleness == {"mode": "fixed", "lag": 2}
    assert job.model.dtype == "bfloat16" and job.learner.lora is not None and not job.train.filter_groups
    assert job.warm_start.enabled and job.warm_start.kind == "gsm8k_solutions"
    preset = copc.get_preset(job.preset)  # the paper's eta_P = eta_A = 0.5
    assert (preset.policy_loss_settings.eta_p, preset.estimator_settings.eta_a) == (0.5, 0.5)
    summary = run_experiment(load_config(str(REPO / "configs/math_tool/cpu_smollm.yaml"), overrides))
    assert summary["steps"] == 2 and summary["trained_uids"] == 4
    assert summary["warm_start"]["sft/steps"] == 8 and summary["warm_start"]["sft/traces"] == 32
    lines = (out / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(x) for x in lines if '"actor/pg_loss"' in x]
    assert len(steps) == 2 and all(s["rollout/episodes"] == 8 for s in steps)
    assert sum(s["time/rollout_env_s"] for s in steps) > 0
    recs = read_samples(out)
    calls = sum(r["tool_calls"] for r in recs)
    assert calls >= 1, [r["tool_calls"] for r in recs]
    assert sum(_tool_spans_masked(r, "<interpreter>", "</interpreter>") for r in recs) == calls
    for key in ("eval_before", "eval_after"):
        assert {"accuracy", "tool_call_rate", "answer_rate", "invalid_action_rate"} <= set(summary[key]), \
            summary[key]
    ckpt = CheckpointManager(out / "checkpoints")
    state = ckpt.load(ckpt.latest())["learner"]
    for role in ("actor_lora", "critic_lora"):
        b = [t for n, t in state[role]["tensors"].items() if "lora_B" in n]
        assert b and any(torch.count_nonzero(t) > 0 for t in b), role
