"""The YAML configs in configs/, config composition, dotted overrides, errors, and the CLI error path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import copc
from copc.presets import PRESET_NAMES
from environments.math_tool.data import load_math
from environments.math_tool.env import MathToolConfig, MathToolEnv
from environments.search.env import SearchConfig, load_qa
from trainer.app.cli_train import eval_command, train_command
from trainer.cli import build_parser
from trainer.cli import main as cli_main
from trainer.config import ConfigError, ExperimentConfig, load_config, plugin_settings, to_yaml
from trainer.config.train_section import PRESET_STALENESS
from trainer.engines import SGLangSettings

ROOT = Path(__file__).parent.resolve().parents[2]
CONFIGS = ROOT / "configs"
# experiment configs (configs/sweeps/ holds sweep specs, validated in test_sweep.py)
ALL_YAML = sorted(p.relative_to(CONFIGS).as_posix() for p in CONFIGS.rglob("*.yaml")
                  if p.parent.name != "sweeps")
TASK_STALENESS = {"math_tool": 8, "search": 14}
PLACEHOLDER = {"math_tool": "/path/to/Qwen3-4B-Instruct-ReTool-SFT",
               "search": "/path/to/Llama-3.2-3B-Instruct-SFT"}


def _is_paper(rel: str) -> bool:
    """Paper-scale configs carry a model.path placeholder the user fills in."""
    task, _, name = rel.partition("/")
    return task in TASK_STALENESS and name != "cpu_tiny.yaml"


#: Fragments that only compose after a config of some presets: the preset each is loaded with here.
FRAGMENT_PRESET = {"recipes/vapo_clip_higher.yaml": "ppo_async"}  # a PPO-clip loss's settings


def _load(rel: str, tmp_path: Path, *overrides: str) -> ExperimentConfig:
    extra = [f"model.path={tmp_path}"] if _is_paper(rel) else []
    extra += [f"preset={FRAGMENT_PRESET[rel]}"] if rel in FRAGMENT_PRESET else []
    return load_config(CONFIGS / rel, [*extra, *overrides])


def test_config_files_present():
    """One config per (task, preset), a CPU-tiny config per task (and each task's real-model job,
    ``cpu_smollm``), the shared pieces."""
    extra = {"search": {"cpu_smollm"}, "math_tool": {"cpu_smollm"}}
    for task in TASK_STALENESS:
        names = {p.stem for p in (CONFIGS / task).glob("*.yaml")}
        assert names == {*PRESET_NAMES, "cpu_tiny", "_paper", *extra.get(task, ())}, task
    assert len(PRESET_NAMES) == 10
    for rel in ("base.yaml", "tasks/math_tool.yaml", "tasks/search.yaml", "scale/paper.yaml",
                "scale/cpu_tiny.yaml", "scale/cpu_realmodel.yaml"):
        assert rel in ALL_YAML


@pytest.mark.parametrize("rel", ALL_YAML)
def test_every_config_loads_and_round_trips(rel, tmp_path):
    cfg = _load(rel, tmp_path)
    cfg.algorithm_config()  # the preset and its overrides validate too
    # the resolved YAML written next to a run loads back to the same config
    saved = tmp_path / "config.yaml"
    saved.write_text(to_yaml(cfg))
    assert load_config(saved) == cfg


@pytest.mark.parametrize("task", sorted(TASK_STALENESS))
@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_paper_preset_configs(task, preset, tmp_path):
    cfg = _load(f"{task}/{preset}.yaml", tmp_path)
    algo = cfg.algorithm_config()
    assert (cfg.preset, algo.name, cfg.task.env) == (preset, preset, task)
    assert cfg.name == f"{task}_{preset}"
    assert cfg.output_dir == f"runs/{task}_{preset}"  # base.yaml's runs/${name}
    assert cfg.max_staleness == (0 if preset == "ppo" else TASK_STALENESS[task])
    # paper settings: gamma = lambda = 1, eps_l = 0.4, eps_h = 0.56, eta_P = eta_A = 0.5 (w/o RC: eta_A = 0)
    assert (algo.gamma, algo.lam, algo.eps_low, algo.eps_high) == (1.0, 1.0, 0.4, 0.56)
    if algo.policy_loss == "dis":  # eta_P: the dis loss's own setting (DisSettings)
        assert algo.policy_loss_settings.eta_p == 0.5
    if algo.advantage_estimator == "copc":  # eta_A: the copc estimator's (CopcSettings)
        assert algo.estimator_settings.eta_a == (0.0 if preset == "copc_wo_rc" else 0.5)
    assert cfg.train.actor_lr == 1e-6
    assert cfg.rollout.engine == "sglang"
    assert cfg.rollout.max_new_tokens == 16384
    assert cfg.rollout.max_total_tokens >= 16384
    assert cfg.model.dtype == "bfloat16"
    assert not cfg.warm_start.enabled
    assert cfg.model.path == str(tmp_path)
    n = cfg.rollout.n_samples_per_prompt
    assert n >= 2 if preset == "dapo" else n == 1
    assert algo.use_critic == (preset not in ("sao", "dapo"))
    # the paper's horizons, and 8 GPUs: a Megatron learner on GPUs 0-3, SGLang replicas on 4-7
    assert cfg.train.total_steps == {"math_tool": 120, "search": 450}[task]
    lrn, r = plugin_settings(cfg, "learner.backend"), cfg.rollout  # the backend's own settings
    sizes = (lrn.world_size, lrn.tensor_parallel_size, lrn.pipeline_parallel_size)
    assert cfg.learner.backend == "megatron" and sizes == (4, 2, 1)
    sg = plugin_settings(cfg, "rollout.engine")  # SGLang's own settings (rollout.engine_settings)
    assert r.engine == "sglang" and isinstance(sg, SGLangSettings)
    assert sg.base_gpu_id == lrn.world_size and lrn.world_size + sg.tp * sg.dp == 8


@pytest.mark.parametrize("task", sorted(TASK_STALENESS))
def test_paper_configs_ask_for_the_model_path(task):
    """Without a real model.path the error names the key, the placeholder, and says to fill it in."""
    with pytest.raises(ConfigError) as ei:
        load_config(CONFIGS / task / "copc.yaml")
    msg = str(ei.value)
    assert msg.startswith("model.path=")
    assert PLACEHOLDER[task] in msg and "fill in" in msg


def test_paper_data_names_resolve(monkeypatch):
    monkeypatch.chdir(ROOT)  # empty task.data_dir: $COPC_DATA_DIR, else the repository's data/
    monkeypatch.delenv("COPC_DATA_DIR", raising=False)
    cfg = load_config(CONFIGS / "math_tool" / "_paper.yaml", ["model.path=."])
    assert cfg.task.train_data == ["math_train"] and cfg.task.eval_data == ["aime2025"]
    assert (cfg.eval.k, cfg.eval.num_samples) == (32, 30)  # avg@32 on AIME 2025's 30 problems
    assert cfg.task.data_dir == ""
    assert len(load_math("aime2025", data_dir=cfg.task.data_dir)) == 30
    assert load_math("math_train", data_dir=cfg.task.data_dir, limit=2)
    cfg = load_config(CONFIGS / "search" / "_paper.yaml", ["model.path=."])
    assert cfg.task.train_data == ["nq", "hotpotqa"]
    assert cfg.eval.temperature == 0.0 and cfg.eval.k == 1  # greedy exact match
    for name in cfg.task.eval_data:
        assert load_qa(name, data_dir=cfg.task.data_dir, limit=1), name


def test_cpu_tiny_math_is_the_main_job():
    cfg = load_config(CONFIGS / "math_tool" / "cpu_tiny.yaml")
    # asynchronous with exact staleness 2, whatever the machine's speed
    assert (cfg.preset, cfg.max_staleness, cfg.task.env) == ("copc", 2, "math_tool")
    assert cfg.train.staleness == {"mode": "fixed", "lag": 2}
    assert cfg.model.path == "" and cfg.rollout.engine == "embedded"
    assert cfg.warm_start.enabled and cfg.warm_start.kind == "retool_arithmetic"
    assert (cfg.train.prompts_per_step, cfg.train.total_steps, cfg.train.micro_batch_size) == (16, 30, 16)
    assert (cfg.rollout.max_new_tokens, cfg.rollout.max_turns) == (64, 3)
    assert 0 < cfg.task.settings["tool_use_fraction"] < 1 and cfg.task.settings["arithmetic_kinds"] == ["mul"]
    assert (cfg.eval.k, cfg.eval.temperature) == (4, 1.0)
    # the env kwargs are accepted by the real env (nested reward mapping included)
    env = MathToolEnv(**cfg.task.env_kwargs)
    assert env.config.reward.mode == "dapo_strict"
    env_cfg = env.config
    text = env_cfg.prompt_template.format(problem="1234*5678")
    assert text.endswith("Problem: 1234*5678\n")
    assert "\\boxed{}" in text and "<code>```python" in text
    assert len(text.encode()) < len(MathToolConfig().prompt_template.encode()) // 2


def test_cpu_tiny_search(monkeypatch):
    from trainer.tasks.search import corpus_path

    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("COPC_DATA_DIR", raising=False)
    cfg = load_config(CONFIGS / "search" / "cpu_tiny.yaml")
    assert (cfg.preset, cfg.max_staleness, cfg.task.env) == ("copc", 14, "search")
    assert cfg.task.train_data[:2] == ["nq", "hotpotqa"] and cfg.task.eval_data == ["nq", "hotpotqa"]
    assert cfg.model.tiny.tokenizer == "bpe" and cfg.task.settings["drill_steps"] > 0
    assert cfg.task.settings["retriever_url"] == ""  # copc train starts the retriever itself
    assert cfg.task.settings.get("retriever_corpus", "") == ""  # <data dir>/wiki/corpus.jsonl
    assert corpus_path(cfg.task.settings.get("retriever_corpus", ""), cfg.task.data_dir).is_file()
    assert cfg.warm_start.enabled and cfg.warm_start.kind == "search_r1"
    env_cfg = SearchConfig(**cfg.task.env_kwargs)
    assert env_cfg.topk == 1
    assert env_cfg.prompt_template.format(question="who?").endswith("Question: who?\n")
    for name in cfg.task.train_data + cfg.task.eval_data:
        assert load_qa(name, data_dir=cfg.task.data_dir, limit=1), name


def test_composition_of_the_repo_configs(tmp_path):
    """Values flow base -> task -> scale -> preset file; later files win."""
    tiny = load_config(CONFIGS / "math_tool" / "cpu_tiny.yaml")
    paper = _load("math_tool/copc.yaml", tmp_path)
    assert tiny.checkpoint.every_steps == 10 and paper.checkpoint.every_steps == 20  # scale overrides base
    assert paper.train.staleness == {"mode": "bounded", "max": 8}  # from tasks/math_tool.yaml
    assert tiny.train.staleness == {"mode": "fixed", "lag": 2}  # its own mode replaces the section
    assert tiny.train.actor_lr == 1e-4 and paper.train.actor_lr == 1e-6  # scale / task files
    assert tiny.train.critic_lr == 1e-3 and tiny.warm_start.batch_size == 16  # from scale/cpu_tiny.yaml
    dapo = _load("math_tool/dapo.yaml", tmp_path)
    assert (dapo.train.prompts_per_step, dapo.rollout.n_samples_per_prompt) == (32, 8)  # preset file wins
    assert dapo.train.actor_lr == 1e-6  # still inherited


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_composition_order(tmp_path):
    _write(tmp_path / "shared/base.yaml",
           "train:\n  total_steps: 7\n  seed: 3\n  staleness: {mode: bounded, max: 2}\n")
    _write(tmp_path / "shared/more.yaml", "train:\n  total_steps: 11\n  warmup_steps: 5\n")
    child = _write(tmp_path / "exp/child.yaml",
                   "defaults: [../shared/base.yaml, ../shared/more.yaml]\ntrain:\n  warmup_steps: 6\n")
    cfg = load_config(child)
    assert cfg.train.seed == 3  # only in the first default
    assert cfg.train.total_steps == 11  # second default overrides the first
    assert cfg.train.warmup_steps == 6  # the file's own keys override its defaults
    assert cfg.train.staleness == {"mode": "bounded", "max": 2}
    assert cfg.train.micro_batch_size == ExperimentConfig().train.micro_batch_size  # schema default
    cfg = load_config(child, ["train.total_steps=4"])
    assert cfg.train.total_steps == 4  # overrides come last


def test_composition_cycle(tmp_path):
    _write(tmp_path / "a.yaml", "defaults: [b.yaml]\n")
    _write(tmp_path / "b.yaml", "defaults: [a.yaml]\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(tmp_path / "a.yaml")


def test_dotted_overrides():
    path = CONFIGS / "math_tool" / "cpu_tiny.yaml"
    cfg = load_config(path, ["train.total_steps=3", "algorithm.estimator_settings.eta_a=0.25",
                             "model.tiny.hidden_size=64", "task.train_data=[nq,hotpotqa]", "name=smoke"])
    assert cfg.train.total_steps == 3
    algo = cfg.algorithm_config()
    assert algo.estimator_settings.eta_a == 0.25 and algo.policy_loss_settings.eta_p == 0.5
    assert cfg.model.tiny.hidden_size == 64
    assert cfg.task.train_data == ["nq", "hotpotqa"]
    assert cfg.output_dir == "runs/smoke"  # base.yaml's interpolation follows the name
    cfg = load_config(path, ["preset=ppo"])
    assert cfg.max_staleness == 0 and cfg.train.staleness["lag"] == 2  # the preset's own staleness wins
    cfg = load_config(path, ["preset=dapo", "rollout.n_samples_per_prompt=4"])
    assert cfg.algorithm_config().loss_agg_mode == "token-mean"


@pytest.mark.parametrize(("overrides", "needle"), [
    (["train.bogus=1"], "train.bogus"),                    # unknown key
    (["model.tiny.bogus=1"], "model.tiny.bogus"),          # unknown nested key
    (["train.total_steps=abc"], "train.total_steps"),      # wrong type
    (["rollout.temperature=hot"], "rollout.temperature"),  # wrong type
    (["preset=nope"], "preset"),                           # unknown preset
    (["train.total_steps=0"], "train.total_steps=0"),      # bad range
    (["train.staleness.max=-1"], "train.staleness.max=-1"),
    (["rollout.engine=tensorrt"], "rollout.engine='tensorrt'"),  # not a registered engine
    (["eval.temperature=-0.5"], "eval.temperature"),
    (["rollout.top_k=-5"], "rollout.top_k=-5: must be -1 or 0 (off) or a positive int"),
    (["algorithm.estimator_settings.eta_a=2"],
     "algorithm.estimator_settings.eta_a=2.0: must be a number in [0, 1]"),
    (["algorithm.eta_a=0.2"], "algorithm.eta_a: moved to algorithm.estimator_settings.eta_a "
                              "(with advantage_estimator: copc)"),
    (["preset=ppo_async", "algorithm.clip_high=0.28"],
     "algorithm.clip_high: moved to algorithm.policy_loss_settings.clip_high"),
    (["algorithm.bogus=1"], "bogus"),
    (["preset=ppo", "algorithm.max_staleness=3"], "algorithm.max_staleness: left the algorithm"),
    (["preset=dapo"], "rollout.n_samples_per_prompt"),     # groups needed
    (["preset=sao", "rollout.n_samples_per_prompt=4"], "rollout.n_samples_per_prompt=4"),  # single rollout
    (["preset=sao", "algorithm.n_samples_per_prompt=4"], "preset 'sao' is single-rollout"),
    (["train.total_steps"], "key=value"),                  # malformed override
])
def test_errors_name_the_key(overrides, needle):
    with pytest.raises(ConfigError) as ei:
        load_config(CONFIGS / "math_tool" / "cpu_tiny.yaml", overrides)
    assert needle in str(ei.value)
    if overrides == ["preset=nope"]:
        assert "'nope'" in str(ei.value) and "copc" in str(ei.value)  # lists what is available


def test_errors_in_yaml_files(tmp_path):
    with pytest.raises(ConfigError, match=r"train\.bogus"):
        load_config(_write(tmp_path / "a.yaml", f"defaults: [{CONFIGS / 'base.yaml'}]\ntrain:\n  bogus: 1\n"))
    with pytest.raises(ConfigError, match=r"rollout\.max_turns"):
        load_config(_write(tmp_path / "b.yaml", "rollout:\n  max_turns: [1, 2]\n"))
    with pytest.raises(ConfigError, match="not found"):
        load_config(_write(tmp_path / "c.yaml", "defaults: [missing.yaml]\n"))
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "absent.yaml")


def test_cli_parses_train_and_eval():
    argv = ["train", "--config", "configs/math_tool/cpu_tiny.yaml", "train.total_steps=3", "preset=ppo",
            "--resume"]
    args = build_parser(argv).parse_args(argv)
    assert (args.config, args.overrides, args.resume) == (argv[2], argv[3:5], True)
    assert args.func is train_command
    argv = ["train", "--config", "x.yaml"]
    args = build_parser(argv).parse_args(argv)
    assert (args.overrides, args.resume) == ([], False)
    argv = ["eval", "--config", "x.yaml", "--checkpoint", "runs/x/checkpoints/step_3", "eval.k=4"]
    args = build_parser(argv).parse_args(argv)
    assert (args.checkpoint, args.overrides, args.func) == (argv[4], ["eval.k=4"], eval_command)


def _copc(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "trainer.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def _assert_one_line_error(rc: int, stderr: str, group: str, needle: str) -> None:
    assert rc == 2, stderr
    assert needle in stderr
    assert "Traceback" not in stderr
    assert len(stderr.strip().splitlines()) == 1  # one clear line
    assert stderr.startswith(f"copc {group}: config error: ")


def test_cli_config_error_exits_2_subprocess():
    """The real console entry point: exit status 2, the key on stderr, no traceback."""
    res = _copc("train", "--config", "configs/math_tool/cpu_tiny.yaml", "train.bogus=1", "--resume")
    _assert_one_line_error(res.returncode, res.stderr, "train", "train.bogus")
    res = _copc("eval", "--config", "configs/search/copc.yaml")
    _assert_one_line_error(res.returncode, res.stderr, "eval", "model.path")


@pytest.mark.parametrize(("args", "needle"), [
    (["train", "--config", "configs/search/copc.yaml", "model.path=.", "train.actor_lr=0"], "train.actor_lr"),
    (["eval", "--config", "configs/math_tool/cpu_tiny.yaml", "preset=nope"], "preset"),
    (["train", "--config", "configs/no_such.yaml"], "not found"),
    (["train", "--config", "configs/math_tool/cpu_tiny.yaml", "preset=brace",
      "algorithm.estimator_settings.horizon=0"], "algorithm.estimator_settings: horizon must be an int >= 1"),
])
def test_cli_config_errors_in_process(args, needle, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    rc = cli_main(args)
    _assert_one_line_error(rc, capsys.readouterr().err, args[0], needle)


def test_an_override_yaml_cannot_parse_names_its_key(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    rc = cli_main(["train", "--config", "configs/math_tool/cpu_tiny.yaml", "train.total_steps={"])
    _assert_one_line_error(rc, capsys.readouterr().err, "train",
                           "train.total_steps='{': not a valid YAML value")


def _mc(x: copc.AdvantageInputs, cfg: copc.AlgorithmConfig) -> tuple[torch.Tensor, torch.Tensor]:
    return x.rewards, x.rewards


def _reinforce(logp: torch.Tensor, x: copc.PolicyLossInputs, cfg: copc.AlgorithmConfig):
    return -(logp * x.advantages).sum(), {}


@pytest.fixture
def custom_algorithms():
    """A user's estimators/loss, registered before loading the config; removed afterwards."""
    copc.ADVANTAGE_ESTIMATORS.register("my_mc", needs_critic=False)(_mc)
    copc.ADVANTAGE_ESTIMATORS.register("my_grouped", needs_critic=False, needs_groups=True)(_mc)
    copc.POLICY_LOSSES.register("my_reinforce")(_reinforce)
    try:
        yield
    finally:
        copc.ADVANTAGE_ESTIMATORS.unregister("my_mc")
        copc.ADVANTAGE_ESTIMATORS.unregister("my_grouped")
        copc.POLICY_LOSSES.unregister("my_reinforce")


