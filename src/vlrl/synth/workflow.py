"""The GRPO-workflow side of Syn-GRPO (seed §3.3.2): template, diversity reward, description selection, and the
asynchronous swap of synthesised samples into the training data.

One RL step, as the recipes run it with ``synth.enabled``:

    1. prompts carry the Syn-GRPO template (`apply_syn_template`: <think>, <diversity>, <description>, <answer>),
       their reward gains ``syn_format`` (R_format)
    2. after scoring: the reward shaper ``syn_diversity`` (Eq. 6, `vlrl.algos.diversity`) adds R_diversity to
       each response's reward, r = R_acc + R_format + R_diversity (Eq. 7) — before advantages
    3. after the update: per prompt, the description of the response with the highest R_diversity (Eq. 8) is
       sent with the image and its labelled boxes to the synthesis server — `AsyncSynthesizer.submit`, which
       never waits — and every finished job is swapped into the dataset: the new sample inherits the old one's
       question, answer and verifier (the foreground, hence the labels, is unchanged) and replaces it
       (``synth.replacement=replace``) or joins it (``append``) for later draws

A slow, failing or dead server only means fewer swaps: the original samples stay, the failures are counted
(``synth/failed_<kind>``), and no step waits — except in ``synth.mode=sync``, the seed's slow baseline, where
each step waits for its own jobs.

The template, the foreground boxes and the synthesised sample live in `vlrl.synth.samples` (re-exported here).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import logging
import os
import secrets
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from vlrl.algos.diversity import DiversityState, group_diversity, select_descriptions
from vlrl.config import SynthConfig
from vlrl.data.sample import Sample, load_image
from vlrl.rewards.syn import parse_syn_response
from vlrl.synth.client import AsyncSynthesizer, SynthClient, SynthOutcome, SynthRequest, SynthSnapshot
from vlrl.synth.samples import (  # noqa: F401  (DESCRIPTION_EXAMPLES, syn_eval_samples: re-exported)
    DESCRIPTION_EXAMPLES,
    apply_syn_template,
    foreground_boxes,
    syn_eval_samples,
    synthetic_sample,
)

log = logging.getLogger(__name__)

GALLERY_FILE = "synth_gallery.jsonl"
GALLERY_DIR = "synth_gallery"


# ----------------------------------------------------------------------------------------------- the workflow
@dataclasses.dataclass
class SynthState:
    """Syn-GRPO's part of a checkpoint (`SynGRPO.state`): what a resumed run needs to continue with the same
    dataset, the same client and the same bookkeeping. Written by the rank that owns the synthesis client; the
    other ranks write ``holder=False`` and an empty record, and receive rank 0's at the resume."""

    holder: bool  # this record holds the state (rank 0), or stands for it (the other ranks)
    originals: str = ""  # sha256 of the original dataset's ids: the resumed run must start from the same data
    size: int = 0  # samples in the original dataset
    swapped: dict[int, Sample] = dataclasses.field(default_factory=dict)  # slot → sample that is not the original
    generations: dict[str, int] = dataclasses.field(default_factory=dict)  # original id → generations made
    busy: list[str] = dataclasses.field(default_factory=list)  # originals with a job out
    counts: dict[str, int] = dataclasses.field(default_factory=dict)  # the workflow's synth/… counters
    version: int = 0  # swaps applied so far: the dataset version
    tickets: int = 0  # requests made so far (each request's ticket orders the swaps)
    gallery_rows: int = 0  # rows of synth_gallery.jsonl written
    requests: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # unanswered: submitted again
    outcomes: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # answered, not swapped in yet
    client_counts: dict[str, int] = dataclasses.field(default_factory=dict)  # the client's counters


@dataclasses.dataclass
class _Row:
    """One response of the global batch as the selection reads it (gathered from every rank)."""

    sample: Sample
    response_text: str
    group_index: int
    accuracy: float | None


