"""The sections of :class:`trainer.config.ExperimentConfig`: typed dataclasses, each with a
``validate()`` that raises :class:`~trainer.errors.ConfigError` naming the offending key.

Import them from :mod:`trainer.config` (re-exported there).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from ..models.pull.store import resolve_model_path

#: Keys that moved into a plug-in's own settings: old dotted key → its new spelling. A config
#: (YAML or override) that still sets one is refused with one line naming both (:func:`moved_key_hint`).
MOVED_KEYS: dict[str, str] = {
    "rollout.sglang_port": "rollout.engine_settings.port (with rollout.engine: sglang)",
    "rollout.sglang_tp": "rollout.engine_settings.tp (with rollout.engine: sglang)",
    "rollout.sglang_dp": "rollout.engine_settings.dp (with rollout.engine: sglang)",
    "rollout.sglang_base_gpu_id": "rollout.engine_settings.base_gpu_id (with rollout.engine: sglang)",
    "rollout.sglang_mem_fraction": "rollout.engine_settings.mem_fraction (with rollout.engine: sglang)",
    "model.gradient_checkpointing": "learner.backend_settings.gradient_checkpointing",
    # the learner backends' own settings (trainer.learner.backend_settings: TorchSettings,
    # DistributedSettings)
    **{f"learner.{k}": f"learner.backend_settings.{k} (with learner.backend: {b})" for k, b in (
        ("world_size", "fsdp or megatron"), ("tensor_parallel_size", "megatron"),
        ("pipeline_parallel_size", "fsdp or megatron"), ("launch", "fsdp or megatron"),
        ("dist_backend", "fsdp or megatron"), ("cpu_offload", "fsdp"), ("timeout_s", "fsdp or megatron"),
        ("gradient_checkpointing", "torch, fsdp or megatron"), ("logprob_chunk_tokens", "torch or fsdp"),
        ("autocast_dtype", "torch"), ("shared_prefix_tokens", "torch"),
        ("critic_freeze_attention", "torch"))},
    # the ray launcher's own settings (trainer.orchestration.launchers.RayLauncherSettings)
    "launcher.ray_address": "launcher.settings.address (with launcher.kind: ray; for learner ranks started "
                            "by Ray: learner.backend_settings.ray_address)",
    "launcher.ray_num_cpus": "launcher.settings.num_cpus (with launcher.kind: ray; for learner ranks started "
                             "by Ray: learner.backend_settings.ray_num_cpus)",
    "launcher.num_rollout_workers": "launcher.settings.num_rollout_workers (with launcher.kind: ray)",
}
#: Keys that were removed: old dotted key → why (a config that sets one is refused).
REMOVED_KEYS: dict[str, str] = {
    "model.critic_path": "removed: it was never read (the critic starts from the actor's weights plus a "
                         "fresh value head)",
}


def require(cond: bool, key: str, value: Any, why: str) -> None:
    """The config sections' check: unless ``cond``, raise one line naming the key and the value.

    Raises:
        ConfigError: ``"<key>=<value!r>: <why>"``.
    """
    if not cond:
        raise ConfigError(f"{key}={value!r}: {why}")


#: Keys that moved out of this schema into a task's own settings (``task.settings``, checked by the
#: task's settings dataclass: :mod:`trainer.tasks.settings`), old spelling -> task ids. Only for the
#: one-line refusal of an old spelling (:func:`moved_key_hint`); the schema itself names none.
MOVED_TO_TASK_SETTINGS: dict[str, tuple[str, ...]] = {
    "task.arithmetic_kinds": ("math_tool",),
    "task.held_out_every": ("search",),
    "warm_start.tool_use_fraction": ("math_tool", "search"),
    **{f"warm_start.{k}": ("search",) for k in ("second_search_fraction", "keep_misses", "drill_steps",
                                                "drill_batch_size", "drill_lr", "reading_drill_fraction")},
    **{f"task.{k}": ("search",) for k in ("retriever_url", "retriever_index_dir", "retriever_corpus")},
}


def moved_key_hint(key: str | None) -> str | None:
    """The one-line refusal of a key that moved into a plug-in's settings (:data:`MOVED_KEYS`,
    :data:`MOVED_TO_TASK_SETTINGS`) or was removed (:data:`REMOVED_KEYS`), or None for any other key.

    Example: ``"warm_start.keep_misses"`` -> ``"warm_start.keep_misses: moved to
    task.settings.keep_misses (a setting of the task 'search')"``.
    """
    if key in MOVED_KEYS:
        return f"{key}: moved to {MOVED_KEYS[key]}"
    if key in REMOVED_KEYS:
        return f"{key}: {REMOVED_KEYS[key]}"
    tasks = MOVED_TO_TASK_SETTINGS.get(key or "")
    if not tasks:
        return None
    name = str(key).rpartition(".")[2]
    return (f"{key}: moved to task.settings.{name} (a setting of the task "
            f"{' / '.join(repr(t) for t in tasks)}; write task: {{settings: {{{name}: ...}}}})")


@dataclass
class TinyModelSpec:
    """Tiny offline model built from scratch when ``model.path`` is empty (see trainer.models.tiny).

    Attributes:
        arch .. seed: the model's size (:class:`trainer.models.tiny.TinyModelConfig`).
        tokenizer: ``byte`` (one token per UTF-8 byte: :func:`trainer.models.tiny.build_byte_tokenizer`)
            or ``bpe`` (a byte-level BPE trained at start-up on the task's text with its tool tags
            as single tokens: :func:`trainer.models.bpe.train_bpe_tokenizer`).
        vocab_size: BPE vocabulary in tokens (``tokenizer: bpe`` only), >= 512.
    """

    arch: str = "qwen2"
    hidden_size: int = 128
    intermediate_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    max_position_embeddings: int = 2048
    seed: int = 0
    tokenizer: str = "byte"
    vocab_size: int = 8192


@dataclass
class ModelConfig:
    """Policy (actor) and critic models.

    Attributes:
        path: local checkpoint directory (``save_pretrained`` layout, e.g. Qwen3-4B), or the name of
            a pulled model (``smollm2-135m-instruct``: ``copc model pull NAME``), which
            :meth:`validate` replaces by its directory; empty: build the tiny model described by
            ``tiny``.
        dtype: ``float32`` | ``bfloat16`` (parameters).
        attn_implementation: ``eager`` | ``sdpa`` | ``flash_attention_2``.
    """

    path: str = ""
    tiny: TinyModelSpec = field(default_factory=TinyModelSpec)
    dtype: str = "float32"
    attn_implementation: str = "eager"

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the key on a bad value; resolve ``path``
        (:func:`trainer.models.pull.resolve_model_path`: a directory, or a pulled model's name)."""
        require(self.dtype in ("float32", "bfloat16", "float16"), "model.dtype", self.dtype,
                 "must be float32, bfloat16 or float16")
        require(self.tiny.tokenizer in ("byte", "bpe"), "model.tiny.tokenizer", self.tiny.tokenizer,
                 "must be 'byte' or 'bpe'")
        require(isinstance(self.tiny.vocab_size, int) and not isinstance(self.tiny.vocab_size, bool)
                 and self.tiny.vocab_size >= 512, "model.tiny.vocab_size", self.tiny.vocab_size,
                 "must be an int >= 512 (256 byte tokens, special tokens, merges)")
        # a pulled model's name becomes its directory; a pulled directory is checked against its manifest
        self.path = resolve_model_path(self.path, "model.path",
                                       or_else=", or leave it empty for the tiny model")