def test_registered_custom_estimator_and_loss_load(custom_algorithms):
    cfg = load_config(None, ["algorithm.advantage_estimator=my_mc", "algorithm.use_critic=false",
                             "algorithm.policy_loss=my_reinforce"])
    algo = cfg.algorithm_config()
    assert (cfg.preset, algo.advantage_estimator, algo.policy_loss, algo.use_critic) == \
        ("copc", "my_mc", "my_reinforce", False)
    assert copc.ADVANTAGE_ESTIMATORS.get(algo.advantage_estimator) is _mc
    rewards = torch.tensor([[0.0, 1.0]])
    adv, _ = copc.compute_advantages(copc.AdvantageInputs(rewards=rewards, loss_mask=rewards >= 0), algo)
    assert adv.tolist() == [[0.0, 1.0]]


def test_custom_estimator_errors_name_the_key(custom_algorithms):
    with pytest.raises(ConfigError) as ei:
        load_config(None, ["algorithm.advantage_estimator=my_mc"])  # copc's use_critic=True
    assert str(ei.value).startswith("algorithm.use_critic: use_critic=True with advantage_estimator='my_mc'")
    with pytest.raises(ConfigError) as ei:
        load_config(None, ["algorithm.advantage_estimator=my_grouped", "algorithm.use_critic=false"])
    assert str(ei.value).startswith("rollout.n_samples_per_prompt=1: advantage estimator 'my_grouped'")
    assert "needs >= 2" in str(ei.value)
    cfg = load_config(None, ["algorithm.advantage_estimator=my_grouped", "algorithm.use_critic=false",
                             "rollout.n_samples_per_prompt=2"])
    assert cfg.algorithm_config().advantage_estimator == "my_grouped"


