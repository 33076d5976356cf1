"""SGLang 0.5.23's own weight-update code, run from its released wheel on the CPU behind a loopback HTTP server.

What runs is SGLang's, unchanged, loaded by path from the wheel (`load_sglang`; the ``sglang`` package itself is never
imported — it needs CUDA kernels and torchvision):

- the scheduler's weight updater and its session (``srt/managers/scheduler_components/weight_updater.py``:
  ``SchedulerWeightUpdaterManager`` — begin / end, the refusal of a bucket outside a session, the flush after an update,
  the weight version it records);
- the model runner's weight updater (``srt/model_executor/model_runner_components/weight_updater.py``: joining the
  group with ``init_custom_process_group`` from ``srt/utils/common.py``, the distributed receive, the bucket reader
  ``FlattenedTensorBucket`` from ``srt/weight_sync/tensor_bucket.py``, leaving the group);
- the request structs (``srt/managers/io_struct.py``) and the HTTP layer's parsing of them into those structs
  (``srt/utils/msgspec_utils.py``), with the routes, status codes and answers of ``srt/entrypoints/http_server.py`` and
  the tokenizer manager's order (``tokenizer_control_mixin.py``: paused → no writer lock; the weight version recorded
  after a successful update).

Stubbed, at the model-runner edge only: the model (`CheckpointModel`: a plain ``nn.Module`` holding the checkpoint's
tensors, whose ``load_weights`` copies each received tensor by its checkpoint name — SGLang's models load by checkpoint
name), the quantization hooks ``begin`` / ``end`` call (``DefaultModelLoader.restore_weights_before_loading`` /
``postprocess_weights``, ``post_load_weights``: counted), the scheduler's ``flush_cache`` (refuses ``--busy-flushes``
times after each pause — the requests an abort or a retraction is still settling — then flushes) and the platform
queries (CPU, no weight cache). ``/update_weights_from_disk`` is not SGLang's code here: it is recorded and answered
400, and the test that drives this server asserts it is never called.

    python tests/rollout/sglang_runtime.py --sglang DIR --model DIR [--busy-flushes N]

prints ``listening on http://127.0.0.1:PORT`` once ready; ``GET /harness/state`` answers every call received (path,
status, the fields that matter), the model's tensors as ``dtype|shape|crc32`` per checkpoint name, the weight version
SGLang's scheduler recorded, and the hook counts.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import concurrent.futures
import enum
import importlib.util
import os
import sys
import types
import zipfile
import zlib
from pathlib import Path
from typing import Annotated, Any

SCHEDULER_UPDATER = "sglang/srt/managers/scheduler_components/weight_updater.py"
RUNNER_UPDATER = "sglang/srt/model_executor/model_runner_components/weight_updater.py"
TENSOR_BUCKET = "sglang/srt/weight_sync/tensor_bucket.py"
IO_STRUCT = "sglang/srt/managers/io_struct.py"
MSGSPEC_UTILS = "sglang/srt/utils/msgspec_utils.py"
COMMON = "sglang/srt/utils/common.py"
NETWORK = "sglang/srt/utils/network.py"
CONSTANTS = "sglang/srt/constants.py"
DISAGGREGATION = "sglang/srt/disaggregation/utils.py"
MEMBERS = (SCHEDULER_UPDATER, RUNNER_UPDATER, TENSOR_BUCKET, IO_STRUCT, MSGSPEC_UTILS, COMMON, NETWORK, CONSTANTS,
           DISAGGREGATION)
STRUCTS = ("BaseReq", "ParallelismInfo", "ChecksumInfo", "PauseGenerationReqInput", "ContinueGenerationReqInput",
           "FlushCacheReqInput", "FlushCacheReqOutput")  # (beside those the scheduler's updater imports)


def extract(wheel: Path, folder: Path) -> Path:
    """The files of the wheel this server loads, under ``folder`` (extracted once)."""
    with zipfile.ZipFile(wheel) as archive:
        for member in MEMBERS:
            target = folder / member
            if not target.exists():
                target.parent.mkdir(parents=True, exist_ok=True)
                partial = target.with_name(f"{target.name}.{os.getpid()}")
                partial.write_bytes(archive.read(member))
                os.replace(partial, target)  # (atomic: a concurrent run reads the whole file or none)
    return folder


# ------------------------------------------------------------------------------------------------ loading by path
def _module(name: str, **attributes: Any) -> types.ModuleType:
    """A module registered as ``name`` in ``sys.modules`` (its parents as empty packages)."""
    parts = name.split(".")
    for k in range(1, len(parts)):
        parent = ".".join(parts[:k])
        if parent not in sys.modules:
            package = types.ModuleType(parent)
            package.__path__ = []
            sys.modules[parent] = package
    module = sys.modules.get(name) or types.ModuleType(name)
    module.__dict__.update(attributes)
    sys.modules[name] = module
    return module


def _load(name: str, path: Path) -> types.ModuleType:
    """SGLang's source file ``path``, executed as module ``name`` (its imports resolved from ``sys.modules``)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    _module(name)  # (the parents)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _definitions(name: str, path: Path, wanted: set[str], namespace: dict[str, Any]) -> types.ModuleType:
    """Module ``name`` holding only the top-level definitions ``wanted`` of ``path`` (and the classes they derive from
    there), run over ``namespace`` — for files whose other imports pull in SGLang's whole runtime (zmq, kernels)."""
    tree = ast.parse(path.read_text())
    defined = {node.name: node for node in tree.body if isinstance(node, (ast.ClassDef, ast.FunctionDef))}
    keep, todo = set(), list(wanted)
    while todo:
        item = todo.pop()
        if item in keep or item not in defined:
            continue
        keep.add(item)
        if isinstance(defined[item], ast.ClassDef):
            todo += [b.id for b in defined[item].bases if isinstance(b, ast.Name)]
    missing = wanted - keep
    if missing:
        raise RuntimeError(f"{path} defines no {sorted(missing)} (another SGLang release?)")
    body = [ast.ImportFrom(module="__future__", names=[ast.alias("annotations")], level=0)]
    body += [node for node in tree.body if getattr(node, "name", None) in keep]
    module = _module(name, **namespace)
    module.__dict__.setdefault("__name__", name)
    exec(compile(ast.fix_missing_locations(ast.Module(body=body, type_ignores=[])), str(path), "exec"), module.__dict__)
    return module


