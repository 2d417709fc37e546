"""FinishReason: the enum behind Trajectory.finish_reason, its detail, and the record strings it keeps."""

from __future__ import annotations

import json

import pytest

from trainer.evaluate.metrics import episode_statistics
from trainer.orchestration.step_metrics import rollout_metrics
from trainer.rollout.trajectory import (
    INFRA_FAILURE_REASONS,
    FinishReason,
    Trajectory,
    finish_text,
    split_finish,
)


def test_values_are_the_strings_records_carry():
    assert [r.value for r in FinishReason] == [
        "terminated", "truncated", "max_turns", "max_total_tokens",
        "infra_error", "engine_error", "env_error", "history_edited"]
    assert INFRA_FAILURE_REASONS == ("infra_error", "engine_error", "history_edited")
    # a str enum: equal to its value and written as the value by json
    assert FinishReason.TERMINATED == "terminated"
    record = {"finish_reason": finish_text(FinishReason.TERMINATED)}
    assert json.dumps(record) == '{"finish_reason": "terminated"}'


def test_finish_text_and_split_finish_round_trip():
    text = finish_text(FinishReason.ENV_ERROR, "RuntimeError: a: b")
    assert text == "env_error: RuntimeError: a: b"
    assert split_finish(text) == ("env_error", "RuntimeError: a: b")
    assert finish_text(FinishReason.INFRA_ERROR, "") == "infra_error: "  # an empty detail is kept as before
    assert split_finish("infra_error: ") == ("infra_error", "")
    assert split_finish("max_turns") == ("max_turns", "")
    assert split_finish("error:sandbox") == ("error", "sandbox")  # a foreign record's reason passes through
    assert split_finish("") == ("", "")


@pytest.mark.parametrize(("reason", "detail", "infra", "env"), [
    (FinishReason.TERMINATED, None, False, False),
    (FinishReason.MAX_TOTAL_TOKENS, None, False, False),
    (FinishReason.INFRA_ERROR, "retriever down", True, False),
    (FinishReason.ENGINE_ERROR, "timed out", True, False),
    (FinishReason.ENV_ERROR, "KeyError: 'x'", False, True),
])
def test_trajectory_finish_sets_the_string_and_the_readers_agree(reason, detail, infra, env):
    tr = Trajectory(prompt_ids=[1])
    assert tr.finish_kind is None and tr.finish_detail == ""
    tr.finish(reason, detail)
    assert tr.finish_reason == (reason.value if detail is None else f"{reason.value}: {detail}")
    assert tr.finish_kind is reason and tr.finish_detail == (detail or "")
    assert (tr.infra_failed, tr.env_failed) == (infra, env)
    # a trajectory built from the string (as records and tests do) reads the same
    again = Trajectory(prompt_ids=[1], finish_reason=tr.finish_reason)
    assert (again.finish_kind, again.finish_detail, again.infra_failed) == (reason, detail or "", infra)


def test_unknown_reason_is_neither_infra_nor_env_failure():
    tr = Trajectory(prompt_ids=[1], finish_reason="infra_errorx: no")
    assert tr.finish_kind is None and not tr.infra_failed and not tr.env_failed
    with pytest.raises(ValueError):
        tr.finish("bogus")


def test_metrics_count_by_the_reason_before_the_detail():
    trajs = [Trajectory(prompt_ids=[1], finish_reason=r) for r in
             ("terminated", "terminated", "max_turns", "env_error: boom")]
    m = rollout_metrics(trajs, version=0)
    assert (m["rollout/finish_terminated"], m["rollout/finish_max_turns"], m["rollout/finish_env_error"]) == (
        0.5, 0.25, 0.25)
    recs = [{"finish_reason": "terminated"}, {"finish_reason": "env_error: x: y"}, {}]
    stats = episode_statistics(recs, [{"finish_reason": "infra_error: down"}])
    assert stats["finish/terminated"] == pytest.approx(1 / 3)
    assert stats["finish/env_error"] == pytest.approx(1 / 3)
    assert stats["finish/unknown"] == pytest.approx(1 / 3) and stats["failed/infra_error"] == 1


def test_one_public_name_per_thing():
    """``FinishReason`` is the episode's reason only; a generation request's is ``StopReason``."""
    import typing

    from trainer.engines import base

    assert not hasattr(base, "FinishReason")
    assert typing.get_args(base.StopReason) == ("stop", "length", "eos", "abort")
    assert typing.get_type_hints(base.GenerationResult)["finish_reason"] == base.StopReason
