"""`ThreadedEngine`: the reference server's batcher in this process, on a private copy of the trainer's policy — the
asynchronous recipe's engine when no rollout server is configured (`vlrl.rollout.build_engine`)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import torch

from vlrl.data.sample import Sample
from vlrl.models.policy import Policy
from vlrl.rollout.batcher import ContinuousBatcher, private_copy, sampling_key
from vlrl.rollout.hf_engine import HFEngine
from vlrl.rollout.types import Request, SamplingParams, Trajectory
from vlrl.rollout.weights import WeightSyncError, weight_checksum


class ThreadedEngine:
    """The reference server's batcher in this process, on a private copy of the trainer's policy.

    Implements `Engine` and the asynchronous `agenerate`. The `agenerate` calls made in one iteration of an
    event loop (e.g. one per prompt, started together) are submitted as one job, so they decode as one batch
    exactly as `HFEngine.generate` would decode the same requests. `update_weights` copies the trainer's
    weights into the batcher's spare copy (`ContinuousBatcher.load_in_place`), checks its checksum and swaps
    it in at the next batch boundary. With ``on_weight_update="partial"`` the decoding batch is interrupted at its
    next decode step instead of finishing on the old weights: its unfinished rows keep their tokens and go on, on the
    new weights, from where they stopped (each token tagged with the version that sampled it).
    """

    def __init__(self, policy: Policy, *, max_batch_size: int = 256, abort_on_update: bool = False,
                 on_weight_update: str = "finish") -> None:
        self.policy = policy
        self.on_weight_update = "abort" if abort_on_update else on_weight_update
        self.abort_on_update = self.on_weight_update == "abort"
        self._encoder = HFEngine(policy)
        self._batcher = ContinuousBatcher(private_copy(policy), max_batch_size=max_batch_size,
                                          max_queued_requests=1 << 30)
        self._gathering: dict[tuple, list[tuple[list[Request], asyncio.Future]]] = {}
        self.weight_version = 0

    def encode(self, sample: Sample) -> Request:
        return self._encoder.encode(sample)

    def generate(self, requests: Sequence[Request], sampling: SamplingParams) -> list[Trajectory]:
        return self._batcher.submit(requests, sampling).result()

    async def agenerate(self, requests: Sequence[Request], sampling: SamplingParams) -> list[Trajectory]:
        loop = asyncio.get_running_loop()
        key = (id(loop), sampling_key(sampling))
        if key not in self._gathering:
            self._gathering[key] = []
            loop.call_soon(self._flush, key, sampling)  # after every call already scheduled in this iteration
        future = loop.create_future()
        self._gathering[key].append((list(requests), future))
        return await future

    def _flush(self, key: tuple, sampling: SamplingParams) -> None:
        calls = self._gathering.pop(key)
        job = asyncio.wrap_future(self._batcher.submit([r for requests, _ in calls for r in requests], sampling))

        def distribute(done: asyncio.Future) -> None:
            start = 0
            for requests, future in calls:
                count = len(requests) * sampling.n
                if not future.done():
                    if done.cancelled() or done.exception() is not None:
                        future.set_exception(done.exception() or asyncio.CancelledError())
                    else:
                        trajectories = done.result()[start : start + count]
                        for t in trajectories:
                            t.group_index -= start // sampling.n
                        future.set_result(trajectories)
                start += count

        job.add_done_callback(distribute)

    def update_weights(self, *, version: int, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        weights = state_dict if state_dict is not None else self.policy.model.state_dict()
        expected = weight_checksum(weights)
        pause = self.on_weight_update in ("retract", "in_place", "partial")  # (`ContinuousBatcher.pause`: what each does)
        if pause:
            self._batcher.pause(self.on_weight_update)
        try:
            loaded = self._batcher.load_in_place(weights, version=version, abort=self.abort_on_update)
        finally:
            if pause:
                self._batcher.resume()
        if loaded != expected:
            raise WeightSyncError(f"in-process rollout copy: checksum {loaded[:12]} != trainer's {expected[:12]}")
        self.weight_version = version

    def close(self) -> None:
        self._batcher.close()
