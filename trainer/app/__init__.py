"""Assembling and running a job from a config: the ``copc train`` / ``copc eval`` / ``copc analyze`` commands.

``context.py`` builds a run's objects (task, models, learner, engines, prompt stream) from an
:class:`~trainer.config.ExperimentConfig`; ``run.py`` runs the phases (warm start, before/after
evaluation, RL); ``cli_train.py`` and ``analyze.py`` are the command-line groups that
:mod:`trainer.cli` imports on demand. Nothing below this package imports it.
"""
