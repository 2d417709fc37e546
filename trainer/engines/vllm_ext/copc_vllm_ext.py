"""A vLLM worker extension (``--worker-extension-cls copc_vllm_ext.COPCWorkerExtension``) that makes an
in-place full-weight reload correct for tied-embedding models.

It runs inside the vLLM server's own venv (``.venv-vllm``): the launcher puts only this directory on
the server's ``PYTHONPATH``, so it must import nothing of COPC. Called through ``POST /collective_rpc``
(``VLLM_SERVER_DEV_MODE=1``) as ``{"method": "copc_reload_weights", "kwargs": {"weights_path": dir}}``.

Why (vLLM 0.32, read in ``vllm/model_executor/model_loader/reload/layerwise.py`` and
``vllm/model_executor/layers/utils.py``): ``reload_weights`` reloads layer by layer and re-runs each
loaded layer's ``process_weights_after_loading``. A tied ``lm_head`` (``ParallelLMHead`` sharing
``embed_tokens.weight``) gets no weight of its own from the checkpoint, so it logs "ParallelLMHead:
Failed to load weights" and is skipped: its tensor is the shared one and holds the new values, but on
CPU the logits GEMM uses a packed copy of the weight made by ``process_weights_after_loading``
(``dispatch_cpu_unquantized_gemm``: oneDNN / sgl-kernel), which is left from the OLD weights. Re-tying
the head and re-running its ``process_weights_after_loading`` after the reload repacks it from the new
weights (on GPU that call does nothing and the shared tensor is already right).
"""

from __future__ import annotations


class COPCWorkerExtension:
    """Methods added to vLLM's worker class (vLLM checks they clash with none of its own)."""

    def copc_ping(self) -> dict:
        """``{"copc": True}``: this extension is installed (a run attaching to a server checks it)."""
        return {"copc": True}

    def copc_reload_weights(self, weights_path: str) -> dict:
        """``reload_weights(weights_path=...)``, then re-tie and repack a tied output head.

        Args:
            weights_path: a directory of ``*.safetensors`` in the served model's Hugging Face names.

        Returns:
            ``{"tied": bool, "retied": bool, "repacked": bool}``: whether the model ties its
            embeddings, whether the head had to be pointed at the embedding again, whether its
            weight processing (the CPU GEMM's packed copy) was redone.
        """
        self.reload_weights(weights_path=weights_path)
        model = self.get_model()
        tied = bool(getattr(self.vllm_config.model_config.hf_text_config, "tie_word_embeddings", False))
        head, retied, repacked = getattr(model, "lm_head", None), False, False
        if tied and head is not None and hasattr(head, "weight"):
            embed = getattr(getattr(model, "model", None), "embed_tokens", None)  # Llama / Qwen2 layout
            if embed is not None and head.weight is not embed.weight:
                head.weight = embed.weight
                retied = True
            method = getattr(head, "quant_method", None)
            if method is not None:
                method.process_weights_after_loading(head)
                repacked = True
        return {"tied": tied, "retied": retied, "repacked": repacked}
