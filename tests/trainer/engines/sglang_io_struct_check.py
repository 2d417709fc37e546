"""Run by ``test_sglang_io_struct.py`` with the interpreter of ``.venv-sglang-types`` (the ``sglang``
package installed ``--no-deps``, plus pydantic): checks request bodies against SGLang's own request
dataclasses (``sglang/srt/managers/io_struct.py``) and returns SGLang-built response pieces.

Standard library + pydantic only; it must not import the project (it runs in another virtualenv).

``import sglang.srt.managers.io_struct`` does not work without SGLang's CUDA dependencies: the package
``__init__`` imports numpy/tqdm/IPython/aiohttp..., ``sglang.srt.utils.common`` imports torch and
triton at module level, and ``io_struct`` imports ``schedule_batch``, whose imports reach
``sglang.srt.layers.moe`` -> ``sgl_kernel`` (CUDA kernels: ``common_ops`` needs ``libnvrtc.so.12``).
So this script tries that import first (and reports its error), then executes SGLang's own
``io_struct.py`` and ``sampling_params.py`` source files, with the five names ``io_struct`` imports
from torch-importing modules (``LoRARef``, ``BaseFinishReason``, ``has_valid_data``, ``ImageData``,
``flatten_nested_list``) taken from their definitions in SGLang's source with ``ast``. The request
classes are therefore SGLang's own dataclasses (fields, defaults, ``__post_init__``, methods).

Input (stdin, JSON): ``{"bodies": [{"endpoint": "/generate", "body": {...} | null}, ...],
"logprobs": {"val": [...], "idx": [...]}, "vocab_size": int}``.
Output (stdout, JSON): ``{"version", "import_error", "results": [{"endpoint", "class", "unknown",
"missing", "error", "effective_sampling"}], "finish_reasons": {...}, "output_token_logprobs": [...]}``.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.metadata
import importlib.util
import json
import sys
import types
import typing
from pathlib import Path

ROOT = Path(importlib.util.find_spec("sglang").submodule_search_locations[0])  # not executed


def definitions(rel: str, names: set[str], ns: dict | None = None) -> dict:
    """Execute only the top-level definitions ``names`` of SGLang's ``rel`` source file (no imports
    of that module run) in a namespace with ``typing``/``dataclasses``; returns the namespace."""
    tree = ast.parse((ROOT / rel).read_text(), rel)
    nodes = [n for n in tree.body if getattr(n, "name", None) in names]
    found = {n.name for n in nodes}
    if found != names:
        raise SystemExit(f"{rel}: definitions {sorted(names - found)} not found")
    ns = {**vars(typing), "dataclass": dataclasses.dataclass, "field": dataclasses.field,
          "fields": dataclasses.fields, **(ns or {})}
    exec(compile(ast.Module(body=nodes, type_ignores=[]), str(ROOT / rel), "exec"), ns)
    return ns


def method(rel: str, cls: str, name: str):
    """A method of a class in SGLang's ``rel`` source file, as a plain function."""
    tree = ast.parse((ROOT / rel).read_text(), rel)
    klass = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    fn = next(n for n in klass.body if isinstance(n, ast.FunctionDef) and n.name == name)
    ns = dict(vars(typing))
    exec(compile(ast.Module(body=[fn], type_ignores=[]), str(ROOT / rel), "exec"), ns)
    return ns[name]


def load_file(modname: str, rel: str) -> types.ModuleType:
    """Import SGLang's ``rel`` source file as module ``modname``."""
    spec = importlib.util.spec_from_file_location(modname, ROOT / rel)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[modname] = mod
    spec.loader.exec_module(mod)
    return mod


def module(name: str, **attrs) -> types.ModuleType:
    """Register a package/module ``name`` holding ``attrs``."""
    mod = sys.modules.get(name) or types.ModuleType(name)
    mod.__path__ = []
    vars(mod).update(attrs)
    sys.modules[name] = mod
    return mod


def load_io_struct() -> tuple[types.ModuleType, types.ModuleType, dict, str | None]:
    """(io_struct, sampling_params, finish-reason classes, error of the real import or None)."""
    try:
        import sglang.srt.managers.io_struct as io  # works where SGLang's CUDA dependencies are installed
        import sglang.srt.managers.schedule_batch as sb
        import sglang.srt.sampling.sampling_params as sp
        return io, sp, vars(sb), None
    except Exception as e:  # any import failure: report it, use the source files instead
        import_error = f"{type(e).__name__}: {e}"
    for name in list(sys.modules):
        if name == "sglang" or name.startswith("sglang."):
            del sys.modules[name]
    common = definitions("srt/utils/common.py", {"ImageData", "flatten_nested_list"})
    finish = definitions("srt/managers/schedule_batch.py", {
        "BaseFinishReason", "FINISH_MATCHED_TOKEN", "FINISH_MATCHED_STR", "FINISH_LENGTH", "FINISH_ABORT"})
    mm = definitions("srt/multimodal/mm_utils.py", {"has_valid_data"},
                     {"flatten_nested_list": common["flatten_nested_list"]})
    lora = definitions("srt/lora/lora_registry.py", {"LoRARef"}, {"uuid4": __import__("uuid").uuid4})
    for pkg in ("sglang", "sglang.srt", "sglang.srt.lora", "sglang.srt.managers", "sglang.srt.multimodal",
                "sglang.srt.sampling"):
        module(pkg)
    module("sglang.srt.utils", ImageData=common["ImageData"],
           flatten_nested_list=common["flatten_nested_list"])
    module("sglang.srt.lora.lora_registry", LoRARef=lora["LoRARef"])
    module("sglang.srt.managers.schedule_batch", BaseFinishReason=finish["BaseFinishReason"])
    module("sglang.srt.multimodal.mm_utils", has_valid_data=mm["has_valid_data"])
    sp = load_file("sglang.srt.sampling.sampling_params", "srt/sampling/sampling_params.py")
    io = load_file("sglang.srt.managers.io_struct", "srt/managers/io_struct.py")
    return io, sp, finish, import_error


