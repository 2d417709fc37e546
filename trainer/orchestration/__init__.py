"""Asynchronous orchestration: staleness-bounded rollout admission and the training loop."""