@dataclass
class TaskConfig:
    """Environment and data.

    Attributes:
        env: registered environment id (``math_tool``, ``search`` or a user's), or
            ``pkg.module:id`` / ``path/file.py:id`` (imported first, so it can register ``id``).
        env_kwargs: keyword overrides for ``environments.make`` (e.g. ``prompt_template``).
        train_data: dataset names/paths the env understands (e.g. ``[math_train]`` or
            ``[nq, hotpotqa]``), read from ``data_dir``; empty: generated problems (math_tool;
            other environments need JSONL files here).
        eval_data: held-out dataset(s) for evaluation.
        data_dir: data directory; empty: ``$COPC_DATA_DIR``, else the repository's ``data/``. Relative
            paths (here and in the other path keys) resolve against the current working directory.
        max_train_samples / max_eval_samples: caps (0 = all).
        settings: the task's own knobs, checked by the task's settings dataclass when the task
            is built (:mod:`trainer.tasks.settings`; ``math_tool``:
            :class:`~trainer.tasks.math_tool.settings.MathToolSettings`, ``search``:
            :class:`~trainer.tasks.search.settings.SearchSettings`), e.g.
            ``{arithmetic_kinds: [mul], tool_use_fraction: 0.6}``.
    """

    env: str = "math_tool"
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    train_data: list[str] = field(default_factory=list)
    eval_data: list[str] = field(default_factory=list)
    data_dir: str = ""
    max_train_samples: int = 0
    max_eval_samples: int = 0
    settings: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the key on a bad value."""
        require(bool(self.env), "task.env", self.env, "must name a registered environment")
        require(self.max_train_samples >= 0, "task.max_train_samples", self.max_train_samples, ">= 0")
        require(self.max_eval_samples >= 0, "task.max_eval_samples", self.max_eval_samples, ">= 0")


@dataclass
class RolloutConfig:
    """Rollout engine, sampling and per-episode budgets.

    Attributes:
        engine: a registered engine (:mod:`trainer.engines.registry`): ``embedded``
            (in-process, CPU default) | ``sglang`` (GPU server) | a user's.
        temperature, top_p, top_k: sampling (the learner uses the same three: its log-probs replay
            the sampler's top-k / top-p support, :mod:`trainer.logprobs`).
        max_new_tokens: tokens per model turn.
        n_samples_per_prompt: episodes per prompt: >= 2 when the advantage estimator
            ``needs_groups`` (registry metadata; ``grpo``/``dapo``), and equal to the algorithm's
            own ``n_samples_per_prompt`` when it fixes one (``sao``: 1).
        concurrency: episodes in flight at once.
        max_total_tokens, max_turns, max_observation_tokens: episode budgets (tokens / turns).
        engine_max_batch_size: embedded engine batch size (sequences).
        engine_settings: the engine's own settings, validated by the settings dataclass it was
            registered with (``sglang``: :class:`~trainer.engines.builtin.SGLangSettings`,
            ``{port, tp, dp, base_gpu_id, mem_fraction}``); empty: its defaults.
        use_chat_template: wrap prompts with the tokenizer's chat template (real instruct
            models; the tiny byte-level models have none).
        system_prompt: with ``use_chat_template``, a ``system`` message before each prompt.
        observation_role: with ``use_chat_template``, ``""`` puts a tag-format environment's
            replies inline in the model's turn; ``user`` / ``tool`` makes each a chat turn of that
            role (:class:`~trainer.rollout.agent_loop.AgentLoopConfig`).
        stop: extra stop strings ending every model turn, after the environment's own (a
            few-shot prompt's example separator, e.g. ``["\nProblem:"]``).
    """

    engine: str = "embedded"
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 256
    n_samples_per_prompt: int = 1
    concurrency: int = 32
    max_total_tokens: int = 4096
    max_turns: int = 8
    max_observation_tokens: int = 1024
    engine_max_batch_size: int = 32
    engine_settings: dict[str, Any] = field(default_factory=dict)
    use_chat_template: bool = False
    system_prompt: str = ""
    observation_role: str = ""
    stop: list[str] = field(default_factory=list)

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the key on a bad value."""
        require(isinstance(self.stop, list) and all(isinstance(x, str) and x for x in self.stop),
                 "rollout.stop", self.stop, "must be a list of non-empty strings")
        require(self.observation_role in ("", "user", "tool"), "rollout.observation_role",
                 self.observation_role, "must be '' (inline), 'user' or 'tool'")
        for k in ("system_prompt", "observation_role"):
            require(self.use_chat_template or not getattr(self, k), f"rollout.{k}", getattr(self, k),
                     "needs rollout.use_chat_template=true (it is a chat-template turn)")
        require(self.temperature > 0, "rollout.temperature", self.temperature, "must be > 0")
        require(0 < self.top_p <= 1, "rollout.top_p", self.top_p, "must be in (0, 1]")
        require(isinstance(self.top_k, int) and not isinstance(self.top_k, bool) and self.top_k >= -1,
                "rollout.top_k", self.top_k, "must be -1 or 0 (off) or a positive int")
        for k in ("max_new_tokens", "n_samples_per_prompt", "concurrency", "max_total_tokens",
                  "max_turns", "max_observation_tokens", "engine_max_batch_size"):
            require(getattr(self, k) >= 1, f"rollout.{k}", getattr(self, k), "must be >= 1")


