"""What ``copc eval`` evaluates, recorded in ``eval_settings.json`` so that ``--resume`` continues the
same policy: the weights' hash, and the hash of every file that shapes the prompts and the model
beside them (``config.json``, ``generation_config.json``, the tokenizer and its chat templates).
"""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..models.pull.manifest import sha256_file

#: Suffixes of weight files (hashed together into ``weights_sha256``).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".distcp")
#: Files of a model directory that change neither the prompts nor the model (not hashed).
_NOT_POLICY = ("copc_manifest.json", ".gitattributes")


def files_sha256(root: Path, keep: Any) -> str:
    """Hex SHA-256 over the relative name and bytes of every file under ``root`` (recursively, in
    name order) for which ``keep(path)`` is true."""
    digest = hashlib.sha256()
    for f in sorted(p for p in root.rglob("*") if p.is_file() and keep(p)):
        digest.update(f.relative_to(root).as_posix().encode() + b"\0")
        with f.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def model_files(model_dir: Path) -> dict[str, str]:
    """``{relative path: sha256}`` of every file under ``model_dir`` that is not a weight file, the
    pull manifest or documentation (``*.md``): ``config.json``, the tokenizer, its chat templates
    (``chat_template.jinja``, ``additional_chat_templates/*``, ``tokenizer_config.json``), ...."""
    out = {}
    for f in sorted(p for p in model_dir.rglob("*") if p.is_file()):
        if f.suffix in WEIGHT_SUFFIXES or f.suffix == ".md" or f.name in _NOT_POLICY:
            continue
        out[f.relative_to(model_dir).as_posix()] = sha256_file(f)
    return out


def policy_identity(args: argparse.Namespace, model_dir: str | Path | None = None) -> dict:
    """What is evaluated, for ``eval_settings.json``.

    Args:
        args: ``copc eval``'s flags (``endpoint``/``tokenizer``, ``model`` or ``checkpoint``).
        model_dir: the directory whose config and tokenizer a training checkpoint is evaluated with
            (default: the ``--model`` / ``--checkpoint`` directory itself).

    Returns:
        ``{"source": "--endpoint", "url": ..., "tokenizer": resolved dir, "tokenizer_sha256": ...}``
        (the tokenizer makes the prompt ids the server sees; its hash covers every file directly in
        that directory but weight files), or ``{"source": "--model" | "--checkpoint", "path": resolved
        dir, "weights_sha256": ..., "model_dir": resolved dir, "model_files": {name: sha256}}`` where
        ``weights_sha256`` covers the relative name and bytes of every weight file (``*.safetensors``,
        ``*.bin``, ``*.pt``, ``*.pth``, ``*.distcp``) under ``path``, sub-directories included (sharded
        learner state), in name order (a checkpoint's step is its path), and ``model_files`` hashes
        ``config.json`` and the tokenizer files of ``model_dir`` one by one (:func:`model_files`).
    """
    if args.endpoint:
        tok = Path(args.tokenizer).resolve() if args.tokenizer else None
        return {"source": "--endpoint", "url": str(args.endpoint).rstrip("/"), "tokenizer": str(tok),
                "tokenizer_sha256": None if tok is None else files_sha256(
                    tok, lambda f: f.parent == tok and f.suffix not in WEIGHT_SUFFIXES)}
    flag, path = ("--model", args.model) if args.model else ("--checkpoint", args.checkpoint)
    path = Path(path).resolve()
    mdir = Path(model_dir).resolve() if model_dir is not None else path
    return {"source": flag, "path": str(path),
            "weights_sha256": files_sha256(path, lambda f: f.suffix in WEIGHT_SUFFIXES),
            "model_dir": str(mdir), "model_files": model_files(mdir)}


def _changed_file(old: dict, new: dict) -> str | None:
    """One phrase naming the first config/tokenizer file that differs between the records, or None.
    A record written before ``model_files`` existed has nothing to compare (None)."""
    before, now = old.get("model_files"), new.get("model_files") or {}
    if not isinstance(before, dict):
        return None
    changed = sorted(n for n in set(before) | set(now) if before.get(n) != now.get(n))
    if not changed:
        return None
    name, more = changed[0], f" (and {len(changed) - 1} more file(s))" if len(changed) > 1 else ""
    if name not in now:
        return f"{name} was removed from {new.get('model_dir')}{more}"
    if name not in before:
        return f"{name} was added to {new.get('model_dir')}{more}"
    return f"{name} changed (sha256 {before[name][:12]}… → {now[name][:12]}…){more}"


def check_policy(out: Path, old: dict | None, new: dict, shown: str, tokenizer: str | None) -> None:
    """Refuse resuming ``out`` (recorded policy ``old``) with the policy ``new``.

    Args:
        out: the evaluation directory. old: its recorded ``policy`` (None: nothing recorded).
        new: :func:`policy_identity` now. shown: the flag's value as given. tokenizer: ``--tokenizer``
            as given.

    Raises:
        ConfigError: one line naming the flag and what changed: another source or directory, another
            directory for the config and tokenizer, the weights, or the first config/tokenizer/chat
            template file that changed, was added or removed (by name).
    """
    if not old or old == new:
        return
    if new["source"] == "--endpoint" and old.get("source") == new["source"] and old.get("url") == new["url"]:
        raise ConfigError(f"--tokenizer={tokenizer!r}: the run in {out} evaluated {new['url']} with the "
                          f"tokenizer {old.get('tokenizer')} (tokenizer_sha256 "
                          f"{old.get('tokenizer_sha256')}); --resume must build the same prompts")
    same_dir = old.get("source") == new["source"] and old.get("path") == new.get("path")
    if same_dir and old.get("model_dir", new.get("model_dir")) != new.get("model_dir"):
        why = f"the run in {out} read its config and tokenizer from {old['model_dir']}, now from " \
              f"{new.get('model_dir')}; --resume must evaluate the same policy"
    elif same_dir and old.get("weights_sha256") != new.get("weights_sha256"):
        why = f"its weights changed since the run in {out} (weights_sha256 {old.get('weights_sha256')} → " \
              f"{new.get('weights_sha256')}); --resume must evaluate the same policy"
    elif same_dir and (what := _changed_file(old, new)) is not None:
        why = f"its {what} since the run in {out}; --resume must evaluate the same policy (config and chat " \
              "template included)"
    elif same_dir:
        return  # the same weights and files (a record of an older copc: weights only)
    else:
        what = old.get("url") or old.get("path")
        why = f"the run in {out} evaluated {old.get('source')} {what}; --resume must evaluate the same policy"
    raise ConfigError(f"{new['source']}={shown!r}: {why}")