class SynGRPO:
    """Syn-GRPO for one run over ``dataset`` (the list the prompt cursor draws from; swapped in place).

    `after_step` (after each update) selects one description per prompt, submits them, swaps finished results in,
    and returns the step's ``synth/…`` and ``diversity/…`` metrics. R_diversity itself is the reward shaper
    ``syn_diversity`` (`vlrl.algos.diversity`), applied by the recipe before the advantages.

    Under torchrun (``ctx``, a `vlrl.train.distributed.DistContext`) every rank holds the same dataset and runs
    the same bookkeeping on the whole batch (each rank's responses are gathered); rank 0 alone owns the synthesis
    client (and the server it starts), and the outcomes it drains at each step boundary are broadcast, so every
    rank swaps the same samples in at the same step — the ranks' dataset checksums are compared at every step.
    `state` / `restore` carry all of it over a checkpoint.
    """

    def __init__(self, cfg: SynthConfig, dataset: list[Sample], *, seed: int = 0, run_dir: str | Path | None = None,
                 synthesizer: AsyncSynthesizer | None = None, ctx: Any = None) -> None:
        self.cfg, self.dataset, self.seed = cfg, dataset, seed
        self.ctx = ctx if ctx is not None and ctx.enabled else None  # None: one process
        self.is_client = self.ctx is None or self.ctx.is_main  # this process owns the synthesis client
        self.run_dir = Path(run_dir) if run_dir is not None and self.is_client else None
        self.synthesizing = synthesizer is not None or cfg.synthesize
        self.counts: collections.Counter[str] = collections.Counter()
        self.version = 0  # swaps applied so far
        self._originals = [s.id for s in dataset]
        self._slot = {s.id: i for i, s in enumerate(dataset)}
        self._original: dict[str, str] = {}  # synthetic sample id → original id
        self._generations: collections.Counter[str] = collections.Counter()  # original id → generations made
        self._busy: set[str] = set()  # originals with a job out
        self._chosen: list[tuple[Sample, str]] = []  # (sample, description) selected by the last `shape`
        self._tickets = 0
        self._digests: dict[str, str] = {}  # synthetic sample id → sha256 of its image
        self._gallery_rows = 0
        self._gallery_cut = False  # synth_gallery.jsonl cut back to `_gallery_rows` (at the first step)
        self._retired: list[str] = []
        self._local: list = []  # (server thread, service) of a server started here
        self.synth = synthesizer if self.is_client else None
        if self.synth is None and cfg.synthesize and self.is_client:
            self.synth = self._connect()
        self._finalizer = weakref.finalize(self, SynGRPO._shutdown, self.synth, self._local)

    # --- after the update: pick descriptions, submit them, swap finished results in
    def after_step(self, trajectories: Sequence[Any], step: int, *, shaping: Any = None,
                   diversity_reward: Sequence[float] | torch.Tensor | None = None) -> dict[str, float]:
        """Eq. 8 per group — the description of the response with the highest R_diversity (``diversity_reward``
        in batch order, or what the ``syn_diversity`` shaper of the recipe's reward-shaping chain ``shaping``
        computed for this batch; neither: the first response with a description) — sent to the server without
        waiting (unless ``mode=sync``); every finished result is swapped into the dataset. Returns the
        ``diversity/…`` and ``synth/…`` metrics of the step. Under torchrun ``trajectories`` are this rank's
        share and every rank calls this (a collective); the metrics are those of the whole batch."""
        if not self._gallery_cut:
            self._cut_gallery()
        rows = self._gather_rows(trajectories)
        if diversity_reward is None and shaping is not None:
            diversity_reward = _shaped_diversity(shaping, len(rows))
        metrics = self._select(rows, diversity_reward)
        if self.synthesizing:
            for sample, description in self._chosen:
                self._submit(sample, description)
            outcomes, client = self._exchange()
            for outcome in sorted(outcomes, key=lambda o: o.request.payload[3]):  # in the order they were requested
                self._apply(outcome, step)
            latencies = [o.latency for o in outcomes if o.ok]
            if latencies:
                metrics.update({"synth/latency_mean": sum(latencies) / len(latencies), "synth/latency_max": max(latencies)})
            metrics.update(client)
        self._chosen = []
        metrics.update({f"synth/{k}": float(v) for k, v in {"swapped": 0, **self.counts}.items()})
        metrics["synth/batch_synthetic_frac"] = _synthetic_fraction([r.sample for r in rows])
        metrics["synth/dataset_synthetic_frac"] = _synthetic_fraction(self.dataset)
        metrics["synth/dataset_version"] = float(self.version)
        metrics["synth/dataset_checksum"] = float(self._agreed_checksum(step))
        return metrics

    def _gather_rows(self, trajectories: Sequence[Any]) -> list[Any]:
        """The whole batch's responses: ``trajectories`` in one process; under torchrun every rank's, in rank
        order (the order of one process's batch), prompt ids made distinct, samples found by id in this rank's
        copy of the dataset (the same on every rank)."""
        if self.ctx is None:
            return list(trajectories)
        mine = [(t.sample.id, t.sample.task, "synth" in t.sample.metadata, t.response_text, int(t.group_index),
                 t.accuracy) for t in trajectories]
        rows, offset = [], 0
        for part in self.ctx.gather_objects(mine):
            for sample_id, task, synthetic, text, group, accuracy in part:
                slot = self._slot.get(sample_id)
                sample = self.dataset[slot] if slot is not None else \
                    Sample(sample_id, task, [], metadata={"synth": {}} if synthetic else {})  # swapped out: stale
                rows.append(_Row(sample, text, group + offset, accuracy))
            offset += max((row[4] for row in part), default=-1) + 1
        return rows

    def _select(self, trajectories: Sequence[Any], diversity_reward) -> dict[str, float]:
        """Choose one description per group (Eq. 8); return the batch's diversity metrics: V_k^batch (Eq. 4 on
        the ``accuracy`` part; the seed's Figure 2 curve) and how many responses carried the template."""
        if not trajectories:
            return {}
        parsed = [parse_syn_response(t.response_text, require_think=False) for t in trajectories]
        groups = torch.tensor([t.group_index for t in trajectories])
        valid = torch.tensor([p.description is not None and p.diversity is not None for p in parsed])
        if diversity_reward is not None and len(diversity_reward) != len(trajectories):
            raise ValueError(f"diversity_reward has {len(diversity_reward)} values for {len(trajectories)} trajectories")
        ranking = torch.as_tensor(diversity_reward if diversity_reward is not None else [0.0] * len(trajectories),
                                  dtype=torch.float)
        chosen = select_descriptions(ranking, groups, valid)
        self._chosen = [(trajectories[i].sample, parsed[i].description) for i in chosen.values()]
        self.counts["skipped_no_description"] += len(set(groups.tolist())) - len(chosen)
        accuracy = torch.tensor([float(t.accuracy or 0.0) for t in trajectories]).clamp(0, 1)
        v = group_diversity(accuracy, groups)  # (B,)
        first = {int(g): i for i, g in reversed(list(enumerate(groups.tolist())))}
        predicted = [p.diversity for p in parsed if p.diversity is not None]
        return {"diversity/v_batch": float(v[list(first.values())].mean()),
                "diversity/template_frac": float(valid.float().mean()),
                "diversity/predicted_mean": sum(predicted) / len(predicted) if predicted else float("nan")}

    def _exchange(self) -> tuple[list[SynthOutcome], dict[str, float]]:
        """The client's side of a step boundary: wait for the step's jobs (``mode=sync``), drain the outcomes and
        read the counters — on rank 0, which broadcasts them (without the source images) to every rank."""
        report = None
        if self.synth is not None:
            if self.cfg.mode == "sync":
                self.synth.wait_idle(self.cfg.deadline)
            outcomes = [dataclasses.replace(o, request=dataclasses.replace(o.request, image=None))
                        for o in self.synth.drain()]
            counts = {"submitted": 0, "completed": 0, "failed": 0, **self.synth.counts}
            client = {f"synth/{k}": float(v) for k, v in counts.items() if k != "requested"}
            client["synth/in_flight"] = float(self.synth.outstanding())
            client["synth/client_cpu_seconds"] = self.synth.cpu_seconds
            report = (outcomes, client)
        if self.ctx is not None:
            report = self.ctx.gather_objects(report)[0]
        return report if report is not None else ([], {})

    def _checksum(self) -> str:
        """The dataset's version as a digest: every slot's sample id, and every synthesised image's pixels."""
        digest = hashlib.sha256()
        for sample in self.dataset:
            digest.update(f"{sample.id}\n{self._digests.get(sample.id, '')}\n".encode())
        return digest.hexdigest()

    def _agreed_checksum(self, step: int) -> int:
        """The checksum as a number (48 bits: exact in a float); under torchrun the ranks must agree on it."""
        checksum = self._checksum()
        if self.ctx is not None:
            seen = self.ctx.gather_objects(checksum)
            if len(set(seen)) > 1:
                raise RuntimeError(f"Syn-GRPO: after step {step} the ranks' datasets differ (checksums {seen}): a swap "
                                   "was not applied on every rank")
        return int(checksum[:12], 16)

    def retired(self) -> list[str]:
        """Ids of samples that left the dataset (replaced) since the last call: caches keyed by id may drop them."""
        out, self._retired = self._retired, []
        return out

    def close(self) -> None:
        """Stop the client (and the server this object started); also run at garbage collection and exit."""
        self._finalizer()

    @staticmethod
    def _shutdown(synth: AsyncSynthesizer | None, local: list) -> None:
        if synth is not None:
            synth.close()
        for thread, service in local:
            thread.stop()
            service.close()
        local.clear()

    # --- checkpoints
    def state(self) -> SynthState:
        """What a checkpoint keeps (`SynthState`), taken between two steps. Rank 0 holds it all; the other
        ranks return a placeholder (their dataset is rank 0's)."""
        if not self.is_client:
            return SynthState(holder=False)
        swapped = {i: s for i, s in enumerate(self.dataset) if i >= len(self._originals) or s.id != self._originals[i]}
        snapshot = self.synth.snapshot() if self.synth is not None else SynthSnapshot([], [], {})
        return SynthState(
            holder=True, originals=_ids_digest(self._originals), size=len(self._originals), swapped=swapped,
            generations=dict(self._generations), busy=sorted(self._busy), counts=dict(self.counts), version=self.version,
            tickets=self._tickets, gallery_rows=self._gallery_rows,
            requests=[_request_record(r) for r in snapshot.requests],
            outcomes=[_outcome_record(o) for o in snapshot.outcomes], client_counts=snapshot.counts)

    def restore(self, state: SynthState | None, *, source: Any = "the checkpoint") -> None:
        """Continue from a `state` (before the first step; a collective under torchrun: every rank receives rank
        0's). ``source`` names the checkpoint in errors. A state of different data is refused."""
        if self.ctx is not None:
            state = self.ctx.gather_objects(state)[0]
        if state is None or not state.holder:
            raise ValueError(f"checkpoint.resume: {source} holds no Syn-GRPO state (written with synth.enabled=false); "
                             "resume with the settings it was written with")
        if state.size != len(self._originals) or state.originals != _ids_digest(self._originals):
            raise ValueError(f"checkpoint.resume: {source} holds Syn-GRPO's dataset of {state.size} other samples "
                             f"(this run has {len(self._originals)}): resume with the data it was written for")
        for slot, sample in sorted(state.swapped.items()):
            if slot < len(self.dataset):
                self.dataset[slot] = sample
            elif slot == len(self.dataset):
                self.dataset.append(sample)
            else:
                raise ValueError(f"checkpoint.resume: {source}: Syn-GRPO slot {slot} follows a gap in the dataset")
        self._slot = {s.id: i for i, s in enumerate(self.dataset)}
        self._original = {s.id: s.metadata["synth"]["original"] for s in self.dataset if "synth" in s.metadata}
        self._digests = {s.id: _image_digest(s.images[0]) for s in self.dataset if "synth" in s.metadata}
        self._generations = collections.Counter(state.generations)
        self._busy = set(state.busy)
        self.counts = collections.Counter(state.counts)
        self.version, self._tickets = state.version, state.tickets
        self._gallery_rows = state.gallery_rows
        if self.synth is not None:
            self.synth.restore(SynthSnapshot([_request(r) for r in state.requests],
                                             [_outcome(o) for o in state.outcomes], state.client_counts))

    def _cut_gallery(self) -> None:
        """synth_gallery.jsonl back to the rows the checkpoint saw (a killed run may have written more; a fresh run
        in the same directory starts it anew)."""
        self._gallery_cut = True
        if self.run_dir is None or not (self.run_dir / GALLERY_FILE).exists():
            return
        path = self.run_dir / GALLERY_FILE
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
        path.write_text("".join(lines[: self._gallery_rows]), encoding="utf-8")

    # --- internals
    def _connect(self) -> AsyncSynthesizer:
        """A client of ``synth.server``, or of a server started here (loopback, random token)."""
        cfg = self.cfg
        url, key = cfg.server, os.environ.get(cfg.api_key_env)
        if url is None:
            from vlrl.serving import ServerThread
            from vlrl.synth.app import create_app
            from vlrl.synth.schema import SynthSettings
            from vlrl.synth.server import SynthService

            key = secrets.token_urlsafe(16)
            service = SynthService(SynthSettings(backend=cfg.backend, backend_options=dict(cfg.backend_options),
                                                 segmenter=cfg.segmenter, segmenter_options=dict(cfg.segmenter_options),
                                                 workers=cfg.workers, executor="process",
                                                 max_queued_jobs=max(cfg.max_in_flight, 8),
                                                 max_queued_per_client=max(cfg.max_in_flight, 8)))  # its one client
            thread = ServerThread(create_app(service, api_key=key))
            self._local.append((thread, service))
            url = thread.url
        return AsyncSynthesizer(SynthClient(url, api_key=key), max_in_flight=cfg.max_in_flight,
                                max_pending=cfg.max_pending, deadline=cfg.deadline, poll_interval=cfg.poll_interval)

    def _submit(self, sample: Sample, description: str) -> None:
        original = self._original.get(sample.id, sample.id)
        reason = None
        if sample.id not in self._slot:
            reason = "stale"  # replaced since it was drawn (asynchronous rollouts)
        elif self._generations[original] >= self.cfg.max_generations:
            reason = "cap"
        elif original in self._busy:
            reason = "in_flight"
        elif len(sample.images) != 1:
            reason = "ineligible"
        if reason is None:
            image = load_image(sample.images[0])
            boxes = foreground_boxes(sample, image.size, preserve=self.cfg.preserve, margin=self.cfg.preserve_margin)
            if boxes is None:
                reason = "ineligible"
        if reason is not None:
            self.counts[f"skipped_{reason}"] += 1
            return
        generation = self._generations[original] + 1
        seed = int.from_bytes(hashlib.sha256(f"{self.seed}/{original}/{generation}".encode()).digest()[:4], "little")
        self._busy.add(original)
        self._tickets += 1
        if self.synth is not None:  # rank 0 posts; every rank keeps the same books
            self.synth.submit(SynthRequest(image, boxes, description, seed,
                                           payload=(sample.id, original, generation, self._tickets)))

    def _apply(self, outcome: SynthOutcome, step: int) -> None:
        current, original, generation, _ = outcome.request.payload
        self._busy.discard(original)
        if not outcome.ok:
            return  # counted by the synthesizer; the original sample stays
        slot = self._slot.get(current)
        if slot is None or self.dataset[slot].id != current:
            self.counts["stale_results"] += 1
            return
        parent = self.dataset[slot]
        child = synthetic_sample(parent, outcome.image, original=original, generation=generation,
                                 description=outcome.request.description, job_id=outcome.job_id)
        if self.cfg.replacement == "replace":
            self.dataset[slot] = child
            del self._slot[current]
            self._slot[child.id] = slot
            self._retired.append(current)
        else:
            self._slot[child.id] = len(self.dataset)
            self.dataset.append(child)
        self._original[child.id] = original
        self._generations[original] = generation
        self._digests[child.id] = _image_digest(outcome.image)
        self.counts["swapped"] += 1
        self.version += 1
        self._record(parent, child, outcome, step)

    def _record(self, parent: Sample, child: Sample, outcome: SynthOutcome, step: int) -> None:
        """Append original → synthesised to ``synth_gallery.jsonl`` (images under ``synth_gallery/``)."""
        if self.run_dir is None or self._gallery_rows >= self.cfg.gallery:
            return
        folder = self.run_dir / GALLERY_DIR
        folder.mkdir(parents=True, exist_ok=True)
        stem = "".join(c if c.isalnum() or c in "-_." else "_" for c in child.id)
        load_image(parent.images[0]).save(folder / f"{stem}_source.png")
        outcome.image.save(folder / f"{stem}.png")
        row = {"step": step, "task": child.task, "original_id": child.metadata["synth"]["original"], "parent_id": parent.id,
               "sample_id": child.id, "generation": child.metadata["synth"]["generation"],
               "description": outcome.request.description, "source": f"{GALLERY_DIR}/{stem}_source.png",
               "result": f"{GALLERY_DIR}/{stem}.png", "latency": round(outcome.latency, 3),
               "backend": outcome.metadata.get("backend"), "keywords": outcome.metadata.get("keywords")}
        with open(self.run_dir / GALLERY_FILE, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(row, default=str) + "\n")
        self._gallery_rows += 1