def _imported_names(path: Path, module: str) -> set[str]:
    """The names ``path`` imports from ``module``."""
    return {alias.name for node in ast.parse(path.read_text()).body if isinstance(node, ast.ImportFrom)
            and node.module == module for alias in node.names}


class Hooks:
    """Counts of the model-runner hooks SGLang's session calls (quantized weights are repacked there)."""

    restore = postprocess = post_load = 0


def load_sglang(folder: Path, parallel: Any) -> types.SimpleNamespace:
    """SGLang's weight-update modules from ``folder`` (`extract`), their imports stubbed at the model-runner edge.
    ``parallel``: what ``get_parallel()`` answers (the TP group of this one-rank server)."""
    import typing

    import msgspec
    import torch

    _load("sglang.srt.utils.msgspec_utils", folder / MSGSPEC_UTILS)
    _load("sglang.srt.constants", folder / CONSTANTS)
    _definitions("sglang.srt.disaggregation.utils", folder / DISAGGREGATION, {"DisaggregationMode"}, {"Enum": enum.Enum})
    structs = _imported_names(folder / SCHEDULER_UPDATER, "sglang.srt.managers.io_struct") | set(STRUCTS)
    typing_names = {n: getattr(typing, n) for n in ("Any", "Dict", "List", "Literal", "Optional", "Tuple", "Union")}
    io_struct = _definitions("sglang.srt.managers.io_struct", folder / IO_STRUCT, structs, {
        "msgspec": msgspec, "torch": torch, **typing_names,
        "msgspec_struct_pydantic_core_schema": sys.modules["sglang.srt.utils.msgspec_utils"].msgspec_struct_pydantic_core_schema})
    release = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    common = _definitions("sglang.srt.utils.common_weight_sync", folder / COMMON, {"init_custom_process_group"},
                          {"torch": torch, "torch_release": release})
    network = _definitions("sglang.srt.utils.network", folder / NETWORK, {"NetworkAddress", "_wrap", "_is_ipv6", "_parse_port"},
                           _stdlib("dataclass", "ipaddress", "socket", "Tuple", "Optional", "Union"))
    if "NetworkAddress" not in network.__dict__:
        raise RuntimeError("no NetworkAddress")

    class DefaultModelLoader:  # the model-runner edge: quantization repacking around a session (counted)
        @staticmethod
        def restore_weights_before_loading(model, device):
            Hooks.restore += 1

        @staticmethod
        def postprocess_weights(model, device):
            Hooks.postprocess += 1

    def post_load_weights(model):
        Hooks.post_load += 1

    no_cache = types.SimpleNamespace(weight_cache_mode="off")
    _module("sglang.srt.runtime_context", get_model=lambda: no_cache, get_parallel=lambda: parallel)
    _module("sglang.srt.utils.weight_checker", overall_checksum=lambda checksums: "")
    _module("sglang.srt.configs.load_config", LoadConfig=object)
    _module("sglang.srt.model_loader.loader", DefaultModelLoader=DefaultModelLoader, post_load_weights=post_load_weights,
            get_model_loader=lambda *a, **k: None)
    _module("sglang.srt.model_loader.utils", set_default_torch_dtype=None)
    _module("sglang.srt.model_loader.weight_utils", default_weight_loader=None, get_pp_stage_load_group=lambda: None)
    _module("sglang.srt.platforms", current_platform=types.SimpleNamespace(is_out_of_tree=lambda: False))
    _module("sglang.srt.utils", MultiprocessingSerializer=None, dynamic_import=None,
            get_available_gpu_memory=lambda *a, **k: 0.0, init_custom_process_group=common.init_custom_process_group)
    _module("sglang.srt.utils.patch_torch", monkey_patch_torch_reductions=lambda: None)
    _module("sglang.kernels.ops.gemm.bf16_fp32", hpc_bf16xfp32_gemm_enabled=lambda: False)
    tensor_bucket = _load("sglang.srt.weight_sync.tensor_bucket", folder / TENSOR_BUCKET)
    runner = _load("sglang.srt.model_executor.model_runner_components.weight_updater", folder / RUNNER_UPDATER)
    scheduler = _load("sglang.srt.managers.scheduler_components.weight_updater", folder / SCHEDULER_UPDATER)
    return types.SimpleNamespace(io=io_struct, runner=runner, scheduler=scheduler, tensor_bucket=tensor_bucket)


