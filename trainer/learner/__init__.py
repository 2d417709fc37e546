"""Learners: the torch actor-critic learner (CPU / single GPU)."""
