"""PROTOCOL STAND-IN for SGLang, used only by tests/trainer/engines/test_sglang.py.

Not SGLang and not a mock of our code: a tiny FastAPI server that answers SGLang's native
HTTP endpoints in the shapes SGLang's docs describe, so that the real launcher and the
real HTTP client are exercised end to end on a CPU machine. Put this directory first on
PYTHONPATH of the server subprocess only.
"""