def _stdlib(*names: str) -> dict[str, Any]:
    import dataclasses
    import ipaddress
    import socket
    import typing

    found = {"dataclass": dataclasses.dataclass, "ipaddress": ipaddress, "socket": socket}
    return {n: found.get(n) or getattr(typing, n) for n in names}


# ------------------------------------------------------------------------------------------------ the server
def checkpoint_model(path: Path) -> Any:
    """`CheckpointModel` over the safetensors of the transformers directory ``path`` (its checkpoint names)."""
    import torch
    from safetensors.torch import load_file

    class CheckpointModel(torch.nn.Module):
        """The model runner's model, replaced by a plain module of the checkpoint's tensors: ``load_weights`` (what
        SGLang's updater calls with each received bucket) copies every tensor in by its checkpoint name."""

        def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
            super().__init__()
            self.tensors = tensors

        def load_weights(self, weights) -> None:
            for name, tensor in weights:
                if name not in self.tensors:
                    raise KeyError(f"no weight named {name!r} in the served checkpoint")
                if tuple(tensor.shape) != tuple(self.tensors[name].shape):
                    raise ValueError(f"{name}: shape {tuple(tensor.shape)}, served {tuple(self.tensors[name].shape)}")
                self.tensors[name].copy_(tensor)

    tensors = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(file))
    return CheckpointModel(tensors)


def digest(tensors: dict[str, Any]) -> dict[str, str]:
    """``dtype|shape|crc32`` of every tensor (what the test compares with the trainer's checkpoint)."""
    out = {}
    for name, tensor in tensors.items():
        flat = tensor.detach().contiguous().reshape(-1)
        out[name] = f"{flat.dtype}|{tuple(tensor.shape)}|{zlib.crc32(memoryview(flat.view(-1).numpy().view('u1'))):08x}"
    return out