def test_unregistered_names_list_the_registered():
    with pytest.raises(ConfigError) as ei:
        load_config(None, ["algorithm.advantage_estimator=my_mc", "algorithm.use_critic=false"])
    msg = str(ei.value)
    assert msg.startswith("algorithm.advantage_estimator: ")
    assert "['batch_norm', 'brace', 'copc', 'gae', 'grpo', 'vtrace'], got 'my_mc'" in msg
    with pytest.raises(ConfigError) as ei:
        load_config(None, ["algorithm.policy_loss=my_reinforce"])
    msg = str(ei.value)
    assert msg.startswith("algorithm.policy_loss: ")
    assert "['decoupled_ppo', 'dis', 'icepop', 'ppo', 'tis'], got 'my_reinforce'" in msg


def test_sao_single_rollout():
    cfg = load_config(None, ["preset=sao"])
    assert cfg.rollout.n_samples_per_prompt == 1 and cfg.algorithm_config().n_samples_per_prompt == 1
    with pytest.raises(ConfigError) as ei:
        load_config(None, ["preset=sao", "rollout.n_samples_per_prompt=2"])
    assert str(ei.value).startswith("rollout.n_samples_per_prompt=2: preset 'sao' is defined for exactly 1")


def test_max_staleness_is_resolved_once():
    """ExperimentConfig.max_staleness: the preset's own (the trainer's PRESET_STALENESS) if it has
    one, else train's."""
    assert load_config(None, ["train.staleness.max=5"]).max_staleness == 5
    assert load_config(None, ["train.staleness.max=5", "preset=ppo"]).max_staleness == 0
    assert PRESET_STALENESS == {"ppo": 0}


