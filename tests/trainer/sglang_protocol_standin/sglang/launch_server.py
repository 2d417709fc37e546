"""PROTOCOL STAND-IN for ``python -m sglang.launch_server`` (tests only; see __init__).

Model: 260 tokens (0..255 are bytes, 259 is EOS); next-token logits depend on the
previous token, the loaded weights path and, for a request naming a LoRA adapter
(``lora_path``), on the adapter's tensors (:func:`adapter_phase`). Sampling follows SGLang's documented rule:
the token is drawn from softmax(logits / T) truncated by top-k/top-p, and the reported
log-prob is log_softmax(logits / T)[token] before truncation.

LoRA as SGLang serves it (docs ``advanced_features/lora``): ``--enable-lora``, ``--max-lora-rank``,
``--lora-target-modules``, ``--lora-paths NAME=DIR``; ``/load_lora_adapter {lora_name, lora_path}``
reads a PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``) and refuses
one SGLang would refuse (LoRA not enabled, rank above the maximum, a module not enabled, a name in
use); ``/unload_lora_adapter {lora_name}``; a ``/generate`` naming an adapter not loaded fails.

Environment knobs: STANDIN_MODE=crash|hang (start-up failures), STANDIN_TOKEN_DELAY_S.
Test-only control endpoints live under /_standin/ (``trickle_s``: the next /generate answers
are streamed one byte every ``trickle_s`` seconds, a server that is slow but never idle).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import subprocess
import sys
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

VOCAB, EOS = 260, 259


def logits(prev: int, phase: float) -> list[float]:
    """Next-token logits of the stand-in model."""
    return [3.0 * math.cos(0.37 * prev + 0.11 * v + phase) for v in range(VOCAB)]


def log_softmax(xs: list[float]) -> list[float]:
    """Numerically stable log-softmax."""
    m = max(xs)
    z = m + math.log(sum(math.exp(x - m) for x in xs))
    return [x - z for x in xs]


def adapter_phase(tensors: dict) -> float:
    """The logit phase a LoRA adapter adds: 0.1 × the sum of all its tensor entries, rounded to 1e-6
    (a test recomputes it from the tensors it sent)."""
    return round(0.1 * sum(float(t.astype("float64").sum()) for t in tensors.values()), 6)


def read_adapter(path: str, max_rank: int | None, modules: list[str]) -> tuple[dict, float]:
    """``(adapter_config, phase)`` of a PEFT adapter directory, or ValueError as SGLang would refuse it."""
    import json

    from safetensors.numpy import load_file

    if max_rank is None:
        raise ValueError("LoRA is not enabled (start the server with --enable-lora)")
    cfg_file = os.path.join(path, "adapter_config.json")
    weights = os.path.join(path, "adapter_model.safetensors")
    if not (os.path.isfile(cfg_file) and os.path.isfile(weights)):
        raise ValueError(f"no PEFT adapter in {path}")
    with open(cfg_file) as f:
        cfg = json.load(f)
    if cfg.get("peft_type") != "LORA" or int(cfg["r"]) > max_rank:
        raise ValueError(f"LoRA rank {cfg.get('r')} is greater than max_lora_rank {max_rank}")
    tensors = load_file(weights)
    for name, t in tensors.items():
        module = name.split(".lora_")[0].rsplit(".", 1)[-1]
        if not name.startswith("base_model.model.") or (modules != ["all"] and module not in modules):
            raise ValueError(f"adapter tensor {name}: module {module!r} is not in --lora-target-modules")
        if ".lora_A." in name and t.shape[0] != int(cfg["r"]):
            raise ValueError(f"adapter tensor {name} has rank {t.shape[0]}, config r={cfg['r']}")
    return cfg, adapter_phase(tensors)


def decode(ids: list[int]) -> str:
    """Bytes 0..255 decode to latin-1 characters; specials to nothing."""
    return "".join(chr(t) for t in ids if t < 256)


def main() -> None:
    """Parse SGLang-style flags and serve."""
    p = argparse.ArgumentParser()
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--mem-fraction-static", type=float)
    p.add_argument("--dtype")
    p.add_argument("--random-seed", type=int)
    p.add_argument("--sampling-backend")
    p.add_argument("--attention-backend")
    p.add_argument("--enable-lora", action="store_true")
    p.add_argument("--max-lora-rank", type=int)
    p.add_argument("--lora-target-modules", nargs="*", default=[])
    p.add_argument("--max-loras-per-batch", type=int, default=8)
    p.add_argument("--lora-paths", nargs="*", default=[])
    args, unknown = p.parse_known_args()
    max_rank = args.max_lora_rank if args.enable_lora else None
    print(f"stand-in argv: {sys.argv[1:]}", flush=True)
    mode = os.environ.get("STANDIN_MODE", "ok")
    # Like SGLang's scheduler/detokenizer: a child process in the same group.
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    print(f"stand-in child pid={child.pid}", flush=True)
    if mode == "crash":
        print("stand-in: simulated fatal error: CUDA out of memory", flush=True)
        sys.exit(3)
    if mode == "hang":
        print("stand-in: hanging before serving", flush=True)
        time.sleep(3600)

    delay = float(os.environ.get("STANDIN_TOKEN_DELAY_S", "0"))
    state = {"model_path": args.model_path, "weight_version": "default", "running": 0,
             "requests": [], "fail": [], "respond": [], "script": [], "trickle_s": 0.0, "loras": {}}
    for spec in args.lora_paths:  # NAME=DIR, loaded at start-up
        name, _, path = spec.partition("=")
        phase0 = read_adapter(path, max_rank, args.lora_target_modules)[1]
        state["loras"][name] = {"path": path, "phase": phase0}
    unpaused = asyncio.Event()
    unpaused.set()
    app = FastAPI()

    def phase() -> float:
        return (sum(state["model_path"].encode()) % 97) * 0.05

    @app.middleware("http")
    async def record_and_fail(request: Request, call_next):
        if not request.url.path.startswith("/_standin"):
            body = await request.body()
            state["requests"].append({"path": request.url.path, "body": body.decode() or None})
            if state["fail"]:
                status = state["fail"].pop(0)
                return PlainTextResponse(f"stand-in injected failure {status}", status_code=status)
        return await call_next(request)

    @app.get("/health")
    @app.get("/health_generate")
    async def health():
        return PlainTextResponse("")

    @app.get("/server_info")
    async def server_info():
        return {"version": "0.5.6", "argv": sys.argv[1:], "unknown_args": unknown,
                "loaded_loras": {k: v["path"] for k, v in state["loras"].items()},
                "model_path": state["model_path"], "weight_version": state["weight_version"],
                "child_pid": child.pid, "pid": os.getpid(), "random_seed": args.random_seed}

    @app.post("/generate")
    async def generate(request: Request):
        req = await request.json()
        if state["respond"]:
            return JSONResponse(state["respond"].pop(0))
        if state["trickle_s"]:
            async def trickle(gap=state["trickle_s"]):
                for b in b'{"text": "' + b" " * 10_000 + b'"}':
                    await asyncio.sleep(gap)
                    yield bytes([b])
            return StreamingResponse(trickle(), media_type="application/json")
        await unpaused.wait()
        ids, sp = req["input_ids"], req.get("sampling_params", {})
        lora = req.get("lora_path")
        if lora is not None and lora not in state["loras"]:
            return JSONResponse({"error": {"message": f"The following requested LoRA adapters are not "
                                                      f"loaded: {lora}"}}, status_code=400)
        extra = state["loras"][lora]["phase"] if lora is not None else 0.0
        temp, top_p, top_k = sp.get("temperature", 1.0), sp.get("top_p", 1.0), sp.get("top_k", -1)
        max_new, stops = sp.get("max_new_tokens", 128), sp.get("stop") or []
        rng = random.Random(sp.get("sampling_seed", len(state["requests"])))
        script = state["script"].pop(0) if state["script"] else None
        state["running"] += 1
        out, lps, finish = [], [], None
        try:
            prev = ids[-1]
            while finish is None:
                lp = log_softmax([x / temp for x in logits(prev, phase() + extra)])
                if script is not None:
                    tok = script[len(out)]
                else:
                    order = sorted(range(VOCAB), key=lambda v: -lp[v])
                    order = order[:top_k] if top_k > 0 else order
                    kept, mass = [], 0.0
                    for v in order:
                        if mass >= top_p:
                            break
                        kept.append(v)
                        mass += math.exp(lp[v])
                    tok = rng.choices(kept, weights=[math.exp(lp[v]) for v in kept])[0]
                out.append(tok)
                lps.append(lp[tok])
                prev = tok
                text = decode(out)
                if tok == EOS and not sp.get("ignore_eos", False):
                    finish = {"type": "stop", "matched": EOS}
                elif any(s in text for s in stops):
                    finish = {"type": "stop", "matched": next(s for s in stops if s in text)}
                elif len(out) >= max_new:
                    finish = {"type": "length", "length": len(out)}
                if delay:
                    await asyncio.sleep(delay)
        finally:
            state["running"] -= 1
        return {"text": decode(out), "output_ids": out,
                "meta_info": {"id": "standin", "finish_reason": finish, "prompt_tokens": len(ids),
                              "completion_tokens": len(out), "weight_version": state["weight_version"],
                              "output_token_logprobs": [[lp, t, None]
                                                        for lp, t in zip(lps, out, strict=True)]}}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        if state["running"]:
            return PlainTextResponse("running requests", status_code=400)
        return PlainTextResponse("Cache flushed.\n")

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request):
        req = await request.json()
        if not os.path.isdir(req.get("model_path", "")):
            return JSONResponse({"success": False, "message": f"no such path {req.get('model_path')}",
                                 "num_paused_requests": 0}, status_code=400)
        state["model_path"] = req["model_path"]
        state["weight_version"] = req.get("weight_version") or state["weight_version"]
        return {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        req = await request.json()
        name, path = req.get("lora_name", ""), req.get("lora_path", "")
        try:
            if name in state["loras"]:
                raise ValueError(f"LoRA adapter {name!r} is already loaded")
            phase_ = read_adapter(path, max_rank, args.lora_target_modules)[1]
        except (ValueError, KeyError, OSError) as e:
            return JSONResponse({"success": False, "error_message": str(e), "loaded_adapters": None},
                                status_code=400)
        state["loras"][name] = {"path": path, "phase": phase_}
        return {"success": True, "error_message": None,
                "loaded_adapters": {k: v["path"] for k, v in state["loras"].items()}}

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        name = (await request.json()).get("lora_name", "")
        if state["loras"].pop(name, None) is None:
            return JSONResponse({"success": False, "error_message": f"LoRA adapter {name!r} is not loaded",
                                 "loaded_adapters": None}, status_code=400)
        return {"success": True, "error_message": None,
                "loaded_adapters": {k: v["path"] for k, v in state["loras"].items()}}

    @app.post("/init_weights_update_group")
    async def init_group(request: Request):
        req = await request.json()
        ok = all(k in req for k in ("master_address", "master_port", "rank_offset", "world_size"))
        return JSONResponse({"success": ok, "message": "ok" if ok else "missing field"},
                            status_code=200 if ok else 400)

    @app.post("/update_weights_from_distributed")
    async def update_distributed(request: Request):
        req = await request.json()
        ok = len(req["names"]) == len(req["dtypes"]) == len(req["shapes"])
        if ok and req.get("weight_version"):
            state["weight_version"] = req["weight_version"]
        return JSONResponse({"success": ok, "message": "ok" if ok else "misaligned"},
                            status_code=200 if ok else 400)

    @app.post("/destroy_weights_update_group")
    async def destroy_group():
        return {"success": True, "message": "ok"}

    @app.post("/pause_generation")
    async def pause():
        unpaused.clear()
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def resume():
        unpaused.set()
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.get("/_standin/requests")
    async def requests_log():
        return state["requests"]

    @app.post("/_standin/control")
    async def control(request: Request):
        req = await request.json()
        if req.get("reset"):
            state["requests"].clear()
        state["fail"] = list(req.get("fail", []))
        state["respond"] = list(req.get("respond", []))
        state["script"] = list(req.get("script", []))
        state["trickle_s"] = float(req.get("trickle_s", 0.0))
        return {"ok": True}

    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