class Runtime:
    """One SGLang server's control plane: the tokenizer manager's pause state and writer lock (the HTTP side), and
    the scheduler — one thread, one request at a time, as SGLang's — holding SGLang's ``SchedulerWeightUpdaterManager``
    over a tp worker whose model runner holds SGLang's ``WeightUpdater`` and the `CheckpointModel`."""

    def __init__(self, sglang: types.SimpleNamespace, model: Any, busy_flushes: int) -> None:
        self.sglang, self.model, self.busy_flushes = sglang, model, busy_flushes
        self.calls: list[dict[str, Any]] = []
        self.recorded_version: str | None = None
        self.is_pause, self.engine_paused, self.refusals_left = False, False, 0
        self.writer_lock = asyncio.Lock()  # (the tokenizer manager's model_update_lock.writer_lock)
        self.thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="scheduler")
        self.updater = self._scheduler_updater()

    def _scheduler_updater(self) -> Any:
        runner = types.SimpleNamespace(model=self.model)
        runner.weight_updater = self.sglang.runner.WeightUpdater(
            tp_rank=0, device="cpu", gpu_id=0, model_config=None, custom_weight_loaders={}, get_model=lambda: self.model,
            update_model_fields=lambda *a, **k: None, recapture_cuda_graph=lambda: None, get_model_runner=lambda: runner)
        worker = types.SimpleNamespace(model_runner=runner, weight_update_runners=lambda: [("target", runner)])
        # (TpModelWorker's one-liners, srt/managers/tp_worker.py)
        worker.init_weights_update_group = lambda req: runner.weight_updater.init_weights_update_group(
            req.master_address, req.master_port, req.rank_offset, req.world_size, req.group_name, req.backend)
        worker.destroy_weights_update_group = lambda req: runner.weight_updater.destroy_weights_update_group(
            req.group_name)
        scheduler = types.SimpleNamespace(record_weight_version_change=self._record_version, _engine_paused=False)
        return self.sglang.scheduler.SchedulerWeightUpdaterManager(
            tp_worker=worker, draft_worker=None, memory_saver_adapter=None, flush_cache=self._flush,
            is_fully_idle=lambda **kw: True, scheduler=scheduler)

    def _record_version(self, new_version: str | None = None) -> None:
        if new_version is not None:
            self.recorded_version = new_version

    def _flush(self, empty_cache: bool = True) -> bool:
        """The scheduler's ``flush_cache`` (stubbed): refused while requests settle after a pause, then done."""
        if self.refusals_left:
            self.refusals_left -= 1
            return False
        return True

    async def on_scheduler(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.thread, fn, *args)

    async def weight_call(self, fn: Any, obj: Any) -> Any:
        """A weight-update call as the tokenizer manager makes it: straight to the scheduler when paused (whoever
        paused holds the writer lock), else under the writer lock."""
        if self.is_pause:
            return await self.on_scheduler(fn, obj)
        async with self.writer_lock:
            return await self.on_scheduler(fn, obj)

    def record(self, path: str, status: int, **fields: Any) -> None:
        self.calls.append({"path": path, "status": status, **fields})

    def state(self) -> dict[str, Any]:
        return {"calls": self.calls, "weights": digest(self.model.tensors), "weight_version": self.recorded_version,
                "hooks": {"restore": Hooks.restore, "postprocess": Hooks.postprocess, "post_load": Hooks.post_load}}


