"""Every compatibility shim the Megatron backend needs, in one place (measured in
``/work/shared/docs/megatron_cpu.md``; written against megatron-core 0.16.1 and mbridge 0.15.1,
asserted by :func:`check_versions`).

Three kinds, kept apart:

* **CPU shims** (:func:`apply_cpu_shims`): stand-ins for CUDA-only calls. Applied only in a
  process where ``torch.cuda.is_available()`` is False (a gloo rank), never on the GPU path;
  idempotent. Each replaced upstream function is named in a comment.
* **Checkpoint shim** (:func:`apply_checkpoint_shims`, every path): Megatron's checkpoint writer
  keeps a ``multiprocessing`` Manager *server process* per rank, which outlives a killed rank
  (and holds its parent's stdout open); our saves are synchronous, so an in-process queue does.
* **Bridge shims** (:func:`prepare_bridge`, :func:`hf_config_for_mbridge`,
  :func:`instantiate_model`): per-object adjustments of an mbridge ``Bridge`` (no global state).

Not shims but part of the same story: the explicit ``[b, 1, s, s]`` attention mask
(:func:`trainer.learner.backends.megatron.logprobs.attention_mask`; Megatron's default causal mask is
built on ``device="cuda"``), and the optimizer choice (torch AdamW/SGD over Megatron DDP's
``main_grad`` on CPU, :mod:`trainer.learner.backends.megatron.optim`; ``get_megatron_optimizer`` and
Megatron's gradient clipping allocate on ``device="cuda"``).
"""

from __future__ import annotations

import copy
import os
import queue
from importlib import metadata
from typing import Any

import torch

from ....errors import ConfigError

#: The versions the shims were written and tested against.
PINNED_VERSIONS = {"megatron-core": "0.16.1", "mbridge": "0.15.1"}


class MegatronVersionError(RuntimeError):
    """Installed megatron-core / mbridge differ from :data:`PINNED_VERSIONS`."""


def check_versions(pinned: dict[str, str] | None = None) -> None:
    """Assert the pinned megatron-core and mbridge versions.

    Args:
        pinned: ``{distribution: version}`` (default :data:`PINNED_VERSIONS`).

    Raises:
        MegatronVersionError: a package is missing or at another version (the message names
            both versions and the install command).
    """
    for pkg, want in (pinned or PINNED_VERSIONS).items():
        try:
            have = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            have = "not installed"
        if have != want:
            raise MegatronVersionError(
                f"learner.backend=megatron needs {pkg}=={want} (its compatibility shims are written against "
                f"it), found {have}; install the extra: pip install -e '.[megatron]'")


def cuda_available() -> bool:
    """Whether this process runs the GPU path (no CPU shim is applied then)."""
    return torch.cuda.is_available()


def _cpu_device(*_args: Any, **_kwargs: Any) -> torch.device:
    return torch.device("cpu")


def _no_sync(*_args: Any, **_kwargs: Any) -> None:
    return None


def _no_cuda_rng_state(*_args: Any, **_kwargs: Any) -> None:
    return None


def apply_cpu_shims() -> bool:
    """Make Megatron-core run on CPU with gloo; a no-op (returns False) when CUDA is available.

    Idempotent (a second call changes nothing). Applied in the rank process only, before any
    model is built. The shims:

    * ``torch.cuda.current_device`` → the CPU device. Upstream callers: the rotary embedding
      (``RotaryEmbedding.get_emb``/``forward``), ``GlobalMemoryBuffer.get_tensor`` (attention
      scores), ``tensor_parallel.mappings._gather_along_last_dim`` and the other TP gathers,
      the DDP grad buffers (``_ParamAndGradBuffer``) and the dist_checkpointing savers.
    * ``torch.cuda.synchronize`` → no-op. Upstream: ``FileSystemWriterAsync.write_buckets``
      (``dist_checkpointing.strategies.filesystem_async``), called by every save.
    * the CUDA RNG tracker (``tensor_parallel.random.get_cuda_rng_tracker().fork()``, used
      around attention dropout) → Megatron's own inference tracker
      (``initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)``), whose ``fork``
      is a null context: dropout draws from the CPU generator (use dropout 0 for parity).
    * ``tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state`` → no CUDA
      generator state (None / no-op). Upstream caller: activation recompute
      (``CheckpointFunction`` via ``_get_all_rng_states`` / ``_set_all_rng_states``, used when
      ``learner.backend_settings.gradient_checkpointing`` turns on Megatron's full recompute), which
      saves the CPU generator itself and the CUDA one through these; there is no CUDA generator on CPU.
    * ``TORCHDYNAMO_DISABLE=1``: Megatron's ``jit_fuser`` functions (``torch.compile``) cost
      8–22 s on their first CPU call (fused vocab-parallel cross entropy); eager is identical.

    Returns:
        True when the shims are (now) active, False on a CUDA machine.
    """
    if cuda_available():
        return False
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    torch._dynamo.config.disable = True
    torch.cuda.current_device = _cpu_device  # stands in for torch.cuda.current_device
    torch.cuda.synchronize = _no_sync  # stands in for torch.cuda.synchronize (checkpoint writer)
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = _no_cuda_rng_state  # stands in for random._get_cuda_rng_state (recompute)
    mrandom._set_cuda_rng_state = _no_sync  # stands in for random._set_cuda_rng_state (recompute)
    tracker = mrandom._CUDA_RNG_STATE_TRACKER
    if tracker is None or not type(tracker).__name__.startswith("Inference"):
        # stands in for model_parallel_cuda_manual_seed / the CUDA CudaRNGStatesTracker
        mrandom.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    return True


