"""Every extension kind of ``docs/seams.md`` is one file plus one registration, with its own
settings: each test writes a plug-in file to ``tmp_path``, names it in the config's
``plugins:`` list, and checks that the plug-in's settings arrive validated (the dataclass
instance, with the values given) and that a bad setting is refused in one line naming the key
and the value. Also the one :class:`seams.registry.Registry` class and :func:`seams.settings.build_settings`.
"""

from __future__ import annotations

import json
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest
import torch

import copc
import environments
from seams.registry import Registry, RegistryError
from trainer.config import ConfigError, load_config, plugin_metadata, plugin_settings
from trainer.config.specs import learner_spec, task_spec


def plugin(tmp_path: Path, name: str, code: str) -> Path:
    """Write the plug-in module ``name.py`` (its import registers what it defines)."""
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(code))
    return path


class Registrations:
    """What a test's plug-in registered (``(registry, name)`` pairs) and its module stems."""

    def __init__(self) -> None:
        self.entries: list[tuple[object, str]] = []
        self.modules: list[str] = []


@pytest.fixture
def cleanup():
    """Unregister what a test's plug-in registered and forget its module afterwards (other tests
    see only the built-ins)."""
    done = Registrations()
    yield done
    for reg, name in done.entries:
        if name in reg:
            reg.unregister(name)
    for stem in done.modules:
        sys.modules.pop(stem, None)


# -- the one registry class -------------------------------------------------------------------

@dataclass
class _Knobs:
    size: int = 3
    ratio: float = 0.5
    mode: Literal["a", "b"] = "a"
    tags: list[str] = field(default_factory=list)
    limit: int | None = None


def test_registry_call_and_decorator_forms_overwrite_unregister_and_one_error_type():
    reg: Registry = Registry("widget", {"fast": (bool, False)}, key="x.widget")
    assert reg.register("a", len, settings=_Knobs) is len  # call form returns the entry

    @reg.register("b", fast=True)
    def b():
        return 2

    assert reg.names() == ["a", "b"] and reg.names(fast=True) == ["b"] and len(reg) == 2
    assert reg.get("b") is b and reg.settings_type("a") is _Knobs and reg.settings_type("b") is None
    with pytest.raises(RegistryError, match=r"widget 'a' is already registered \(pass overwrite=True\)"):
        reg.register("a", abs)
    reg.register("a", abs, overwrite=True)
    assert reg.get("a") is abs and reg.settings_type("a") is None  # the new registration, whole
    with pytest.raises(RegistryError) as ei:
        reg.get("zzz")
    # one error type, both a ValueError and a KeyError, with a plain (unquoted) message
    assert isinstance(ei.value, ValueError) and isinstance(ei.value, KeyError)
    assert str(ei.value) == "x.widget='zzz': unknown widget 'zzz'; known: ['a', 'b']"
    assert reg.unregister("b") is b and reg.names() == ["a"]
    with pytest.raises(RegistryError, match="settings must be a dataclass type"):
        reg.register("c", len, settings=dict)
    with pytest.raises(RegistryError, match="metadata fast must be a bool, got 1"):
        reg.register("c", len, fast=1)


def test_build_settings_checks_names_types_and_the_dataclass():
    reg: Registry = Registry("widget")
    reg.register("k", len, settings=_Knobs)
    s = reg.build_settings("k", {"size": 4, "ratio": 1, "tags": ["x"], "mode": "b", "limit": 7}, "w.settings")
    assert s == _Knobs(size=4, ratio=1.0, mode="b", tags=["x"], limit=7) and isinstance(s.ratio, float)
    assert reg.build_settings("k", None, "w.settings") == _Knobs()
    for raw, msg in [({"sise": 1}, "w.settings.sise=1: unknown setting of _Knobs; known: ['limit', 'mode', "
                                   "'ratio', 'size', 'tags']"),
                     ({"size": "4"}, "w.settings.size='4': must be an int"),
                     ({"size": True}, "w.settings.size=True: must be an int"),
                     ({"mode": "c"}, "w.settings.mode='c': must be one of ['a', 'b']"),
                     ({"tags": "x"}, "w.settings.tags='x': must be a list"),
                     ({"tags": [1]}, "w.settings.tags[0]=1: must be a str"),
                     ({"limit": 1.5}, "w.settings.limit=1.5: must be int | NoneType")]:
        with pytest.raises(RegistryError) as ei:
            reg.build_settings("k", raw, "w.settings")
        assert str(ei.value) == msg


# -- one test per extension kind: a plug-in file with its own settings ---------------------------

