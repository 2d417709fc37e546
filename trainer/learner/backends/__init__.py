"""The learner backends, one module or package each (see :mod:`trainer.learner`, which registers them):

* :mod:`.torch` — ``learner.backend: torch``, one process, one device (the reference);
* :mod:`.fsdp` — ``learner.backend: fsdp``, PyTorch FSDP2 data parallel over rank processes;
* :mod:`.megatron` — ``learner.backend: megatron``, Megatron-core tensor + data parallel (the
  ``megatron`` extra).

Each implements the hooks of :class:`~trainer.learner.template.TemplateLearner` (recompute,
update, schedule); the step itself is written once there. The rank processes, collectives and
checkpoint plumbing shared by the distributed backends are :mod:`trainer.learner.distributed`.
"""