def build_app(rt: Runtime) -> Any:
    """The routes of SGLang's ``http_server.py`` that an RL trainer calls, each parsing its body into SGLang's own
    request struct (FastAPI + ``msgspec_struct_pydantic_core_schema``, as SGLang does) and answering SGLang's status
    and body."""
    from fastapi import Body, FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse

    io, updater = rt.sglang.io, rt.updater
    app = FastAPI()

    def post(path: str, struct: type, handler: Any) -> None:
        async def endpoint(obj, request):  # (annotations set below: SGLang's struct, as its routes declare it)
            return await handler(obj)

        endpoint.__annotations__ = {"obj": Annotated[struct, Body()], "request": Request}
        app.post(path)(endpoint)

    def answer(path: str, success: bool, message: str, **fields: Any) -> Any:
        status = 200 if success else 400
        rt.record(path, status, message=message, **fields)
        return JSONResponse({"success": success, "message": message}, status_code=status)

    async def init_group(obj):
        out = await rt.on_scheduler(updater.init_weights_update_group, obj)
        return answer("/init_weights_update_group", out.success, out.message, group_name=obj.group_name)

    async def destroy_group(obj):
        out = await rt.on_scheduler(updater.destroy_weights_update_group, obj)
        return answer("/destroy_weights_update_group", out.success, out.message, group_name=obj.group_name)

    async def begin(obj):
        out = await rt.weight_call(updater.begin_weight_update, obj)
        return answer("/begin_weight_update", out.success, out.message)

    async def end(obj):
        out = await rt.weight_call(updater.end_weight_update, obj)
        return answer("/end_weight_update", out.success, out.message)

    async def update_distributed(obj):
        out = await rt.weight_call(updater.update_weights_from_distributed, obj)
        message = out.message + (f" Weight version updated to {obj.weight_version}."
                                 if out.success and obj.weight_version is not None else "")
        return answer("/update_weights_from_distributed", out.success, message, names=len(obj.names),
                      flush_cache=obj.flush_cache, weight_version=obj.weight_version, load_format=obj.load_format,
                      abort_all_requests=obj.abort_all_requests)

    async def update_from_disk(obj):  # (not SGLang's code here: the test asserts it is never called)
        return answer("/update_weights_from_disk", False, "this harness runs SGLang's distributed path only",
                      model_path=obj.model_path)

    async def pause(obj):
        rt.is_pause = True
        if obj.mode != "abort":  # (the tokenizer manager sends retract / in_place to the scheduler; abort it does itself)
            rt.engine_paused = True
        rt.refusals_left = rt.busy_flushes if obj.mode != "in_place" else 0
        rt.record("/pause_generation", 200, mode=obj.mode)
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    async def resume(obj):
        rt.is_pause = rt.engine_paused = False
        rt.record("/continue_generation", 200)
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    for path, struct, handler in (
            ("/init_weights_update_group", io.InitWeightsUpdateGroupReqInput, init_group),
            ("/destroy_weights_update_group", io.DestroyWeightsUpdateGroupReqInput, destroy_group),
            ("/begin_weight_update", io.BeginWeightUpdateReqInput, begin),
            ("/end_weight_update", io.EndWeightUpdateReqInput, end),
            ("/update_weights_from_distributed", io.UpdateWeightsFromDistributedReqInput, update_distributed),
            ("/update_weights_from_disk", io.UpdateWeightFromDiskReqInput, update_from_disk),
            ("/pause_generation", io.PauseGenerationReqInput, pause),
            ("/continue_generation", io.ContinueGenerationReqInput, resume)):
        post(path, struct, handler)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        flushed = await rt.on_scheduler(rt._flush)
        rt.record("/flush_cache", 200 if flushed else 400)
        if flushed:
            return PlainTextResponse("Cache flushed.\nPlease check backend logs for more details. (When there are "
                                     "running or waiting requests, the operation will not be performed.)\n")
        return PlainTextResponse("Flush cache failed.\n", status_code=400)

    @app.get("/server_info")
    async def server_info():  # (SGLang's launch defaults that vlrl reads; no weight_checksum: SGLang reports none)
        return {"tp_size": 1, "dp_size": 1, "pp_size": 1, "dtype": "auto", "max_running_requests": 8,
                "image_processor_backend": "pil", "version": "0.5.23 (weight-update code only)", "internal_states": []}

    @app.get("/health")
    async def health():
        return {}

    @app.get("/harness/state")
    async def state():
        return await rt.on_scheduler(rt.state)

    return app


def main() -> None:
    import socket

    import torch
    import torch.distributed as dist
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sglang", type=Path, required=True, help="a folder holding the wheel's files (`extract`)")
    parser.add_argument("--model", type=Path, required=True, help="a transformers directory (safetensors)")
    parser.add_argument("--busy-flushes", type=int, default=0, help="/flush_cache refusals after each pause")
    args = parser.parse_args()
    torch.set_num_threads(1)
    # SGLang's updater asserts a default group (the server's own TP group; one rank here)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    parallel = types.SimpleNamespace(tp_group=types.SimpleNamespace(cpu_group=dist.group.WORLD), tp_rank=0, dp_size=1)
    runtime = Runtime(load_sglang(args.sglang, parallel), checkpoint_model(args.model), args.busy_flushes)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(build_app(runtime), log_level="warning", lifespan="off"))
    print(f"listening on http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    server.run(sockets=[sock])


if __name__ == "__main__":
    main()
