"""Rollout side: trajectories, padded batches and the token-in/token-out agent loop."""