def _shaped_diversity(shaping: Any, count: int) -> tuple[float, ...] | None:
    """R_diversity of the last batch from a reward-shaping chain (`vlrl.train.batch.ShapingChain`) that runs
    ``syn_diversity``; None if it does not."""
    for name, state in zip(shaping.names, shaping.states, strict=True):
        if name == "syn_diversity" and isinstance(state, DiversityState) and len(state.last_reward) == count:
            return state.last_reward
    return None


def start_synthesis(cfg: SynthConfig, samples: Sequence[Sample], *, seed: int, logger: Any = None,
                    ctx: Any = None) -> SynGRPO | None:
    """Syn-GRPO for a recipe: None unless ``synth.enabled``; else a `SynGRPO` over a copy of ``samples``
    (rewritten to the output template by ``synth.template``), writing its gallery next to the logger's
    ``metrics.jsonl``. The recipe draws prompts from ``.dataset``. ``ctx``: the ranks of a torchrun job
    (rank 0 owns the synthesis client)."""
    if not cfg.enabled:
        return None
    data = list(samples) if cfg.template == "none" else [
        apply_syn_template(s, template=cfg.template, format_weight=cfg.format_weight) for s in samples]
    path = getattr(logger, "path", None)
    return SynGRPO(cfg, data, seed=seed, run_dir=Path(path).parent if path is not None else None, ctx=ctx)