def test_a_config_error_found_once_the_tokenizer_is_loaded_is_one_line(capsys, monkeypatch, tmp_path):
    """Issue 21 item 17: ``rollout.use_chat_template: true`` with the tiny model's tokenizer (no
    chat template) is refused like a load-time error: exit 2, one line naming the key."""
    monkeypatch.chdir(ROOT)
    rc = cli_main(["train", "--config", "configs/math_tool/cpu_tiny.yaml", f"output_dir={tmp_path / 'run'}",
                   "rollout.use_chat_template=true", "warm_start.enabled=false", "logging.progress=false"])
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]  # above it only the tiny model's "Writing model shards" bar
    assert rc == 2 and "Traceback" not in err, err
    assert last.startswith("copc train: config error: rollout.use_chat_template=true: the tokenizer "), last
    assert "tokenizer has no chat_template (of " in last and last.count("init_model") == 1


def test_copc_train_refuses_a_run_directory_another_process_writes(capsys, monkeypatch, tmp_path):
    """Issue 21 item 12: a second writer of ``output_dir`` (a real second process holds its lock)
    exits 2 naming the directory and the holder's pid."""
    import subprocess
    import sys

    monkeypatch.chdir(ROOT)
    out = tmp_path / "run"
    code = ("import time\nfrom trainer.outputs.lock import lock_output_dir\n"
            f"held = lock_output_dir({str(out)!r})\nprint('held', flush=True)\ntime.sleep(120)")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        rc = cli_main(["train", "--config", "configs/math_tool/cpu_tiny.yaml", f"output_dir={out}"])
        needle = f"output_dir={str(out)!r}: another copc process (pid {holder.pid}) is writing there"
        _assert_one_line_error(rc, capsys.readouterr().err, "train", needle)
    finally:
        holder.kill()
        holder.wait()
    assert not (out / "config.yaml").exists()


