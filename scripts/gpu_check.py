"""One prepared GPU check (docs/gpu_check.md): wheel install, then timed, guarded steps, one summary.

Stdlib only at the top level (it runs before the carried wheels are installed). Subcommands:

* ``install --wheels DIR --target DIR``: unpack the carried wheels whose distribution is not
  already importable (the machine's own packages are not shadowed, except: megatron-core and
  mbridge present at another version, since the backend asserts exact pins, and an older
  typing-extensions), choosing per distribution the wheel whose tags fit this interpreter.
* ``run --device cuda|cpu --out OUT``: run the steps of :data:`STEPS` in order, each in its own
  process group with a timeout cut from one global budget (``--budget-s``, default 450 s, so the
  whole ``bash scripts/gpu_check.sh`` stays under 8 minutes), and write
  ``OUT/gpu_check_summary.json`` + ``OUT/gpu_check_summary.md`` after every step, logs under
  ``OUT/logs/``. A failing, crashing or timed-out step is recorded and the next one still runs.
* ``step NAME ...``: internal, one step in a fresh process (``scripts/gpu_check_steps.py``).
* ``cli --sandbox bwrap|process -- ARGS``: internal, ``trainer.cli.main(ARGS)`` (step ``run10``).

The device machine returns at most 8 files from ``$OUT``: the two summaries, five logs and one
``logs/artifacts.tar.gz`` (the 10-step run's summary/metrics/config, step results, JUnit XML).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata as md
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCHEMA_VERSION = 1
#: Distributions unpacked even when another version is installed (asserted pins, pyproject.toml).
EXACT_PINS = {"megatron-core", "mbridge"}
#: Distributions unpacked when the installed one is older than the carried one (backward-compatible
#: packages a carried wheel needs new: pydantic 2.14 requires typing-extensions >= 4.16).
UPGRADE_IF_OLDER = {"typing-extensions"}
#: Keys of the ``env`` step copied to the top level of the summary.
ENV_KEYS = ("device_name", "python", "torch", "cuda", "transformers")


@dataclass(frozen=True)
class StepSpec:
    """One check step.

    Attributes:
        name: key in the summary's ``steps`` and the log file name (``logs/<name>.log``).
        title: one line for the markdown summary.
        cap_s: most seconds it may take (wall clock, its process group killed after).
        reserve_s: seconds kept back for it while earlier steps run (so a slow earlier step
            cannot starve it).
    """

    name: str
    title: str
    cap_s: float
    reserve_s: float


STEPS = (
    StepSpec("env", "device, Python, torch/CUDA versions, sandbox", 90, 15),
    StepSpec("pytest_gpu", "pytest -m gpu (the gpu-marked tests)", 120, 20),
    StepSpec("learner_steps", "torch / fsdp / megatron learner steps (bf16, fp32) vs an fp32 torch step",
             270, 60),
    StepSpec("logprob_parity", "behavior log-probs of the embedded engine vs the learner's", 90, 20),
    StepSpec("run10", "10-step cpu_tiny run, learner on the device (fsdp, world 1)", 240, 60),
)


# -- wheel install ------------------------------------------------------------------------------
def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_tags(filename: str) -> tuple[str, str, set[str]]:
    """``(distribution, version, {"py-abi-platform", ...})`` of a wheel file name (PEP 427).

    Raises:
        ValueError: ``filename`` is not ``name-version[-build]-py-abi-plat.whl``.
    """
    parts = filename[:-4].split("-") if filename.endswith(".whl") else []
    if len(parts) not in (5, 6):
        raise ValueError(f"wheel file name {filename!r}: expected name-version[-build]-py-abi-platform.whl")
    name, version, py, abi, plat = parts[0], parts[1], parts[-3], parts[-2], parts[-1]
    tags = {f"{p}-{a}-{q}" for p in py.split(".") for a in abi.split(".") for q in plat.split(".")}
    return _norm(name), version, tags


def supported_tags() -> list[str]:
    """This interpreter's wheel tags, most specific first (``packaging.tags`` when importable,
    else CPython ``cpXY``/``abi3``/``py3-none-any`` on x86-64 manylinux)."""
    try:
        from packaging import tags
        return [str(t) for t in tags.sys_tags()]
    except ImportError:  # pragma: no cover - packaging comes with torch/transformers
        v = f"cp{sys.version_info[0]}{sys.version_info[1]}"
        plats = ["manylinux_2_28_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
                 "manylinux2014_x86_64", "manylinux_2_12_x86_64", "manylinux2010_x86_64", "linux_x86_64"]
        return ([f"{v}-{v}-{p}" for p in plats] + [f"{v}-abi3-{p}" for p in plats]
                + [f"cp3{m}-abi3-{p}" for m in range(sys.version_info[1], 1, -1) for p in plats]
                + ["py3-none-any"])


def _unpack(wheel: Path, target: Path) -> None:
    """Unzip ``wheel`` into ``target`` (``*.data/purelib|platlib`` moved to the top level)."""
    with zipfile.ZipFile(wheel) as z:
        z.extractall(target)
    for data in target.glob("*.data"):
        for sub in ("purelib", "platlib"):
            for p in (data / sub).glob("*") if (data / sub).is_dir() else []:
                dst = target / p.name
                if dst.exists():
                    shutil.rmtree(dst) if dst.is_dir() else dst.unlink()
                shutil.move(str(p), dst)
        shutil.rmtree(data)


def _older(have: str, carried: str) -> bool:
    """``have < carried`` as versions (``packaging``; plain tuple comparison without it)."""
    try:
        from packaging.version import Version
        return Version(have) < Version(carried)
    except ImportError:  # pragma: no cover
        def nums(v: str) -> tuple[int, ...]:
            return tuple(int(x) for x in re.findall(r"\d+", v))
        return nums(have) < nums(carried)


def install_wheels(wheels: Path, target: Path) -> dict:
    """Unpack into ``target`` every distribution of ``wheels/*.whl`` this interpreter lacks.

    Returns:
        ``{"installed": {name: version}, "present": {name: installed version}, "no_compatible_wheel":
        [names], "target": str, "wheel_dir_mib": float}``.
    """
    ranking = {t: i for i, t in enumerate(supported_tags())}
    by_name: dict[str, list[tuple[int, str, Path]]] = {}
    for w in sorted(wheels.glob("*.whl")):
        name, version, tags = wheel_tags(w.name)
        rank = min((ranking[t] for t in tags if t in ranking), default=None)
        by_name.setdefault(name, [])
        if rank is not None:
            by_name[name].append((rank, version, w))
    report: dict = {"installed": {}, "present": {}, "no_compatible_wheel": [], "target": str(target),
                    "wheel_dir_mib": round(sum(w.stat().st_size for w in wheels.glob("*.whl")) / 2**20, 2)}
    target.mkdir(parents=True, exist_ok=True)
    for name, cands in sorted(by_name.items()):
        try:
            have = md.version(name)
        except md.PackageNotFoundError:
            have = None
        if not cands:
            report["no_compatible_wheel"].append(name)
            continue
        _, version, wheel = min(cands)
        if have is not None and not (name in EXACT_PINS and have != version) \
                and not (name in UPGRADE_IF_OLDER and _older(have, version)):
            report["present"][name] = have
            continue
        _unpack(wheel, target)
        report["installed"][name] = version
    return report


# -- running the steps --------------------------------------------------------------------------
def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def run_step(spec: StepSpec, args: argparse.Namespace, work: Path, logs: Path, timeout_s: float) -> dict:
    """Run one step in a fresh process group; its result dict (``status``, ``wall_s``, numbers).

    A step that exceeds ``timeout_s`` has its process group killed (status ``failed``, reason
    ``timeout``); one that dies without writing a result is ``failed`` with its exit code and the
    tail of its log.
    """
    result_file = work / f"result_{spec.name}.json"
    result_file.unlink(missing_ok=True)
    log = logs / ("setup.log" if spec.name == "env" else f"{spec.name}.log")
    cmd = [sys.executable, "-u", str(Path(__file__).resolve()), "step", spec.name, "--device", args.device,
           "--work", str(work), "--result", str(result_file), "--deadline", str(time.time() + timeout_s - 3),
           "--run-steps", str(args.run_steps), "--warm-start-steps", str(args.warm_start_steps),
           "--eval-samples", str(args.eval_samples)]
    t0 = time.perf_counter()
    with open(log, "a") as fh:
        fh.write(f"\n===== step {spec.name} (timeout {timeout_s:.0f} s): {' '.join(cmd)}\n")
        fh.flush()
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the step's children too (rank processes, CLI)
            proc.wait()
    wall = time.perf_counter() - t0
    if rc is None:
        res = {"status": "failed", "reason": f"timeout after {timeout_s:.0f} s"}
        if result_file.is_file():  # partial results written before the timeout
            res["partial"] = json.loads(result_file.read_text())
    elif result_file.is_file():
        res = json.loads(result_file.read_text())
    else:
        res = {"status": "failed", "reason": f"the step process exited with {rc} without a result"}
    if res.get("status") == "failed":
        res["log_tail"] = _tail(log)
    res.update(wall_s=round(wall, 2), timeout_s=round(timeout_s, 1), log=f"logs/{log.name}")
    return res


def write_summary(out: Path, summary: dict) -> None:
    """``out/gpu_check_summary.json`` and the human-readable ``out/gpu_check_summary.md`` (a table of
    the steps, then each step's ``details_md`` lines, then the log tails of failed steps)."""
    (out / "gpu_check_summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    env = summary["steps"].get("env", {})
    lines = [f"# GPU check — {'OK' if summary['ok'] else 'FAILURES'} ({summary['device_requested']})", "",
             f"- device: {env.get('device_name', '?')} (requested {summary['device_requested']})",
             f"- python {env.get('python', '?')}, torch {env.get('torch', '?')}, "
             f"CUDA {env.get('cuda', '-')}, transformers {env.get('transformers', '?')}, "
             f"megatron-core {env.get('megatron_core', '-')}",
             f"- sandbox: {env.get('sandbox', '?')}",
             f"- wall {summary['wall_s']:.0f} s of a {summary['budget_s']:.0f} s budget; wheels installed: "
             f"{', '.join(summary['wheels'].get('installed', {})) or 'none'}", "",
             "| step | status | wall s | key numbers |", "|---|---|---|---|"]
    for spec in STEPS:
        r = summary["steps"].get(spec.name)
        if r is None:
            lines.append(f"| {spec.name} | not run | | |")
            continue
        status = r["status"] + (f": {r['reason']}" if r.get("reason") else "")
        cell = str(r.get("headline", "")).replace("|", "/")
        lines.append(f"| {spec.name} | {status.replace('|', '/')} | {r.get('wall_s', 0):.1f} | {cell} |")
    for spec in STEPS:
        r = summary["steps"].get(spec.name, {})
        if r.get("details_md"):
            lines += ["", f"## {spec.name}", "", *r["details_md"]]
    for spec in STEPS:
        r = summary["steps"].get(spec.name, {})
        if r.get("log_tail"):
            lines += ["", f"## {spec.name}: log tail ({r['log']})", "", "```", r["log_tail"], "```"]
    (out / "gpu_check_summary.md").write_text("\n".join(lines) + "\n")


def step_timeout(i: int, remaining: float) -> float:
    """Seconds step ``STEPS[i]`` may take: its cap, less what the later steps' reserves need."""
    later = sum(s.reserve_s for s in STEPS[i + 1:])
    return min(STEPS[i].cap_s, remaining - later)


def cmd_run(args: argparse.Namespace) -> int:
    """Run every step (see module docstring); exit 0 iff none failed."""
    out = Path(args.out).resolve()
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    work = Path(args.work or tempfile.mkdtemp(prefix="gpu_check_work_")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    report = Path(args.wheel_report) if args.wheel_report else None
    wheels = json.loads(report.read_text()) if report is not None and report.is_file() else {}
    summary = {"schema": SCHEMA_VERSION, "device_requested": args.device, "device_name": None,
               "python": None, "torch": None, "cuda": None, "transformers": None, "budget_s": args.budget_s,
               "started_unix": t0, "wall_s": 0.0, "ok": False, "wheels": wheels, "steps": {}}
    only = set(args.steps.split(",")) if args.steps else None
    for i, spec in enumerate(STEPS):
        if only is not None and spec.name not in only and spec.name != "env":
            continue
        timeout = step_timeout(i, args.budget_s - (time.time() - t0))
        if timeout < 10:
            res = {"status": "skipped", "reason": f"time budget ({args.budget_s:.0f} s) used up",
                   "wall_s": 0.0}
        else:
            print(f"[gpu_check] {spec.name}: {spec.title} (≤ {timeout:.0f} s)", flush=True)
            res = run_step(spec, args, work, logs, timeout)
        summary["steps"][spec.name] = res
        if spec.name == "env":
            summary.update({k: res.get(k) for k in ENV_KEYS})
        summary["wall_s"] = time.time() - t0
        summary["ok"] = all(r["status"] != "failed" for r in summary["steps"].values())
        write_summary(out, summary)
        why = f" ({res['reason']})" if res.get("reason") else ""
        print(f"[gpu_check] {spec.name}: {res['status']}{why} in {res.get('wall_s', 0):.1f} s  "
              f"{res.get('headline', '')}", flush=True)
    with tarfile.open(logs / "artifacts.tar.gz", "w:gz") as tar:
        arts = work / "artifacts"
        if arts.is_dir():
            tar.add(arts, arcname="artifacts")
        for f in sorted(work.glob("result_*.json")):
            tar.add(f, arcname=f"results/{f.name}")
    verdict = "OK" if summary["ok"] else "FAILURES"
    print(f"[gpu_check] {verdict}: {out / 'gpu_check_summary.json'}", flush=True)
    return 0 if summary["ok"] else 1


def cmd_step(args: argparse.Namespace) -> int:
    """Run one step in this process and write its result JSON (``status: failed`` on an exception)."""
    import traceback

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import gpu_check_steps

    ctx = gpu_check_steps.StepContext(device=args.device, work=Path(args.work), deadline=args.deadline,
                                      result=Path(args.result), run_steps=args.run_steps,
                                      warm_start_steps=args.warm_start_steps, eval_samples=args.eval_samples)
    try:
        res = gpu_check_steps.STEP_FUNCTIONS[args.name](ctx)
    except Exception as e:  # a step's failure is data for the summary
        traceback.print_exc()
        res = {"status": "failed", "reason": f"{type(e).__name__}: {str(e)[:500]}"}
    ctx.write(res)
    return 0


def cmd_install(args: argparse.Namespace) -> int:
    """``install``: unpack the missing wheels, print and write the report."""
    wheels = Path(args.wheels)
    report = (install_wheels(wheels, Path(args.target)) if wheels.is_dir()
              else {"installed": {}, "present": {}, "no_compatible_wheel": [], "note": f"no {wheels}/"})
    report["python"] = sys.version.split()[0]
    print(json.dumps(report, indent=1))
    if args.report:
        Path(args.report).write_text(json.dumps(report))
    return 0


def cmd_cli(args: argparse.Namespace) -> int:
    """``trainer.cli.main(args.rest)``; with ``--sandbox process`` the task sandboxes default to the
    ``process`` isolation (the check's fallback where bwrap cannot run; recorded in the summary)."""
    if args.sandbox == "process":
        import dataclasses

        import environments.sandbox as sb

        @dataclasses.dataclass(frozen=True)
        class ProcessSandboxConfig(sb.SandboxConfig):
            """:class:`SandboxConfig` defaulting to ``isolation="process"``."""

            isolation: str = "process"

        sb.SandboxConfig = ProcessSandboxConfig  # read by trainer.tasks.math_tool at start()
    from trainer.cli import main

    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    return main(rest)


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and dispatch."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    i = sub.add_parser("install")
    i.add_argument("--wheels", default=str(REPO / ".gpu_wheels"))
    i.add_argument("--target", required=True)
    i.add_argument("--report", default="")
    for name in ("run", "step"):
        s = sub.add_parser(name)
        if name == "step":
            s.add_argument("name")
            s.add_argument("--result", required=True)
            s.add_argument("--deadline", type=float, required=True)
        s.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
        s.add_argument("--work", default="")
        s.add_argument("--run-steps", type=int, default=10, help="RL steps of step run10")
        s.add_argument("--warm-start-steps", type=int, default=100, help="SFT steps of step run10")
        s.add_argument("--eval-samples", type=int, default=8, help="eval.num_samples of step run10")
        if name == "run":
            s.add_argument("--out", default=os.environ.get("OUT", ""))
            s.add_argument("--budget-s", type=float, default=450.0, help="wall-clock budget of all steps")
            s.add_argument("--steps", default="", help="comma-separated subset (env always runs)")
            s.add_argument("--wheel-report", default="")
    c = sub.add_parser("cli")
    c.add_argument("--sandbox", choices=("bwrap", "process"), default="bwrap")
    c.add_argument("rest", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    if args.cmd == "run" and not args.out:
        args.out = tempfile.mkdtemp(prefix="gpu_check_out_")
    return {"install": cmd_install, "run": cmd_run, "step": cmd_step, "cli": cmd_cli}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
