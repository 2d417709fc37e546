"""Rollout engines behind one protocol (:class:`~trainer.engines.base.InferenceEngine`) and a
registry (:mod:`trainer.engines.registry`): ``rollout.engine`` names the factory.

Built in: ``embedded`` (in-process; CPU default), ``sglang`` (GPU server) and ``vllm`` (a vLLM server
from ``.venv-vllm``, CPU or GPU; LoRA adapters or full weights reloaded in place).
"""

from .builtin import SGLangSettings, embedded_engine, sglang_engine, sglang_preflight
from .registry import ENGINES, EngineHandle, EngineSpec, make_engine, register_engine
from .vllm_factory import VLLMSettings, vllm_engine
from .vllm_preflight import vllm_preflight

register_engine("embedded", embedded_engine)
register_engine("sglang", sglang_engine, preflight=sglang_preflight, settings=SGLangSettings)
register_engine("vllm", vllm_engine, preflight=vllm_preflight, settings=VLLMSettings)

__all__ = ["ENGINES", "EngineHandle", "EngineSpec", "SGLangSettings", "VLLMSettings", "make_engine",
           "register_engine"]
