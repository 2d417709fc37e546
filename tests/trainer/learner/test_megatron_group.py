"""A reusable 2-process gloo group for the Megatron tests (one per test module: Megatron +
mbridge imports take ~10 s per process), and the tests of the group itself.

:class:`RankPool` spawns ``world_size`` processes that join one gloo process group
(``tcp://127.0.0.1:<free port>``) and then run functions sent by the test:
``pool.run(fn, *args)`` calls the module-level function ``fn(state, *args)`` on every rank and
returns the per-rank results (rank 0 first). ``fn`` is found in the rank by its file and name
(the test file is loaded by path there), so test modules define their rank-side code next to
their tests. ``state`` is a per-rank dict kept between calls (``rank``, ``world_size``, and
whatever the functions store, e.g. built learners). A rank that raises, dies or exceeds the
timeout makes :meth:`RankPool.run` raise ``RuntimeError`` with the rank's traceback (and closes
the pool: no rank is left waiting in a collective).
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import os
import runpy
import socket
import sys
import time
import traceback
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import pytest
import torch.multiprocessing as mp

_RUN_NAME = "__copc_megatron_rank__"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RankPool:
    """``world_size`` spawned ranks in one gloo group (see the module docstring).

    Args:
        world_size: number of ranks.
        timeout_s: default limit of one :meth:`run` (seconds).
    """

    def __init__(self, world_size: int = 2, timeout_s: float = 300.0) -> None:
        ctx = mp.get_context("spawn")
        init = f"tcp://127.0.0.1:{_free_port()}"
        self.world_size, self.timeout_s = world_size, timeout_s
        self.procs, self.conns = [], []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            args = {"_COPC_RANK": (child, rank, world_size, init)}
            p = ctx.Process(target=runpy.run_path, args=(__file__,), kwargs={"init_globals": args,
                                                                           "run_name": _RUN_NAME})
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)
        self._closed = False
        self._collect("start", timeout_s)

    def run(self, fn: Any, *args: Any, timeout_s: float | None = None) -> list[Any]:
        """``fn(state, *args)`` on every rank; the results in rank order.

        Raises:
            RuntimeError: a rank raised (its traceback in the message), died or timed out.
        """
        if self._closed:
            raise RuntimeError("RankPool is closed")
        msg = (str(Path(inspect.getfile(fn)).resolve()), fn.__name__, args)
        for conn in self.conns:
            conn.send(msg)
        return self._collect(fn.__name__, timeout_s or self.timeout_s)

    def _collect(self, what: str, timeout_s: float) -> list[Any]:
        results: list[Any] = [None] * self.world_size
        pending = set(range(self.world_size))
        deadline = time.monotonic() + timeout_s
        while pending:
            objs = {self.conns[r]: r for r in pending} | {self.procs[r].sentinel: r for r in pending}
            ready = wait(list(objs), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                self._fail(f"ranks {sorted(pending)} did not finish {what!r} within {timeout_s} s")
            for obj in ready:
                r = objs[obj]
                if r not in pending:
                    continue
                if not self.conns[r].poll():
                    self._fail(f"rank {r} died during {what!r} (exit code {self.procs[r].exitcode})")
                status, value = self.conns[r].recv()
                if status == "error":
                    self._fail(f"rank {r} raised during {what!r}:\n{value}")
                results[r] = value
                pending.discard(r)
        return results

    def _fail(self, msg: str) -> None:
        self.close(graceful=False)
        raise RuntimeError(msg)

    def close(self, graceful: bool = True) -> None:
        """Stop the ranks (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for conn in self.conns:
            if graceful:
                with contextlib.suppress(OSError):
                    conn.send(None)
        for p in self.procs:
            p.join(timeout=20 if graceful else 0.1)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        for conn in self.conns:
            conn.close()


def _rank_loop(conn: Any, rank: int, world_size: int, init: str) -> None:
    """A rank's main: join the gloo group, then run ``(file, function, args)`` messages."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world_size)
        conn.send(("ok", rank))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    state: dict[str, Any] = {"rank": rank, "world_size": world_size}
    modules: dict[str, Any] = {}
    try:
        while True:
            try:
                msg = conn.recv()
            except EOFError:
                return
            if msg is None:
                return
            path, name, args = msg
            try:
                if path not in modules:
                    spec = importlib.util.spec_from_file_location(f"copc_rank_{Path(path).stem}", path)
                    mod = importlib.util.module_from_spec(spec)
                    spec.loader.exec_module(mod)
                    modules[path] = mod
                conn.send(("ok", getattr(modules[path], name)(state, *args)))
            except BaseException:
                conn.send(("error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == _RUN_NAME:  # inside a spawned rank (runpy.run_path with _COPC_RANK set)
    sys.path.insert(0, str(Path(__file__).parent.resolve().parents[2]))
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # the test modules' siblings, by name
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _rank_loop(*globals()["_COPC_RANK"])


# -- tests of the pool itself (no Megatron import: a few seconds) ------------------------------
def _r_all_reduce(state: dict, x: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([x * (state["rank"] + 1)])
    dist.all_reduce(t)
    state["seen"] = state.get("seen", 0) + 1
    return float(t)


def _r_fail_on_rank1(state: dict) -> int:
    if state["rank"] == 1:
        raise ValueError("boom on rank 1")
    return state["seen"]


def test_pool_runs_collectives_keeps_state_and_reports_rank_errors():
    pool = RankPool(2, timeout_s=60)
    try:
        assert pool.run(_r_all_reduce, 2.0) == [6.0, 6.0]  # 2·1 + 2·2 on both ranks
        assert pool.run(_r_all_reduce, 1.0) == [3.0, 3.0]
        with pytest.raises(RuntimeError, match=r"rank 1 raised during '_r_fail_on_rank1'[\s\S]*boom"):
            pool.run(_r_fail_on_rank1)
        with pytest.raises(RuntimeError, match="closed"):
            pool.run(_r_all_reduce, 1.0)
    finally:
        pool.close()
