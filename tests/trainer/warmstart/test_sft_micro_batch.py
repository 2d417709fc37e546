"""Warm-start micro-batching (``warm_start.micro_batch_size``): gradient accumulation gives the
whole batch's loss and update, and the memory check sees the worst forward before the first step."""

from __future__ import annotations

import pytest
import torch

from environments.math_tool import MathToolEnv
from environments.math_tool.reward import MathRewardConfig
from trainer.models.tiny import TinyModelConfig, build_byte_tokenizer, build_tiny_model
from trainer.tasks.math_tool import SHORT_MATH_PROMPT, retool_arithmetic_samples, retool_traces
from trainer.warmstart import sft_warm_start, tokenize_trace

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def traces(sandbox):
    """12 ReTool traces played through the real sandbox (rows of different lengths)."""
    def factory():
        return MathToolEnv(sandbox=sandbox, prompt_template=SHORT_MATH_PROMPT,
                           reward=MathRewardConfig(mode="dapo_strict"))
    return retool_traces(retool_arithmetic_samples(12, seed=7), factory)


def _train(traces, **kw):
    tok = build_byte_tokenizer()
    model = build_tiny_model(TinyModelConfig(seed=5, max_position_embeddings=512), len(tok),
                             tok.eos_token_id, tok.pad_token_id)
    losses, seen, rows = [], [], []  # rows: batch rows of each forward (the embedding's input)
    hook = model.get_decoder().embed_tokens.register_forward_hook(
        lambda _m, args, _out: rows.append(args[0].shape[0]))
    sft_warm_start(model, tok, traces, steps=3, batch_size=6, lr=3e-3, seed=0, progress=False,
                   on_step=lambda _, loss: losses.append(loss),
                   check_memory=lambda n, tokens: seen.append((n, tokens)), **kw)
    hook.remove()
    return losses, torch.cat([p.detach().flatten() for p in model.parameters()]), (seen, rows)


def test_micro_batches_give_the_whole_batchs_loss_and_update(traces):
    """Micro-batches of 1, 2 and 4 rows (4 does not divide 6: a short last one) against the whole
    batch of 6: the same losses and weights after 3 steps to float32 rounding, in float32 and in
    bf16 autocast (losses to bf16 rounding, weights on average); the memory check is called once,
    with the rows per forward and the longest trace's token count."""
    tok = build_byte_tokenizer()
    longest = max(len(tokenize_trace(tok, t)[0]) for t in traces)
    whole, w_params, (seen, rows) = _train(traces)
    assert seen == [(6, longest)] and whole[0] > whole[-1] and rows == [6, 6, 6]
    for micro, per_step in ((1, [1] * 6), (2, [2, 2, 2]), (4, [4, 2])):
        losses, params, (seen, rows) = _train(traces, micro_batch_size=micro)
        assert seen == [(micro, longest)] and rows == per_step * 3, (micro, rows)
        assert max(abs(a - b) for a, b in zip(whole, losses, strict=True)) < 1e-5, (micro, whole, losses)
        assert float((params - w_params).abs().max()) < 1e-5, micro
    bf_whole, bf_params, _ = _train(traces, autocast_dtype=torch.bfloat16)
    bf_micro, bf_mparams, _ = _train(traces, autocast_dtype=torch.bfloat16, micro_batch_size=2)
    assert max(abs(a - b) for a, b in zip(bf_whole, bf_micro, strict=True)) < 0.02
    # AdamW's first steps move a weight by ~lr whatever its gradient's size, so bf16 rounding can
    # flip a near-zero gradient's sign: compare the mean change, not the largest
    moved = float((bf_params - _train(traces, autocast_dtype=torch.bfloat16)[1]).abs().mean())
    assert moved == 0.0  # bf16 autocast on one thread is deterministic: the reference is exact
    # measured: 4e-6, against 3.5e-5 between bf16 and float32 themselves
    assert float((bf_params - bf_mparams).abs().mean()) < 0.3 * float((bf_params - w_params).abs().mean())


def test_a_refusing_memory_check_stops_before_any_step(traces):
    """A check that raises stops the warm-start before the first optimizer step (weights unchanged);
    a negative micro-batch is refused naming it."""
    tok = build_byte_tokenizer()
    model = build_tiny_model(TinyModelConfig(seed=5, max_position_embeddings=512), len(tok),
                             tok.eos_token_id, tok.pad_token_id)
    before = torch.cat([p.detach().flatten() for p in model.parameters()]).clone()

    def refuse(rows, tokens):
        raise RuntimeError(f"no room for {rows} x {tokens}")
    with pytest.raises(RuntimeError, match="no room for 3 x"):
        sft_warm_start(model, tok, traces, steps=2, batch_size=6, micro_batch_size=3, lr=1e-3, seed=0,
                       progress=False, check_memory=refuse)
    assert torch.equal(torch.cat([p.detach().flatten() for p in model.parameters()]), before)
    with pytest.raises(ValueError, match="micro_batch_size=-1"):
        sft_warm_start(model, tok, traces, steps=2, batch_size=6, micro_batch_size=-1, lr=1e-3, seed=0,
                       progress=False)


def test_predicted_tokens_leave_out_a_masked_in_first_token():
    """A row whose loss mask starts with 1 (nothing predicts its first token) counts one token
    fewer; the normalizer then equals ``action_token_loss``'s own count of scored positions."""
    from trainer.warmstart.sft import _predicted

    assert _predicted(([5, 6, 7], [1, 1, 0])) == 1
    assert _predicted(([5, 6, 7], [0, 1, 1])) == 2
    assert _predicted(([5], [0])) == 0