def test_an_estimator_and_a_policy_loss_from_a_plugin_file(tmp_path, cleanup):
    path = plugin(tmp_path, "seam_algos", """
        from dataclasses import dataclass
        import copc

        @dataclass
        class ScaleSettings:
            scale: float = 1.0

        @copc.ADVANTAGE_ESTIMATORS.register("scaled_reward", needs_critic=False, settings=ScaleSettings)
        def scaled_reward(x, cfg):
            adv = x.rewards * cfg.estimator_settings.scale
            return adv, adv.clone()

        @dataclass
        class CoefSettings:
            coef: float = 1.0

        @copc.POLICY_LOSSES.register("weighted_pg", settings=CoefSettings)
        def weighted_pg(logp, x, cfg):
            m = x.loss_mask.float()
            loss = -cfg.policy_loss_settings.coef * (logp * x.advantages * m).sum() / m.sum()
            return loss, {"actor/pg_loss": float(loss.detach())}
    """)
    cleanup.entries += [(copc.ADVANTAGE_ESTIMATORS, "scaled_reward"), (copc.POLICY_LOSSES, "weighted_pg")]
    cleanup.modules.append("seam_algos")
    base = [f"plugins=[{path}]", "preset=dapo", "rollout.n_samples_per_prompt=2"]
    cfg = load_config(None, [*base, "algorithm={advantage_estimator: scaled_reward, policy_loss: "
                                    "weighted_pg, estimator_settings: {scale: 2}, "
                                    "policy_loss_settings: {coef: 0.5}}"])
    algo = cfg.algorithm_config()
    assert type(algo.estimator_settings).__name__ == "ScaleSettings" and algo.estimator_settings.scale == 2.0
    assert algo.policy_loss_settings.coef == 0.5
    rewards, mask = torch.tensor([[0.0, 1.0], [0.0, 1.0]]), torch.ones(2, 2)
    adv, _ = copc.compute_advantages(copc.AdvantageInputs(rewards=rewards, loss_mask=mask), algo)
    assert torch.equal(adv, torch.tensor([[0.0, 2.0], [0.0, 2.0]]))  # scale 2
    logp = torch.full((2, 2), -0.5)
    loss, _ = copc.compute_policy_loss(logp, copc.PolicyLossInputs(logp, logp, adv, mask), algo)
    assert float(loss) == pytest.approx(0.25)  # -0.5 * (-0.5 * (2 + 2)) / 4 with coef 0.5
    with pytest.raises(ConfigError) as ei:
        load_config(None, [*base, "algorithm={advantage_estimator: scaled_reward, "
                                  "estimator_settings: {scal: 2}}"])
    assert str(ei.value) == ("algorithm.estimator_settings.scal=2: unknown setting of ScaleSettings; "
                             "known: ['scale']")


def test_an_engine_from_a_plugin_file_gets_its_settings(tmp_path, cleanup):
    from trainer.config.specs import engine_spec
    from trainer.engines import ENGINES, make_engine

    path = plugin(tmp_path, "seam_engine", """
        from dataclasses import dataclass
        from trainer.engines import register_engine

        @dataclass(frozen=True)
        class EchoSettings:
            port: int = 8000
            verbose: bool = False

            def __post_init__(self):
                if not 1 <= self.port <= 65535:
                    raise ValueError(f"port={self.port!r}: must be in 1..65535")

        def echo_engine(spec):
            return ("started with", spec.settings)   # a real factory returns an EngineHandle

        register_engine("echo", echo_engine, settings=EchoSettings)
    """)
    cleanup.entries.append((ENGINES, "echo"))
    cleanup.modules.append("seam_engine")
    base = [f"plugins=[{path}]", "rollout.engine=echo"]
    cfg = load_config(None, [*base, "rollout.engine_settings={port: 9001}"])
    assert plugin_settings(cfg, "rollout.engine").port == 9001
    started = make_engine("echo", engine_spec(cfg, tmp_path, tokenizer=None))
    assert started[1] == plugin_settings(cfg, "rollout.engine") and started[1].verbose is False
    for raw, msg in [("{port: 0}", "rollout.engine_settings.port=0: must be in 1..65535"),
                     ("{prot: 1}", "rollout.engine_settings.prot=1: unknown setting of EchoSettings"),
                     ("{verbose: 3}", "rollout.engine_settings.verbose=3: must be a bool")]:
        with pytest.raises(ConfigError, match="^" + msg.replace(".", r"\.")):
            load_config(None, [*base, f"rollout.engine_settings={raw}"])


