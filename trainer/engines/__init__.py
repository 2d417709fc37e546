"""Rollout engines behind one protocol (:class:`~trainer.engines.base.InferenceEngine`) and a
registry (:mod:`trainer.engines.registry`): ``rollout.engine`` names the factory.

Built in: ``embedded`` (in-process; CPU default) and ``sglang`` (GPU server).
"""

from .builtin import SGLangSettings, embedded_engine, sglang_engine, sglang_preflight
from .registry import ENGINES, EngineHandle, EngineSpec, make_engine, register_engine

register_engine("embedded", embedded_engine)
register_engine("sglang", sglang_engine, preflight=sglang_preflight, settings=SGLangSettings)

__all__ = ["ENGINES", "EngineHandle", "EngineSpec", "SGLangSettings", "make_engine",
           "register_engine"]