@dataclass
class WarmStartConfig:
    """Supervised warm-start on generated traces before RL (ReTool's cold-start idea).

    Attributes:
        enabled: run it (skipped when ``model.path`` is a real, already fine-tuned model).
        kind: a warm-start kind the task supports (``retool_arithmetic`` for math_tool,
            ``search_r1`` for search; checked by the task's ``check_warm_start``).
        num_examples: generated traces. steps: optimizer steps. batch_size: sequences per step.
        micro_batch_size: sequences per forward/backward, their gradients accumulated into the
            step's (the loss stays the mean over the whole batch's action tokens); 0 (default): the
            whole batch in one forward. Bounds the warm-start's peak memory, which is checked
            before its first step (``learner.memory_check``).
        lr: learning rate. seed: generator seed.
        schedule: ``cosine`` (warm-up then decay to 0.1 lr) or ``constant`` (after 20 warm-up steps).
            The task's own warm-start knobs (share of traces using the tool, copy drills, ...) are
            its settings (``task.settings``).
        cache_dir: share warm-starts between runs: the result is kept in ``cache_dir/<key>``, the
            key a hash of every setting it depends on (model, task, rollout budgets, this section,
            ``train.seed``); a run with the same key copies it instead of training (``copc sweep``
            sets it for its cells). Empty: no sharing.
    """

    enabled: bool = False
    kind: str = "retool_arithmetic"
    num_examples: int = 2000
    steps: int = 300
    batch_size: int = 16
    micro_batch_size: int = 0
    lr: float = 1e-3
    seed: int = 0
    schedule: str = "cosine"
    cache_dir: str = ""

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the key on a bad value."""
        require(self.schedule in ("cosine", "constant"), "warm_start.schedule", self.schedule,
                 "must be 'cosine' or 'constant'")
        require(isinstance(self.kind, str) and bool(self.kind), "warm_start.kind", self.kind,
                 "must be a non-empty string (the task checks it supports it)")
        for k in ("num_examples", "steps", "batch_size"):
            require(getattr(self, k) >= 1, f"warm_start.{k}", getattr(self, k), "must be >= 1")
        require(self.lr > 0, "warm_start.lr", self.lr, "must be > 0")
        require(0 <= self.micro_batch_size <= self.batch_size, "warm_start.micro_batch_size",
                self.micro_batch_size, f"must be in [0, batch_size={self.batch_size}] (0: the whole batch)")


@dataclass
class EvalConfig:
    """Held-out evaluation (greedy by default) before and after RL.

    Attributes:
        enabled: run it. num_samples: held-out problems. temperature: 0 = greedy.
        k: samples per problem for avg@k (1 with greedy).
        every_steps: also evaluate the held-out set every this many RL steps, on that step's
            policy version, between two batches (rollouts keep running; the learner waits), logged
            in that step's ``metrics.jsonl`` row as ``eval/*`` with ``eval/policy_version``; a
            failure is logged (``eval/failed``), not fatal. 0 (default): before and after RL only.
        kind_settings: ``copc eval --benchmarks``: per benchmark kind, settings overriding its
            settings dataclass's defaults (``{mcq: {letters: ABCDE}}``; validated by the kind,
            :func:`trainer.evaluate.kinds.make_kind`, when the benchmarks are resolved).
    """

    enabled: bool = True
    num_samples: int = 64
    temperature: float = 0.0
    k: int = 1
    every_steps: int = 0
    kind_settings: dict[str, dict[str, Any]] = field(default_factory=dict)

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the key on a bad value."""
        require(self.num_samples >= 1, "eval.num_samples", self.num_samples, "must be >= 1")
        require(self.temperature >= 0, "eval.temperature", self.temperature, "must be >= 0")
        require(self.k >= 1, "eval.k", self.k, "must be >= 1")
        require(isinstance(self.every_steps, int) and not isinstance(self.every_steps, bool)
                 and self.every_steps >= 0, "eval.every_steps", self.every_steps,
                 "must be an int >= 0 (0: off)")
        for kind, settings in self.kind_settings.items():
            require(isinstance(settings, dict), f"eval.kind_settings.{kind}", settings,
                     "must be a mapping of the kind's settings")


