"""Execute a sweep's runs as ``copc train`` subprocesses, N at a time (threads) or as Ray tasks.

Each run (:func:`execute_run`): when its training has not finished, ``python -m trainer.cli
train`` with the run's overrides (``--resume`` when its directory holds an earlier attempt:
the run continues from its newest checkpoint, or starts over when there is none); then, with
``--eval-checkpoints``, ``python -m trainer.cli eval --checkpoint DIR`` for every kept
checkpoint without a stored result (the JSON it prints is saved to
``posthoc_eval/step_XXXXXXXX.json``). stdout and stderr go to the run's log file. A failed run
is recorded in its status file and the sweep goes on.

Ray (``launcher.kind=ray`` in the base config): every run is a Ray task (``num_cpus=0``: the
``copc train`` driver it starts is light, and the rollout workers and learner that this run
asks the cluster for hold the resources) running the same subprocess. The sweep connects to
``launcher.settings.address`` or starts a local cluster with ``launcher.settings.num_cpus`` CPUs
(:func:`trainer.ray_util.connect_ray`, as the Ray launcher does), and passes the cluster's address to
every run as ``launcher.settings.address`` so the runs' actors share that one cluster. On a
multi-node cluster the sweep directory must be on a filesystem that every node sees at the same path.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ..parent_watch import child_env
from .grid import format_value
from .plan import RunPlan

#: Seconds a run may take to stop after SIGINT (it checkpoints nothing more; the last checkpoint stays).
STOP_GRACE_S = 60.0


def _stop(proc: subprocess.Popen) -> None:
    """Let ``proc`` exit on its own after a terminal Ctrl-C (same process group), else send SIGINT,
    then SIGKILL after :data:`STOP_GRACE_S`."""
    for sig, wait_s in ((None, 5.0), (signal.SIGINT, STOP_GRACE_S), (signal.SIGKILL, 10.0)):
        if proc.poll() is not None:
            return
        if sig is not None:
            proc.send_signal(sig)
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue


def _call(cmd: list[str], log: Any, stdout: Any, stop: threading.Event | None) -> int:
    """Run ``cmd`` (stderr → ``log``, stdout → ``stdout``) until it exits or ``stop`` is set.

    Returns:
        The exit status (after ``stop``: the child's own when it exits within the grace time, else
        that of the signal that ended it, negative as in :attr:`subprocess.Popen.returncode`).

    Raises:
        KeyboardInterrupt: passed on (e.g. ``ray.cancel``) after stopping the child.
    """
    env = child_env({**os.environ, "PYTHONUNBUFFERED": "1"})  # the run stops if the sweep is killed
    proc = subprocess.Popen(cmd, stdout=stdout, stderr=log, env=env)
    try:
        while True:
            try:
                return proc.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                if stop is not None and stop.is_set():
                    _stop(proc)
                    return proc.wait()
    except BaseException:
        _stop(proc)
        raise


def _last_json_object(text: str) -> dict:
    """The last top-level JSON object printed on its own lines (``copc eval``'s result).

    Raises:
        ValueError: none found.
    """
    lines = text.splitlines(keepends=True)
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].rstrip() == "{":
            try:
                obj, _ = json.JSONDecoder().raw_decode("".join(lines[i:]))
            except ValueError:
                continue
            if isinstance(obj, dict):
                return obj
    raise ValueError("no JSON object in copc eval's output")


def _stopped(rc: int, stop: threading.Event | None) -> bool:
    """A non-zero exit caused by Ctrl-C / the sweep stopping (not a failure of the run)."""
    return rc in (130, -signal.SIGINT, -signal.SIGKILL) or (stop is not None and stop.is_set())


def _write_status(plan: RunPlan, record: dict) -> None:
    tmp = plan.status_file.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=2))
    os.replace(tmp, plan.status_file)


def execute_run(plan: RunPlan, stop: threading.Event | None = None) -> dict:
    """Bring one run to done: train (or resume) it, then evaluate its checkpoints post hoc.

    Args:
        plan: the run. stop: set to stop the run (it gets SIGINT and saves nothing more).

    Returns:
        The status record also written to ``plan.status_file``: ``status`` (``ok`` | ``failed`` |
        ``interrupted``), ``stage`` (``train`` | ``eval`` | ``done``), ``returncode`` (int or
        None), ``resumed`` (bool), ``command`` (the last command), ``log`` (path), ``wall_s``
        (seconds of this attempt), ``error`` (text or None).

    Raises:
        KeyboardInterrupt: passed on after stopping the subprocess.
    """
    t0 = time.time()
    plan.log.parent.mkdir(parents=True, exist_ok=True)
    rec: dict[str, Any] = {"run": plan.name, "status": "ok", "stage": "done", "returncode": 0,
                           "resumed": False, "command": None, "log": str(plan.log), "error": None,
                           "started": t0}

    def finish(status: str, stage: str, rc: int | None, error: str | None = None) -> dict:
        rec.update(status=status, stage=stage, returncode=rc, error=error, wall_s=time.time() - t0)
        _write_status(plan, rec)
        return rec

    with open(plan.log, "a") as log:
        if not plan.train_finished():
            resume = plan.run_dir.exists() and (not plan.run_dir.is_dir() or any(plan.run_dir.iterdir()))
            cmd = plan.train_command(resume)
            rec.update(resumed=resume, command=cmd)
            log.write(f"\n=== copc sweep {time.strftime('%Y-%m-%d %H:%M:%S')}: {' '.join(cmd)}\n")
            log.flush()
            rc = _call(cmd, log, log, stop)
            if rc != 0 and _stopped(rc, stop):
                return finish("interrupted", "train", rc)
            if rc != 0 or not plan.train_finished():
                why = None if rc else "exited 0 without a finished summary.json"
                return finish("failed", "train", rc, why)
        for ckpt in plan.pending_evals():
            cmd = plan.eval_command(ckpt)
            rec["command"] = cmd
            log.write(f"\n=== copc sweep {time.strftime('%Y-%m-%d %H:%M:%S')}: {' '.join(cmd)}\n")
            log.flush()
            out_file = plan.posthoc_file(ckpt)
            out_file.parent.mkdir(parents=True, exist_ok=True)
            raw = out_file.with_suffix(".stdout")
            with open(raw, "w") as stdout:
                rc = _call(cmd, log, stdout, stop)
            text = raw.read_text()
            log.write(text)
            if rc != 0 and _stopped(rc, stop):
                return finish("interrupted", "eval", rc)
            try:
                if rc != 0:
                    raise ValueError(f"copc eval exited {rc}")
                result = _last_json_object(text)
            except ValueError as e:
                return finish("failed", "eval", rc, f"{ckpt.name}: {e}")
            out_file.write_text(json.dumps(result, indent=2))
            raw.unlink()
    return finish("ok", "done", 0)


def _crash_record(plan: RunPlan, err: BaseException) -> dict:
    """Status record of a run whose driver code raised (not the subprocess: e.g. an unwritable log)."""
    rec = {"run": plan.name, "status": "failed", "stage": "sweep", "returncode": None, "resumed": False,
           "command": None, "log": str(plan.log), "error": f"{type(err).__name__}: {err}", "wall_s": 0.0}
    with contextlib.suppress(OSError):
        _write_status(plan, rec)
    return rec


class LocalPool:
    """Runs :func:`execute_run` in up to ``parallel`` threads (each waits on its subprocess)."""

    def __init__(self, parallel: int) -> None:
        self._ex = cf.ThreadPoolExecutor(max_workers=parallel, thread_name_prefix="sweep")
        self._stop = threading.Event()

    def submit(self, plan: RunPlan) -> cf.Future:
        """Start ``plan``; returns its handle."""
        return self._ex.submit(execute_run, plan, self._stop)

    def wait(self, handles: list, timeout: float) -> list[tuple[Any, dict | BaseException]]:
        """Handles finished within ``timeout`` seconds, with their record or exception."""
        done, _ = cf.wait(handles, timeout=timeout, return_when=cf.FIRST_COMPLETED)
        return [(h, h.exception() or h.result()) for h in done]

    def stop(self, handles: list) -> None:
        """Stop every running subprocess and wait for the threads."""
        self._stop.set()
        cf.wait(handles)

    def close(self) -> None:
        """Shut the thread pool down."""
        self._ex.shutdown(wait=True)


class RayPool:
    """Runs :func:`execute_run` as Ray tasks on the cluster of ``address`` (empty: a local one),
    joined or started with :func:`trainer.ray_util.connect_ray` (the runs' output goes to their logs,
    not to this process).

    Args:
        address: the launcher's ``launcher.settings.address``. num_cpus: CPUs of a local cluster
            (``launcher.settings.num_cpus``).

    Raises:
        ConnectionError / RuntimeError: from ``ray.init`` (no cluster at ``address``).
    """

    def __init__(self, address: str, num_cpus: int) -> None:
        import ray

        from ..ray_util import connect_ray

        self._ray = ray
        self._started = connect_ray(address, num_cpus, log_to_driver=False)
        self.address = address or ray.get_runtime_context().gcs_address
        self._remote = ray.remote(num_cpus=0, max_retries=0)(execute_run)

    def prepare(self, plan: RunPlan) -> RunPlan:
        """``plan`` with ``launcher.settings.address`` set to this cluster (its actors join it)."""
        address = f"launcher.settings.address={format_value(self.address)}"
        return replace(plan, overrides=(*plan.overrides, address))

    def submit(self, plan: RunPlan) -> Any:
        """Start ``plan`` as a Ray task; returns its ObjectRef."""
        return self._remote.remote(self.prepare(plan))

    def wait(self, handles: list, timeout: float) -> list[tuple[Any, dict | BaseException]]:
        """Tasks finished within ``timeout`` seconds, with their record or exception."""
        done, _ = self._ray.wait(handles, num_returns=1, timeout=timeout)
        out = []
        for h in done:
            try:
                out.append((h, self._ray.get(h)))
            except Exception as e:
                out.append((h, e))
        return out

    def stop(self, handles: list) -> None:
        """Cancel the tasks (each stops its subprocess on the KeyboardInterrupt) and wait."""
        for h in handles:
            self._ray.cancel(h)
        for h in handles:
            try:
                self._ray.get(h)
            except Exception:  # cancelled tasks raise TaskCancelledError; their record is re-read
                continue

    def close(self) -> None:
        """Disconnect (and stop a cluster this pool started)."""
        if self._started:
            self._ray.shutdown()


def run_all(plans: list[RunPlan], pool: LocalPool | RayPool, parallel: int,
            on_event: Callable[[str, RunPlan, dict | None], None]) -> dict[str, dict]:
    """Run ``plans`` through ``pool`` with at most ``parallel`` in flight.

    Args:
        plans: runs to execute (finished ones should be filtered out by the caller).
        on_event: ``f(kind, plan, record)`` with kind ``start`` (record None) or ``end``.

    Returns:
        ``{plan.name: status record}``; on Ctrl-C the runs in flight are stopped, their
        records say ``interrupted``, and the KeyboardInterrupt is re-raised.
    """
    queue = list(plans)
    running: dict[Any, RunPlan] = {}
    records: dict[str, dict] = {}
    try:
        while queue or running:
            while queue and len(running) < parallel:
                plan = queue.pop(0)
                running[pool.submit(plan)] = plan
                on_event("start", plan, None)
            for handle, res in pool.wait(list(running), timeout=1.0):
                plan = running.pop(handle)
                rec = _crash_record(plan, res) if isinstance(res, BaseException) else res
                records[plan.name] = rec
                on_event("end", plan, rec)
    except KeyboardInterrupt:
        pool.stop(list(running))
        for plan in running.values():
            records[plan.name] = {"run": plan.name, "status": "interrupted", "log": str(plan.log)}
        raise
    finally:
        pool.close()
    return records