def test_a_learner_backend_from_a_plugin_file_gets_its_settings_and_capabilities(tmp_path, cleanup):
    from trainer.learner import LEARNERS, make_learner

    path = plugin(tmp_path, "seam_backend", """
        from dataclasses import dataclass
        from trainer.learner import register_learner

        @dataclass
        class LoraSettings:
            rank: int = 8
            alpha: float = 16.0

        def lora_factory(spec, model_dir):
            return ("lora learner", spec.settings, model_dir)

        register_learner("lora", lora_factory, settings=LoraSettings)
    """)
    cleanup.entries.append((LEARNERS, "lora"))
    cleanup.modules.append("seam_backend")
    base = [f"plugins=[{path}]", "learner.backend=lora"]
    cfg = load_config(None, [*base, "learner.backend_settings={rank: 4}"])
    built = make_learner(learner_spec(cfg), tmp_path)
    assert built[1].rank == 4 and built[1].alpha == 16.0 and built[2] == tmp_path
    assert dict(plugin_metadata(cfg, "learner.backend")) == {"distributed": False, "tensor_parallel": False,
                                                              "pipeline_parallel": False, "lora": False,
                                                              "truncated_sampling": True}
    with pytest.raises(ConfigError, match=r"^learner\.lora: learner\.backend='lora' does not train LoRA"):
        load_config(None, [*base, "learner.lora.rank=4"])  # lora=False: the capability is checked
    with pytest.raises(ConfigError, match=r"^learner\.backend_settings\.rank='x': must be an int$"):
        load_config(None, [*base, "learner.backend_settings={rank: x}"])
    with pytest.raises(ConfigError, match=r"^learner\.backend_settings\.world_size=2: unknown setting of "
                                          r"LoraSettings"):  # its settings: no rank layout
        load_config(None, [*base, "learner.backend_settings.world_size=2"])


def test_an_environment_and_a_task_from_a_plugin_file(tmp_path, cleanup):
    from trainer.tasks import TASKS, build_task

    rows, held = tmp_path / "rows.jsonl", tmp_path / "held.jsonl"
    rows.write_text("".join(json.dumps({"word": w}) + "\n" for w in ("hi", "yo", "ok")))
    held.write_text(json.dumps({"word": "no"}) + "\n")
    path = plugin(tmp_path, "seam_words", """
        from dataclasses import dataclass
        import environments
        from environments import ToolEnv
        from trainer.tasks import register_task
        from trainer.tasks.generic import GenericTask

        class EchoWords(ToolEnv):
            def __init__(self, greeting="say"):
                super().__init__([], invalid_action_reply=None)
                self.greeting = greeting

            def build_prompt(self, sample):
                return f"{self.greeting} {sample['word']}"

            def extract_answer(self, action):
                return action.strip()

            def score(self, sample, response, answer, tool_calls):
                return float(answer == sample["word"]), {}

        @dataclass
        class WordSettings:
            repeat: int = 1

            def __post_init__(self):
                if self.repeat < 1:
                    raise ValueError(f"repeat={self.repeat!r}: must be >= 1")

        class WordTask(GenericTask):
            settings_class = WordSettings

            def start(self):
                super().start()
                self.train_samples = self.train_samples * self.settings.repeat

        environments.register("echo_words", EchoWords)
        register_task("echo_words", WordTask)
    """)
    cleanup.entries += [(TASKS, "echo_words"), (environments.DEFAULT_REGISTRY, "echo_words")]
    cleanup.modules.append("seam_words")
    base = [f"plugins=[{path}]", "task.env=echo_words", f"task.train_data=[{rows}]",
            f"task.eval_data=[{held}]"]
    cfg = load_config(None, [*base, "task.settings={repeat: 2}", "task.env_kwargs={greeting: hey}"])
    assert plugin_settings(cfg, "task.env").repeat == 2
    with build_task(task_spec(cfg)) as task:
        assert type(task.settings).__name__ == "WordSettings" and task.settings.repeat == 2
        assert [r["word"] for r in task.train_samples] == ["hi", "yo", "ok"] * 2
        assert task.make_env().reset(options={"sample": {"word": "yo"}})[0] == "hey yo"
    with pytest.raises(ConfigError, match=r"^task\.settings\.repeat=0: must be >= 1$"):
        load_config(None, [*base, "task.settings={repeat: 0}"])
    with pytest.raises(ConfigError, match=r"^task\.env_kwargs\.shout: not a setting of env 'echo_words'"):
        build_task(task_spec(load_config(None, [*base, "task.env_kwargs={shout: true}"])))


def test_a_benchmark_kind_from_a_plugin_file_gets_its_settings(tmp_path, cleanup):
    from trainer.evaluate.kinds import BENCHMARK_KINDS, make_kind

    path = plugin(tmp_path, "seam_kind", """
        from dataclasses import dataclass
        from trainer.evaluate.kinds import BENCHMARK_KINDS, BenchmarkKind, KindSettings

        @dataclass(frozen=True)
        class ChoiceSettings(KindSettings):
            n_choices: int = 4

        class ChoiceKind(BenchmarkKind):
            row_fields = ("question", "choices", "answer")

        BENCHMARK_KINDS.register("choice", ChoiceKind, settings=ChoiceSettings)
    """)
    cleanup.entries.append((BENCHMARK_KINDS, "choice"))
    cleanup.modules.append("seam_kind")
    load_config(None, [f"plugins=[{path}]"])  # the config's plugins: list registers it
    kind = make_kind("choice", {"n_choices": 5, "default_k": 2})
    assert kind.name == "choice" and kind.settings.n_choices == 5 and kind.settings.default_k == 2
    assert kind.settings.default_temperature == 0.0  # the shared KindSettings default
    with pytest.raises(ValueError, match=r"^eval\.kind_settings\.choice\.n_choices='5': must be an int$"):
        make_kind("choice", {"n_choices": "5"})