def route_classes() -> dict[str, str | None]:
    """Endpoint path -> the request dataclass its handler in ``srt/entrypoints/http_server.py``
    takes as ``obj`` (None: the handler takes no body), read from SGLang's routing with ``ast``."""
    tree = ast.parse((ROOT / "srt/entrypoints/http_server.py").read_text())
    out: dict[str, str | None] = {}
    for fn in tree.body:
        if not isinstance(fn, ast.AsyncFunctionDef | ast.FunctionDef):
            continue
        obj = next((a for a in fn.args.args if a.arg == "obj"), None)
        cls = ast.unparse(obj.annotation) if obj is not None and obj.annotation is not None else None
        for dec in fn.decorator_list:
            if isinstance(dec, ast.Call) and dec.args and isinstance(dec.args[0], ast.Constant):
                out[str(dec.args[0].value)] = cls
    return out


def check(io: types.ModuleType, sp: types.ModuleType, routes: dict, endpoint: str, body: object,
          vocab_size: int) -> dict:
    """Validate one body the way SGLang's HTTP server and tokenizer manager do."""
    res: dict = {"endpoint": endpoint, "class": None, "unknown": [], "missing": [], "error": None}
    if endpoint not in routes:
        res["error"] = f"SGLang's http_server.py has no route {endpoint}"
        return res
    cls_name = res["class"] = routes[endpoint]
    if cls_name is None:
        if body not in (None, {}):
            res["error"] = f"{endpoint} takes no body; sent {body!r}"
        return res
    cls = getattr(io, cls_name)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    res["unknown"] = sorted(set(body) - set(fields))  # FastAPI/pydantic would drop these silently
    res["missing"] = sorted(n for n, f in fields.items() if n not in body and f.init
                            and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
    try:
        import pydantic  # FastAPI validates a dataclass body with pydantic
        obj = pydantic.TypeAdapter(cls).validate_python(body)
        direct = cls(**body)  # and the dataclass itself accepts exactly these keywords
        if cls_name == "GenerateReqInput":
            direct.normalize_batch_and_arguments()  # tokenizer_manager.generate_request
            params = sp.SamplingParams(**direct.sampling_params)  # _create_tokenized_object
            params.normalize(None)
            params.verify(vocab_size)
            res["effective_sampling"] = {k: getattr(params, k) for k in (
                "temperature", "top_p", "top_k", "max_new_tokens", "stop_strs", "no_stop_trim", "ignore_eos",
                "skip_special_tokens", "sampling_seed")}
            res["return_text_in_logprobs"] = direct.return_text_in_logprobs
        del obj
    except Exception as e:
        res["error"] = f"{type(e).__name__}: {e}"[:1000]
    return res


def main() -> None:
    """Read the request (stdin), print the report (stdout)."""
    req = json.load(sys.stdin)
    io, sp, finish, import_error = load_io_struct()
    routes = route_classes()
    results = [check(io, sp, routes, b["endpoint"], b["body"], req["vocab_size"]) for b in req["bodies"]]
    detok = method("srt/managers/tokenizer_manager.py", "TokenizerManager", "detokenize_logprob_tokens")
    reasons = {
        "eos": finish["FINISH_MATCHED_TOKEN"](matched=req["eos_id"]).to_json(),
        "stop": finish["FINISH_MATCHED_STR"](matched=req["stop_str"]).to_json(),
        "length": finish["FINISH_LENGTH"](length=len(req["logprobs"]["idx"])).to_json(),
        "abort": finish["FINISH_ABORT"](message="Abort before prefill").to_json(),
        "nan": finish["FINISH_MATCHED_STR"](matched="NaN happened").to_json(),  # _check_vocab_boundary_finish
    }
    json.dump({"version": importlib.metadata.version("sglang"), "import_error": import_error,
               "results": results, "finish_reasons": reasons,
               "output_token_logprobs": detok(None, req["logprobs"]["val"], req["logprobs"]["idx"], False)},
              sys.stdout)


if __name__ == "__main__":
    main()
