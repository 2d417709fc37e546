"""The real-model base config (configs/scale/cpu_realmodel.yaml, issue 45 item 4): the search job
composes it and resolves to the values its measured results were obtained with."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from trainer.config import load_config

ROOT = Path(__file__).resolve().parents[3]
BASE = ROOT / "configs" / "scale" / "cpu_realmodel.yaml"
SEARCH = ROOT / "configs" / "search" / "cpu_smollm.yaml"


def _leaves(d: dict, prefix: str = "") -> dict[str, object]:
    """``{"a.b": value}`` of every leaf of a nested mapping (lists are leaves)."""
    out: dict[str, object] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_leaves(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


@pytest.mark.realmodel
def test_search_job_composes_the_base_and_keeps_its_settings(realmodel_path):
    """The search job lists the base in its defaults, repeats none of its keys, and resolves to
    every setting its measured results depend on (the values of the committed config before the
    base existed; the whole resolved config was diffed equal)."""
    search = yaml.safe_load(SEARCH.read_text())
    assert "../scale/cpu_realmodel.yaml" in search["defaults"]
    base, own = _leaves(yaml.safe_load(BASE.read_text())), _leaves(search)
    assert not [k for k in own if k in base and own[k] == base[k]]
    cfg = load_config(SEARCH)
    assert Path(cfg.model.path) == Path(realmodel_path)
    assert (cfg.model.dtype, cfg.model.attn_implementation) == ("bfloat16", "sdpa")
    lora = cfg.learner.lora
    assert (lora.rank, lora.alpha) == (16, 32)
    assert list(lora.target_modules) == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert cfg.learner.critic_lora is None
    assert dict(cfg.learner.backend_settings) == {"gradient_checkpointing": False,
                                                  "autocast_dtype": "bfloat16", "shared_prefix_tokens": 64}
    r = cfg.rollout
    assert (r.engine, r.use_chat_template, r.temperature, r.max_turns, r.n_samples_per_prompt) == \
        ("embedded", False, 0.6, 3, 4)
    assert (r.max_new_tokens, r.max_total_tokens, r.concurrency, r.max_observation_tokens) == \
        (48, 2048, 16, 1024)
    t = cfg.train
    assert (t.total_steps, t.prompts_per_step, t.num_mini_batches, t.micro_batch_size) == (24, 4, 4, 4)
    assert (t.actor_lr, t.critic_lr, t.torch_threads, t.warmup_steps, t.filter_groups) == \
        (2.0e-4, 1.0e-4, 1, 0, True)
    assert (cfg.staleness.mode, cfg.staleness.versions) == ("fixed", 4)
    assert cfg.warm_start.enabled is False
    assert (cfg.eval.num_samples, cfg.eval.temperature) == (334, 0.0)
    assert cfg.launcher.kind == "ray"
    assert dict(cfg.launcher.settings) == {"num_rollout_workers": 2, "num_cpus": 2}


@pytest.mark.realmodel
def test_base_alone_is_a_real_model_recipe(realmodel_path):
    """The base on its own (with any task) gives the settings a pretrained model needs, not the
    toy's: sdpa, bf16, LoRA, T < 1, a real response cap."""
    cfg = load_config(BASE)
    assert Path(cfg.model.path) == Path(realmodel_path)
    assert cfg.model.attn_implementation == "sdpa" and cfg.learner.lora is not None
    assert cfg.rollout.temperature == 0.6 and cfg.rollout.max_new_tokens >= 256
    assert (cfg.train.actor_lr, cfg.train.critic_lr) == (2.0e-4, 1.0e-4)