@pytest.mark.parametrize(("override", "message"), [
    ("train.seed=-3", "train.seed=-3: must be an int in [0, 2**32 - 1]"),
    ("train.seed=4294967296", "train.seed=4294967296: must be an int in [0, 2**32 - 1]"),
    ("train.actor_lr=.inf", "train.actor_lr=inf: must be a finite number > 0"),
    ("train.critic_lr=.nan", "train.critic_lr=nan: must be a finite number > 0"),
])
def test_seed_and_learning_rates_out_of_range_are_one_line_exit_2(override, message, capsys, tmp_path):
    """A reviewer's finding (issue 21 item 17): these reached numpy / the optimizer as tracebacks."""
    rc = cli_main(["train", "--config", "configs/math_tool/cpu_tiny.yaml", override,
                   f"output_dir={tmp_path}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and message in err[0], err


def test_a_list_where_a_mapping_goes_is_one_line_naming_the_key_or_file(tmp_path):
    """``task.settings=[1]`` (a list over the mapping) was a bare omegaconf TypeError traceback."""
    with pytest.raises(ConfigError) as ei:
        load_config(str(CONFIGS / "math_tool" / "cpu_tiny.yaml"), ["task.settings=[1]"])
    assert str(ei.value) == ("task.settings=[1]: Cannot merge incompatible container types: a mapping "
                             "(e.g. task.settings, launcher.settings) takes key: value entries, a list "
                             "takes a list")
    layer = tmp_path / "bad.yaml"
    layer.write_text(f"defaults: [{CONFIGS / 'math_tool' / 'cpu_tiny.yaml'}]\nlauncher:\n  settings: [1]\n")
    with pytest.raises(ConfigError, match=rf"^{layer}: Cannot merge incompatible container types"):
        load_config(str(layer), [])
    with pytest.raises(ConfigError, match=r"^train\.max_staleness=3: replaced by the train\.staleness "):
        load_config(str(CONFIGS / "math_tool" / "cpu_tiny.yaml"), ["train.max_staleness=3"])  # unchanged