@dataclass
class CheckpointConfig:
    """Checkpoints: every ``every_steps`` steps into ``<output_dir>/checkpoints``, keep ``keep_last``."""

    every_steps: int = 10
    keep_last: int = 2

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the key on a bad value."""
        require(self.every_steps >= 1, "checkpoint.every_steps", self.every_steps, "must be >= 1")
        require(self.keep_last >= 1, "checkpoint.keep_last", self.keep_last, "must be >= 1")


@dataclass
class LoggingConfig:
    """Metrics JSONL (always), TensorBoard, end-of-run PNG plots, live progress bar, and the
    per-step training samples that ``copc view`` shows.

    Attributes:
        samples_per_step: trained episodes per step written with their per-token tensors (loss
            mask, advantage, ratio ρ = π_old/µ, the channels' intervals) to
            ``samples/step_N.jsonl`` in the run directory (:mod:`trainer.outputs.viewer.samples`);
            0: none.
        samples_max_bytes: the most bytes one step's sample file may hold (episodes beyond it
            are left out; one episode larger than it is cut to its first tokens).
    """

    tensorboard: bool = True
    plots: bool = True
    progress: bool = True
    samples_per_step: int = 4
    samples_max_bytes: int = 262144

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the key on a bad value."""
        require(self.samples_per_step >= 0, "logging.samples_per_step", self.samples_per_step,
                 "must be >= 0")
        require(self.samples_max_bytes >= 4096, "logging.samples_max_bytes", self.samples_max_bytes,
                 "must be >= 4096")


@dataclass
class LauncherConfig:
    """Where rollouts and the learner run: a registered launcher (:mod:`trainer.orchestration.launchers`).

    Attributes:
        kind: ``local`` (one process, threads/asyncio) | ``ray`` (rollout workers + learner as Ray
            actors) | a user's (registered in ``LAUNCHERS`` by a plugin); checked, with
            ``settings``, at load by :func:`trainer.config.check_plugins` (a seam).
        settings: the launcher's own settings (its registered dataclass's fields; ``local`` takes
            none, ``ray``: :class:`~trainer.orchestration.launchers.RayLauncherSettings`,
            ``{address, num_cpus, num_rollout_workers}``).
    """

    kind: str = "local"
    settings: dict[str, Any] = field(default_factory=dict)
