"""The prompt cursor: endless shuffled passes over a dataset, resumable from its state (checkpoints)."""

from __future__ import annotations

import torch

from vlrl.data.sample import Sample


class PromptCursor:
    """Endless shuffled passes over a dataset; each epoch's order is fixed by (seed, epoch)."""

    def __init__(self, samples: list[Sample], seed: int) -> None:
        if not samples:
            raise ValueError("no samples to draw prompts from")
        self.samples, self.seed = samples, seed
        self.epoch, self.position = 0, 0
        self._initial = len(samples)  # a dataset may grow as it trains (Syn-GRPO's append): from the next epoch on
        self._order = self._permutation()

    def _permutation(self, size: int | None = None) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(len(self.samples) if size is None else size, generator=generator).tolist()

    def next(self, count: int) -> list[Sample]:
        out = []
        while len(out) < count:
            if self.position == len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation()
            index = self._order[self.position]
            if index >= len(self.samples):  # an order restored from a checkpoint of a larger dataset
                raise ValueError(f"data cursor: the checkpoint's epoch orders more samples than the {len(self.samples)} "
                                 "of this dataset: the checkpoint was written for different data")
            out.append(self.samples[index])
            self.position += 1
        return out

    def state(self) -> dict[str, int]:
        """Epoch and position; and the size of the epoch's order when the dataset has grown since it was given."""
        state = {"epoch": self.epoch, "position": self.position}
        if len(self._order) != self._initial:
            state["size"] = len(self._order)
        return state

    def load_state(self, state: dict[str, int]) -> None:
        """Continue from a `state()` (checkpoints): the same epoch order, the same position in it."""
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._permutation(int(state.get("size", len(self.samples))))  # (sizes checked as it draws)
        if not 0 <= self.position <= len(self._order):
            raise ValueError(f"data cursor position {self.position} is outside the dataset of {len(self._order)} "
                             "samples: the checkpoint was written for different data")
