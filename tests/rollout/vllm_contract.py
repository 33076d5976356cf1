"""vLLM's own environment for the tests (``.venv-vllm``, built by `make .venv-vllm`), a stand-in server that records what
vlrl's client sends, and the replay of those calls through vLLM's own code (`vllm_contract_check.py`)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

ROOT = Path(__file__).resolve().parents[2]
VLLM_VENV = ROOT / ".venv-vllm"
STAMP = VLLM_VENV / "bin" / ".vllm-installed"
CHECK = Path(__file__).with_name("vllm_contract_check.py")


def vllm_python() -> tuple[Path | None, str]:
    """(vLLM's interpreter, "") when `make .venv-vllm` finished; else (None, why the tests that need it skip)."""
    if STAMP.is_file():
        return VLLM_VENV / "bin" / "python", ""
    return None, (f"{VLLM_VENV} is not built (`make .venv-vllm`; `make test` builds it, which needs PyPI): the tests "
                  "against a real vLLM skip")


def replay(python: Path, calls: dict, broadcasts: list[torch.Tensor], work: Path, timeout: float = 300) -> dict:
    """Run `vllm_contract_check.py` in vLLM's environment on ``calls`` ({"generate": [bodies], "rl": [{method, path,
    body}]}) and the tensors the trainer broadcast, in order; its report."""
    from safetensors.torch import save_file

    (work / "calls.json").write_text(json.dumps(calls))
    tensors = work / "broadcasts.safetensors"
    if broadcasts:
        save_file({f"t{i}": t.detach().cpu().contiguous() for i, t in enumerate(broadcasts)}, tensors)
    done = subprocess.run([str(python), str(CHECK), str(work / "calls.json"), str(tensors) if broadcasts else "-",
                           str(work / "out.json")], capture_output=True, text=True, timeout=timeout,
                          env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "HOME": str(Path.home())})
    if done.returncode != 0:
        raise RuntimeError(f"vllm_contract_check.py failed ({done.returncode}): {done.stderr[-3000:]}")
    return json.loads((work / "out.json").read_text())


def recording_vllm(calls: list[dict], *, dtype: str = "float32", max_num_seqs: int = 8):
    """A FastAPI app answering like a vLLM 0.32 server in dev mode and recording every call (method, path with its
    query, JSON body) into ``calls``; each weight answer is what vLLM's route returns on success."""
    app = FastAPI()
    state = {"version": "default"}
    info = {"vllm_config": {"model_config": {"dtype": f"torch.{dtype}", "logprobs_mode": "raw_logprobs",
                                             "model": "/model"},
                            "scheduler_config": {"max_num_seqs": max_num_seqs},
                            "parallel_config": {"tensor_parallel_size": 1, "data_parallel_size": 1,
                                                "pipeline_parallel_size": 1}}}

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def any_call(path: str, request: Request):
        raw = await request.body()
        body = json.loads(raw) if raw else None
        full = "/" + path + (f"?{request.url.query}" if request.url.query else "")
        if path == "server_info":
            return JSONResponse(info)
        calls.append({"method": request.method, "path": full, **({"body": body} if body is not None else {})})
        if path == "update_weight_version":
            state["version"] = body["new_version"]
            return JSONResponse({"success": True, "new_version": body["new_version"]})
        if path == "finish_weight_update" and body and body.get("weight_version"):
            state["version"] = body["weight_version"]
        if path == "weight_info":
            return JSONResponse({"weight_version": state["version"]})
        if path == "collective_rpc":
            return JSONResponse({"results": [None]})
        return JSONResponse({"message": "ok"})

    return app