def restore_synthesis(synthesis: SynGRPO | None, state: SynthState | None, source: Any) -> None:
    """A resumed recipe's Syn-GRPO from the checkpoint's ``state`` (``source`` names the checkpoint); a checkpoint
    with Syn-GRPO state resumed without ``synth.enabled`` is refused (its dataset would silently be lost)."""
    if synthesis is not None:
        synthesis.restore(state, source=source)
    elif state is not None:
        raise ValueError(f"checkpoint.resume: {source} was written by a Syn-GRPO run (its dataset is rewritten as it "
                         "trains); resume it with synth.enabled=true and the same synth settings")


# ----------------------------------------------------------------------------------------------- checkpoint records
def _ids_digest(ids: Sequence[str]) -> str:
    return hashlib.sha256("\n".join(ids).encode()).hexdigest()


def _image_digest(image: Any) -> str:
    picture = load_image(image)
    return hashlib.sha256(f"{picture.mode}{picture.size}".encode() + picture.tobytes()).hexdigest()


def _request_record(request: SynthRequest) -> dict[str, Any]:
    return {"image": request.image, "boxes": [list(map(float, b)) for b in request.boxes],
            "description": request.description, "seed": request.seed, "payload": list(request.payload)}


def _request(record: dict[str, Any]) -> SynthRequest:
    return SynthRequest(record["image"], record["boxes"], record["description"], record["seed"],
                        tuple(record["payload"]))