def apply_checkpoint_shims() -> None:
    """Synchronous ``dist_checkpointing`` saves without a Manager server process (every path).

    Stands in for ``dist_checkpointing.strategies.filesystem_async._get_write_results_queue``:
    upstream returns ``multiprocessing.get_context("spawn").Manager().Queue()``, i.e. starts a
    server process on the first save that nothing stops when the rank is killed (an orphan
    holding the driver's stdout/stderr pipes). In a synchronous save the queue is written and
    read by the rank itself (``write_preloaded_data_multiproc`` then ``retrieve_write_results``),
    so a thread-safe in-process :class:`queue.Queue` is equivalent. Idempotent. Asynchronous
    saves (never used here) would need the original.
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async._get_write_results_queue = queue.Queue


def hf_config_for_mbridge(hf_config: Any) -> Any:
    """A copy of a ``transformers`` config with the attributes mbridge 0.15.1 reads.

    transformers ≥ 5 moved ``rope_theta`` into ``rope_parameters["rope_theta"]``; mbridge's
    ``LLMBridge._get_gptmodel_args`` reads ``hf_config.rope_theta``: copy it back.

    Raises:
        ConfigError: a RoPE type other than the default (e.g. Llama 3's scaled RoPE, which
            mbridge would turn into linear interpolation), or no ``rope_theta`` at all (naming
            ``model.path``).
    """
    cfg = copy.deepcopy(hf_config)
    params = getattr(cfg, "rope_parameters", None) or {}
    rope_type = params.get("rope_type") or "default"
    if rope_type != "default":
        raise ConfigError(f"model.path: rope_parameters.rope_type={rope_type!r}; learner.backend=megatron "
                          "supports the default RoPE only")
    if getattr(cfg, "rope_theta", None) is None:
        if "rope_theta" not in params:
            raise ConfigError(f"model.path: the {cfg.model_type} config has no rope_theta "
                              "(nor rope_parameters['rope_theta'])")
        cfg.rope_theta = params["rope_theta"]
    return cfg


#: Local-spec norm names → the Hugging Face names mbridge maps the Transformer-Engine fused
#: names (``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``) to.
_LOCAL_NORM_ATTENTION = {"input_layernorm.weight": ["model.layers.{layer_number}.input_layernorm.weight"]}
_LOCAL_NORM_MLP = {"pre_mlp_layernorm.weight":
                   ["model.layers.{layer_number}.post_attention_layernorm.weight"]}


def prepare_bridge(bridge: Any) -> Any:
    """Adjust one mbridge ``Bridge`` instance (its class attributes untouched).

    * Layer spec: ``LLMBridge._get_transformer_layer_spec`` hard-codes Transformer Engine
      (``TENorm`` and TE attention, absent on CPU); replaced by Megatron's local spec
      (``get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")``)
      on every path: its attention applies our explicit padding masks exactly (a TE spec is not
      tested here). Its separate norms ``input_layernorm`` / ``pre_mlp_layernorm`` are added to
      mbridge's name maps (mbridge only knows TE's fused ``…layer_norm_weight`` names).
    * Sequence parallel off (mbridge turns it on for TP > 1; the local spec's torch RMSNorm
      refuses it, and the critic's value head reads complete hidden states).
    * The LM-head name of this model (tied or not), per instance: mbridge's
      ``_adjust_mapping_for_shared_weights`` (Qwen2/Qwen3) mutates the CLASS dict, so once a tied
      model is bridged, an untied one of the same family loads its embedding twice.
    * Without CUDA: ``use_cpu_initialization=True`` (mbridge's default initialises on the GPU).

    Returns:
        ``bridge`` (adjusted in place).
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    tied = bool(getattr(bridge.hf_config, "tie_word_embeddings", False))
    head = "model.embed_tokens.weight" if tied else "lm_head.weight"
    bridge._DIRECT_MAPPING = {**type(bridge)._DIRECT_MAPPING, "output_layer.weight": head}

    def local_spec(vp_stage: int | None = None) -> Any:  # stands in for LLMBridge._get_transformer_layer_spec
        bridge.has_vp_stage = True
        return get_gpt_decoder_block_spec(bridge.config, use_transformer_engine=False,
                                          normalization="RMSNorm", vp_stage=vp_stage)

    bridge._get_transformer_layer_spec = local_spec
    bridge._OTHER_MAPPING = {**type(bridge)._OTHER_MAPPING, **_LOCAL_NORM_ATTENTION}
    bridge._MLP_MAPPING = {**type(bridge)._MLP_MAPPING, **_LOCAL_NORM_MLP}
    bridge.set_extra_args(sequence_parallel=False, use_cpu_initialization=not cuda_available())
    return bridge


def instantiate_model(bridge: Any, device: torch.device) -> torch.nn.Module:
    """Build the ``GPTModel`` of ``bridge`` on ``device`` (pipeline size 1).

    Stands in for ``mbridge.core.util.get_model``, which calls ``model.cuda()`` and can wrap in
    DDP itself: here the model is built from the bridge's provider, every parameter gets its
    tensor-parallel defaults (``set_defaults_if_not_set_tensor_model_parallel_attributes``, as
    upstream) and moves to ``device``; Megatron DDP wrapping is the caller's.

    Args:
        bridge: a :func:`prepare_bridge` -d bridge (``parallel_state`` initialised).
        device: the rank's device.
    """
    from megatron.core import tensor_parallel

    model = bridge._model_provider([])(pre_process=True, post_process=True)
    for p in model.parameters():
        tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(p)
    return model.to(device)
