"""Runs in vLLM's own environment (``.venv-vllm``, `make .venv-vllm`), never in vlrl's: replays the calls vlrl's client
made against vLLM 0.32's own code, and reports what vLLM made of them.

    python vllm_contract_check.py CALLS.json BROADCASTS.safetensors OUT.json

- every ``/inference/v1/generate`` body is validated by vLLM's ``GenerateRequest`` (pydantic, with its msgspec
  ``SamplingParams``) and the parsed sampling parameters are reported;
- every RL call (pause/resume, versions, ``/collective_rpc`` reload, the NCCL weight transfer) goes, in vlrl's order,
  through vLLM's real FastAPI routers (``entrypoints/rl/online/api_router.py``, ``entrypoints/serve/dev/rpc``), its
  real ``AsyncLLM`` methods and its real GPU ``Worker`` methods with its real ``NCCLWeightTransferEngine`` — only
  the engine-core transport, NCCL itself and the model are stand-ins: the group's broadcasts hand out, in order, the
  tensors vlrl's trainer broadcast (BROADCASTS: ``t0``, ``t1``, …), and the model records what ``load_weights`` got.
"""

from __future__ import annotations

import hashlib
import json
import sys
import types


def _sha(tensor) -> str:
    return hashlib.sha256(tensor.contiguous().view(-1).view(__import__("torch").uint8).numpy()).hexdigest()


def check_generate(bodies: list[dict]) -> list[dict]:
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest

    out = []
    for body in bodies:
        try:
            request = GenerateRequest.model_validate(body)
        except Exception as err:  # noqa: BLE001 - reported to the test, which fails on it
            out.append({"error": str(err)[:2000]})
            continue
        params = request.sampling_params
        out.append({"error": None, "sampling_params": {
            "n": params.n, "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
            "max_tokens": params.max_tokens, "stop": params.stop, "stop_token_ids": params.stop_token_ids,
            "ignore_eos": params.ignore_eos, "logprobs": params.logprobs, "detokenize": params.detokenize,
            "logit_bias": {str(k): v for k, v in (params.logit_bias or {}).items()}},
            "token_ids": request.token_ids, "content_parts": request.content_parts,
            "return_token_ids": request.return_token_ids})
    return out


def build_app(broadcasts: list, events: list, received: dict):
    """vLLM's RL and dev RPC routers over its real AsyncLLM and Worker methods (module docstring)."""
    import torch
    from fastapi import FastAPI

    torch.cuda.current_stream = lambda *a, **k: None  # (the receive loop names a CUDA stream; there is none here)
    torch.accelerator.synchronize = lambda *a, **k: None  # (and waits for the device after each chunk)
    from vllm.config import VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer import nccl_engine
    from vllm.entrypoints.rl.online.api_router import router as rl_router
    from vllm.entrypoints.serve.dev.rpc.api_router import router as rpc_router
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.worker.gpu_worker import Worker

    class Group:  # the trainer's NCCL group as a worker sees it: broadcasts arrive in vlrl's order
        def broadcast(self, tensor, src=0, stream=None):
            sent = broadcasts.pop(0)
            if sent.dtype != tensor.dtype or tuple(sent.shape) != tuple(tensor.shape):
                raise RuntimeError(f"broadcast of {sent.dtype} {tuple(sent.shape)} received as {tensor.dtype} "
                                   f"{tuple(tensor.shape)}")
            tensor.copy_(sent)

        def destroy(self):
            events.append("group destroyed")

    def join(init_info, parallel_config):
        events.append(f"joined rank {init_info.rank_offset + parallel_config.rank} of {init_info.world_size}")
        return Group()

    nccl_engine.worker_init_process_group = join
    reload = __import__("vllm.model_executor.model_loader.reload", fromlist=["x"])
    reload.initialize_layerwise_reload = lambda model: events.append("layerwise reload started")
    reload.finalize_layerwise_reload = lambda model, config: events.append("layerwise reload finished")

    class Model(torch.nn.Module):
        def load_weights(self, weights):
            for name, tensor in weights:
                received[name] = [str(tensor.dtype).removeprefix("torch."), list(tensor.shape), _sha(tensor)]
            return {name for name, _ in weights}

    config = VllmConfig()
    config.weight_transfer_config = WeightTransferConfig(backend="nccl")
    worker = types.SimpleNamespace(vllm_config=config, parallel_config=config.parallel_config, rank=0,
                                   _weight_update_active=False, _weight_update_is_draft=False)
    worker.model_runner = types.SimpleNamespace(
        reset_lora_state=lambda: None,
        reload_weights=lambda **kwargs: events.append(f"reload_weights {json.dumps(kwargs, sort_keys=True)}"))
    worker.weight_transfer_engine = nccl_engine.NCCLWeightTransferEngine(
        config.weight_transfer_config, config, torch.device("cpu"), Model())
    for name in ("init_weight_transfer_engine", "start_weight_update", "_start_weight_update", "update_weights",
                 "finish_weight_update", "shutdown_weight_transfer_engine", "reload_weights",
                 "_check_weight_transfer_engine"):
        setattr(worker, name, types.MethodType(getattr(Worker, name), worker))

    class Engine:  # AsyncLLM's own methods; its engine core (one worker, in this process) is the stand-in
        version, paused = "default", False

        async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
            events.append(f"rpc {method}")
            return [getattr(worker, method)(*args, **(kwargs or {}))]

        async def pause_generation(self, *, mode="abort", clear_cache=True):
            events.append(f"pause {mode}")
            self.paused = True

        async def resume_generation(self):
            events.append("resume")
            self.paused = False

        async def is_paused(self):
            return self.paused

    engine = Engine()
    for name in ("init_weight_transfer_engine", "shutdown_weight_transfer_engine", "start_weight_update",
                 "update_weights", "finish_weight_update"):
        setattr(engine, name, types.MethodType(getattr(AsyncLLM, name), engine))

    async def set_version(version):
        engine.version = version

    async def get_version():
        return engine.version

    engine.engine_core = types.SimpleNamespace(set_weight_version_async=set_version,
                                               get_weight_version_async=get_version)
    engine.update_weight_version = types.MethodType(AsyncLLM.update_weight_version, engine)
    engine.get_weight_version = types.MethodType(AsyncLLM.get_weight_version, engine)
    app = FastAPI()
    app.include_router(rl_router)
    app.include_router(rpc_router)
    app.state.engine_client = engine
    return app


def main(calls_path: str, broadcasts_path: str, out_path: str) -> None:
    from fastapi.testclient import TestClient
    from safetensors.torch import load_file

    calls = json.load(open(calls_path))
    loaded = load_file(broadcasts_path) if broadcasts_path != "-" else {}
    broadcasts = [loaded[f"t{i}"] for i in range(len(loaded))]
    events: list[str] = []
    received: dict[str, list] = {}
    client = TestClient(build_app(broadcasts, events, received), raise_server_exceptions=False)
    responses = []
    for call in calls.get("rl", []):
        response = client.request(call["method"], call["path"], json=call.get("body"))
        is_json = response.headers.get("content-type", "").startswith("application/json")
        responses.append([response.status_code, response.json() if is_json else response.text[:500]])
        events.append(f"{call['method']} {call['path']} -> {response.status_code}")
    json.dump({"generate": check_generate(calls.get("generate", [])), "responses": responses, "events": events,
               "received": received, "broadcasts_left": len(broadcasts)}, open(out_path, "w"))


if __name__ == "__main__":
    main(*sys.argv[1:4])
