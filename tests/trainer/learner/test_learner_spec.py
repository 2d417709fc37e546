"""The learner's typed spec (:class:`trainer.learner.spec.LearnerSpec`, built by
:func:`trainer.config.specs.learner_spec`): what it holds, how it pickles to rank processes, and
reading a backend's settings as another backend's class."""

from __future__ import annotations

import pickle
import sys
import textwrap

import pytest

from trainer.config import ConfigError, load_config
from trainer.config.specs import learner_config, learner_spec
from trainer.learner import LEARNERS, DistributedSettings, TorchSettings
from trainer.learner.spec import LearnerSpec


def test_the_spec_holds_what_the_learner_reads_from_the_config(tmp_path):
    plug = tmp_path / "spec_plugin_noop.py"
    plug.write_text("X = 1\n")
    cfg = load_config(None, ["model.dtype=bfloat16", "model.attn_implementation=sdpa",
                             "train.torch_threads=3", "learner.malloc_mmap_threshold=65536",
                             "learner.malloc_trim=false", "logging.samples_per_step=0",
                             "learner.backend_settings.logprob_chunk_tokens=64", f"plugins=[{plug}]"])
    spec = learner_spec(cfg)
    assert (spec.backend, spec.dtype, spec.attn_implementation, spec.torch_threads) == ("torch", "bfloat16",
                                                                                        "sdpa", 3)
    assert (spec.malloc_mmap_threshold, spec.malloc_trim, spec.keep_step_inputs) == (65536, False, False)
    assert spec.algorithm == cfg.algorithm_config() and spec.step == learner_config(cfg)
    assert spec.settings == TorchSettings(logprob_chunk_tokens=64) and spec.step.logprob_chunk_tokens == 64
    assert dict(spec.raw_settings) == {"logprob_chunk_tokens": 64}
    assert spec.plugins == (str(plug.resolve()),)
    assert pickle.loads(pickle.dumps(spec)) == spec
    sys.modules.pop("spec_plugin_noop", None)


def test_unpickling_imports_the_plugins_its_settings_come_from(tmp_path):
    plug = tmp_path / "spec_plugin_backend.py"
    plug.write_text(textwrap.dedent("""
        from dataclasses import dataclass
        from trainer.learner import register_learner

        @dataclass
        class SpecPluginSettings:
            rank: int = 8

        register_learner("spec_plugin", lambda spec, model_dir: spec, overwrite=True,
                         settings=SpecPluginSettings)
    """))
    try:
        cfg = load_config(None, [f"plugins=[{plug}]", "learner.backend=spec_plugin",
                                 "learner.backend_settings.rank=4"])
        data = pickle.dumps(learner_spec(cfg))
        sys.modules.pop("spec_plugin_backend")  # as in a fresh rank process: the class is not imported
        spec = pickle.loads(data)
        assert type(spec.settings).__name__ == "SpecPluginSettings" and spec.settings.rank == 4
        assert "spec_plugin_backend" in sys.modules
    finally:
        if "spec_plugin" in LEARNERS:
            LEARNERS.unregister("spec_plugin")
        sys.modules.pop("spec_plugin_backend", None)


def test_settings_read_as_another_backend_s_class():
    """A rank learner's factory called with a ``torch`` spec (the megatron tests) reads
    ``learner.backend_settings`` as a :class:`DistributedSettings`, and its step settings as
    ``learner_config`` would with those settings."""
    cfg = load_config(None, ["learner.backend_settings.logprob_chunk_tokens=32"])
    spec = learner_spec(cfg)
    own = spec.settings_as(DistributedSettings)
    assert own == DistributedSettings(logprob_chunk_tokens=32)
    assert spec.step_with(own) == learner_config(cfg, own)
    assert spec.settings_as(TorchSettings) is spec.settings and spec.step_with(spec.settings) is spec.step
    bad = learner_spec(load_config(None, ["learner.backend_settings.autocast_dtype=bfloat16"]))
    with pytest.raises(ConfigError, match=r"^learner\.backend_settings\.autocast_dtype='bfloat16': unknown "
                                          r"setting of DistributedSettings"):
        bad.settings_as(DistributedSettings)
    with pytest.raises(ConfigError, match=r"^learner\.backend='torch': its settings are not a LearnerSpec"):
        spec.settings_as(LearnerSpec)