def _outcome_record(outcome: SynthOutcome) -> dict[str, Any]:
    return {"request": _request_record(outcome.request), "image": outcome.image, "error": outcome.error,
            "message": outcome.message, "latency": outcome.latency, "job_id": outcome.job_id,
            "metadata": outcome.metadata}


def _outcome(record: dict[str, Any]) -> SynthOutcome:
    return SynthOutcome(_request(record["request"]), record["image"], record["error"], record["message"],
                        record["latency"], record["job_id"], record["metadata"])


def synth_problems(stage: Any) -> list[tuple[str, str, str]]:
    """What the preflight check reports about ``stage.synth``: ``(problem | warning, field, message)``."""
    import importlib.util

    from vlrl.registry import RegistryError
    from vlrl.synth.backends import GENERATORS
    from vlrl.synth.segment import SEGMENTERS

    cfg, out = stage.synth, []
    if not cfg.enabled:
        return out
    if not any(spec.name.rpartition(":")[2] == "syn_diversity" for spec in stage.algo.reward_shaping):
        out.append(("warning", "algo.reward_shaping", "synth.enabled without the syn_diversity shaper: no diversity "
                    "reward, and descriptions are picked unranked (the seed's 'w/o R_diversity' ablation); add "
                    "{name: syn_diversity}"))
    if not cfg.synthesize or cfg.server is not None:
        return out  # no server of ours to start
    for field, registry, name, options, path_key in (
            ("synth.backend", GENERATORS, cfg.backend, cfg.backend_options, "model_path"),
            ("synth.segmenter", SEGMENTERS, cfg.segmenter, cfg.segmenter_options, "path")):
        if name is None:
            continue
        try:
            registry.get(name)
        except RegistryError as err:
            out.append(("problem", field, str(err)))
            continue
        if name in ("diffusers", "model"):
            package = "diffusers" if name == "diffusers" else "transformers"
            if importlib.util.find_spec(package) is None:
                out.append(("problem", field, f"the {name} back-end needs '{package}': pip install 'vlrl[diffusion]'"))
            where = f"{field}_options.{path_key}"
            if path_key not in options:
                out.append(("problem", where, f"{name} needs a local model directory"))
            elif not Path(str(options[path_key])).is_dir():
                out.append(("problem", where, f"not a directory: {options[path_key]}"))
    return out


def _synthetic_fraction(samples: Sequence[Sample]) -> float:
    return sum("synth" in s.metadata for s in samples) / len(samples) if samples else 0.0
