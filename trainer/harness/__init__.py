"""The harness: train an agent of your own through an OpenAI-compatible rollout endpoint
(``task.env: harness``; ``docs/harness.md``)."""
