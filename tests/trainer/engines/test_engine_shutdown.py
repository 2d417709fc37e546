"""The embedded engine's worker at shutdown: ``close()`` waits for the step in progress, and a process that
exits while the worker is inside a torch op keeps its exit status instead of aborting.

Before: ``close()`` gave up after 5 s, and a daemon worker still inside a torch op when the interpreter
finalised ended the process with SIGABRT ("terminate called without an active exception", exit 134):
``copc train`` printed its one-line failure of the weight-sync check, then aborted (issue 42)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from trainer.engines.base import SamplingParams
from trainer.engines.embedded import EmbeddedEngine
from trainer.models.loading import load_model_and_tokenizer
from trainer.models.tiny import TinyModelConfig, save_tiny_checkpoint

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(save_tiny_checkpoint(tmp_path_factory.mktemp("tiny_shutdown"),
                                    TinyModelConfig(hidden_size=32, intermediate_size=64, num_layers=1)))


def test_close_waits_for_the_step_in_progress(tiny):
    """A step longer than the former 5 s bound: close() returns once the worker has stopped."""
    model, tok = load_model_and_tokenizer(tiny)
    started = []

    def slow(prompt, new, logits):  # one decode step of 5.5 s (sleeping: no CPU)
        started.append(time.monotonic())
        time.sleep(5.5)
        return logits

    async def main():
        eng = EmbeddedEngine(model, tok, logits_processor=slow)
        req = asyncio.create_task(eng.generate([20, 21, 22], SamplingParams(max_new_tokens=1)))
        while not started:
            await asyncio.sleep(0.01)
        await eng.close()
        closed = time.monotonic()
        await asyncio.gather(req, return_exceptions=True)
        return eng, closed

    eng, closed = asyncio.run(main())
    assert not eng._worker.is_alive()
    assert closed - started[0] >= 5.5


EXIT_MID_STEP = """
import asyncio, sys, time
import torch
from trainer.engines.base import SamplingParams
from trainer.engines.embedded import EmbeddedEngine
from trainer.models.loading import load_model_and_tokenizer

torch.set_num_threads(1)
model, tok = load_model_and_tokenizer(sys.argv[1])
busy = []

def burn(prompt, new, logits):  # ~2 s of torch ops in the worker thread
    busy.append(1)
    a, t0 = torch.randn(128, 128), time.monotonic()
    while time.monotonic() - t0 < 2.0:
        a = torch.tanh(a @ a)
    return logits

async def main():
    eng = EmbeddedEngine(model, tok, logits_processor=burn)
    req = asyncio.create_task(eng.generate([20, 21, 22], SamplingParams(max_new_tokens=1)))
    while not busy:
        await asyncio.sleep(0.01)
    req.cancel()  # the program ends without closing the engine: its worker is in a torch op

asyncio.run(main())
print("exiting with 3", flush=True)
sys.exit(3)
"""


def test_exit_while_the_worker_is_in_a_torch_op_keeps_the_exit_status(tiny, tmp_path):
    script = tmp_path / "exit_mid_step.py"
    script.write_text(textwrap.dedent(EXIT_MID_STEP))
    res = subprocess.run([sys.executable, str(script), tiny], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 3, (res.returncode, res.stderr[-2000:])
    assert "exiting with 3" in res.stdout
    assert "terminate called" not in res.stderr and "Fatal Python error" not in res.stderr
