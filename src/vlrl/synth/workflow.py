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
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import hashlib
import json
import logging
import os
import random
import secrets
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from vlrl.algos.diversity import DiversityState, group_diversity, select_descriptions
from vlrl.config import SynthConfig
from vlrl.data.sample import Sample, load_image
from vlrl.data.tasks import TEMPLATES
from vlrl.rewards.base import reward_weights
from vlrl.rewards.boxes import to_pixels
from vlrl.rewards.syn import SYN_PROMPT, SYN_PROMPT_SHORT, parse_syn_response
from vlrl.synth.client import AsyncSynthesizer, SynthClient, SynthOutcome, SynthRequest

log = logging.getLogger(__name__)

GALLERY_FILE = "synth_gallery.jsonl"
GALLERY_DIR = "synth_gallery"
# Descriptions of the SFT reference responses `apply_syn_template` writes (the policy learns the format).
DESCRIPTION_EXAMPLES = (
    "a striped blue wall", "green grass", "a dark city street at night", "a sandy desert", "ocean waves",
    "a red brick wall", "a checkered kitchen floor", "white clouds in the sky", "a busy cluttered desk",
    "a snowy field", "pink polka dots", "a wooden floor", "a foggy forest", "a sunset gradient",
    "yellow and purple noise", "a grey concrete wall",
)


# ----------------------------------------------------------------------------------------------- the template
def apply_syn_template(sample: Sample, *, template: str = "think", format_weight: float = 1.0) -> Sample:
    """``sample`` asking for the Syn-GRPO output template: the prompt's answer instruction (one of vlrl's
    `TEMPLATES`) is replaced by the template's, ``syn_format`` joins the reward with ``format_weight``, and an SFT
    reference response is rewritten into the template (with a description and diversity drawn per sample)."""
    if template not in ("think", "short"):
        raise ValueError(f"synth.template must be think or short here, got {template!r}")
    instruction = SYN_PROMPT if template == "think" else SYN_PROMPT_SHORT
    messages = copy.deepcopy(sample.messages)
    user = next((m for m in reversed(messages) if m.get("role") == "user"), None)
    if user is None:
        raise ValueError(f"sample {sample.id}: no user message to add the Syn-GRPO instruction to")
    if isinstance(user["content"], str):
        user["content"] = _with_instruction(user["content"], instruction)
    else:
        texts = [p for p in user["content"] if p.get("type") == "text"]
        if texts:
            texts[-1]["text"] = _with_instruction(texts[-1]["text"], instruction)
        else:
            user["content"].append({"type": "text", "text": instruction})
    reward = reward_weights(sample.reward)
    if format_weight > 0:
        reward["syn_format"] = format_weight
    metadata = {**sample.metadata, "require_think": template == "think"}
    response = _reference(sample, template) if sample.response is not None else None
    return dataclasses.replace(sample, messages=messages, reward=reward, metadata=metadata, response=response)


def _with_instruction(text: str, instruction: str) -> str:
    for suffix in sorted((s for s in TEMPLATES.values() if s), key=len, reverse=True):
        if text.rstrip().endswith(suffix):
            text = text.rstrip()[: -len(suffix)]
            break
    return f"{text.rstrip()} {instruction}".lstrip()


def _reference(sample: Sample, template: str) -> str:
    rng = random.Random(f"syn-reference/{sample.id}")
    answer = sample.response.strip()
    block = answer if answer.startswith("<answer>") else f"<answer>{answer}</answer>"
    think = "<think>Look at the objects in the image.</think>" if template == "think" else ""
    return (f"{think}<diversity>{rng.randint(0, 10) / 10:.1f}</diversity>"
            f"<description>{rng.choice(DESCRIPTION_EXAMPLES)}</description>{block}")


# ----------------------------------------------------------------------------------------------- foreground
def foreground_boxes(sample: Sample, image_size: tuple[int, int], *, preserve: str = "auto",
                     margin: int = 1) -> list[list[float]] | None:
    """The boxes (pixels) whose content must survive synthesis, or None if the sample has none.

    ``objects``: every ``metadata.objects[*].box`` (vlrl's shapes: keeps count, colour and locate labels valid);
    ``answer``: the answer's box (``[x1, y1, x2, y2]``, in ``metadata.coords``) or detection boxes
    (``[{"bbox_2d": ...}]``); ``auto``: objects if the sample lists any, else the answer. Boxes grow by
    ``margin`` pixels (clipped to the image, ``image_size`` = (W, H)).
    """
    W, H = image_size
    objects = [o["box"] for o in sample.metadata.get("objects", []) if isinstance(o, dict) and _is_box(o.get("box"))]
    boxes = objects if preserve == "objects" or (preserve == "auto" and objects) else _answer_boxes(sample, image_size)
    if not boxes:
        return None
    out = []
    for box in boxes:
        x1, y1, x2, y2 = (float(v) for v in box)
        box = [max(0.0, x1 - margin), max(0.0, y1 - margin), min(float(W), x2 + margin), min(float(H), y2 + margin)]
        if box[0] < box[2] and box[1] < box[3]:
            out.append(box)
    return out or None


def _is_box(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and len(value) == 4 and all(isinstance(v, (int, float)) for v in value)


def _answer_boxes(sample: Sample, image_size: tuple[int, int]) -> list[list[float]]:
    answer, coords = sample.answer, sample.metadata.get("coords", "pixel")
    if _is_box(answer):
        raw = [answer]
    elif isinstance(answer, list):
        raw = [d.get("bbox_2d", d.get("bbox")) for d in answer if isinstance(d, dict)]
        raw = [b for b in raw if _is_box(b)]
    else:
        return []
    try:
        return [to_pixels(b, coords, image_size) for b in raw]
    except ValueError:
        return []


def synthetic_sample(parent: Sample, image: Any, *, original: str, generation: int, description: str,
                     job_id: str | None) -> Sample:
    """The new sample: ``parent``'s question, answer, verifier and metadata, the synthesised image, a new id."""
    meta = {**parent.metadata, "synth": {"original": original, "parent": parent.id, "generation": generation,
                                         "description": description, "job": job_id}}
    return dataclasses.replace(parent, id=f"{original}~syn{generation}", images=[image], metadata=meta)


# ----------------------------------------------------------------------------------------------- the workflow
class SynGRPO:
    """Syn-GRPO for one run over ``dataset`` (the list the prompt cursor draws from; swapped in place).

    `after_step` (after each update) selects one description per prompt, submits them, swaps finished results in,
    and returns the step's ``synth/…`` and ``diversity/…`` metrics. R_diversity itself is the reward shaper
    ``syn_diversity`` (`vlrl.algos.diversity`), applied by the recipe before the advantages.
    """

    def __init__(self, cfg: SynthConfig, dataset: list[Sample], *, seed: int = 0, run_dir: str | Path | None = None,
                 synthesizer: AsyncSynthesizer | None = None) -> None:
        self.cfg, self.dataset, self.seed = cfg, dataset, seed
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.counts: collections.Counter[str] = collections.Counter()
        self._slot = {s.id: i for i, s in enumerate(dataset)}
        self._original: dict[str, str] = {}  # synthetic sample id → original id
        self._generations: collections.Counter[str] = collections.Counter()  # original id → generations made
        self._busy: set[str] = set()  # originals with a job out
        self._chosen: list[tuple[Sample, str]] = []  # (sample, description) selected by the last `shape`
        self._gallery_rows = 0
        self._retired: list[str] = []
        self._local: list = []  # (server thread, service) of a server started here
        self.synth = synthesizer
        if self.synth is None and cfg.synthesize:
            self.synth = self._connect()
        self._finalizer = weakref.finalize(self, SynGRPO._shutdown, self.synth, self._local)

    # --- after the update: pick descriptions, submit them, swap finished results in
    def after_step(self, trajectories: Sequence[Any], step: int, *, shaping: Any = None,
                   diversity_reward: Sequence[float] | torch.Tensor | None = None) -> dict[str, float]:
        """Eq. 8 per group — the description of the response with the highest R_diversity (``diversity_reward``
        in batch order, or what the ``syn_diversity`` shaper of the recipe's reward-shaping chain ``shaping``
        computed for this batch; neither: the first response with a description) — sent to the server without
        waiting (unless ``mode=sync``); every finished result is swapped into the dataset. Returns the
        ``diversity/…`` and ``synth/…`` metrics of the step."""
        if diversity_reward is None and shaping is not None:
            diversity_reward = _shaped_diversity(shaping, len(trajectories))
        metrics = self._select(trajectories, diversity_reward)
        if self.synth is not None:
            for sample, description in self._chosen:
                self._submit(sample, description)
            if self.cfg.mode == "sync":
                self.synth.wait_idle(self.cfg.deadline)
            outcomes = self.synth.drain()
            for outcome in outcomes:
                self._apply(outcome, step)
            latencies = [o.latency for o in outcomes if o.ok]
            if latencies:
                metrics.update({"synth/latency_mean": sum(latencies) / len(latencies), "synth/latency_max": max(latencies)})
            counts = {"submitted": 0, "completed": 0, "failed": 0, **self.synth.counts}
            metrics.update({f"synth/{k}": float(v) for k, v in counts.items() if k != "requested"})
            metrics["synth/in_flight"] = float(self.synth.outstanding())
            metrics["synth/client_cpu_seconds"] = self.synth.cpu_seconds
        self._chosen = []
        metrics.update({f"synth/{k}": float(v) for k, v in {"swapped": 0, **self.counts}.items()})
        metrics["synth/batch_synthetic_frac"] = _synthetic_fraction([t.sample for t in trajectories])
        metrics["synth/dataset_synthetic_frac"] = _synthetic_fraction(self.dataset)
        return metrics

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

    # --- internals
    def _connect(self) -> AsyncSynthesizer:
        """A client of ``synth.server``, or of a server started here (loopback, random token)."""
        cfg = self.cfg
        url, key = cfg.server, os.environ.get(cfg.api_key_env)
        if url is None:
            from vlrl.serving import ServerThread
            from vlrl.synth.server import SynthService, SynthSettings, create_app

            key = secrets.token_urlsafe(16)
            service = SynthService(SynthSettings(backend=cfg.backend, backend_options=dict(cfg.backend_options),
                                                 segmenter=cfg.segmenter, segmenter_options=dict(cfg.segmenter_options),
                                                 workers=cfg.workers, executor="process",
                                                 max_queued_jobs=max(cfg.max_in_flight, 8)))
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
        self.synth.submit(SynthRequest(image, boxes, description, seed, payload=(sample.id, original, generation)))

    def _apply(self, outcome: SynthOutcome, step: int) -> None:
        current, original, generation = outcome.request.payload
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
        self.counts["swapped"] += 1
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


def start_synthesis(cfg: SynthConfig, samples: Sequence[Sample], *, seed: int, logger: Any = None) -> SynGRPO | None:
    """Syn-GRPO for a recipe: None unless ``synth.enabled``; else a `SynGRPO` over a copy of ``samples``
    (rewritten to the output template by ``synth.template``), writing its gallery next to the logger's
    ``metrics.jsonl``. The recipe draws prompts from ``.dataset``."""
    if not cfg.enabled:
        return None
    data = list(samples) if cfg.template == "none" else [
        apply_syn_template(s, template=cfg.template, format_weight=cfg.format_weight) for s in samples]
    path = getattr(logger, "path", None)
    return SynGRPO(cfg, data, seed=seed, run_dir=Path(path).parent if path is not None else None)


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


def syn_eval_samples(cfg: SynthConfig, samples: Sequence[Sample]) -> list[Sample]:
    """Held-out samples asking for the same template as training (unchanged unless ``synth.enabled``)."""
    if not cfg.enabled or cfg.template == "none":
        return list(samples)
    return [apply_syn_template(s, template=cfg.template, format_weight=cfg.format_weight) for s in samples]


def _synthetic_fraction(samples: Sequence[Sample]) -> float:
    return sum("synth" in s.metadata for s in samples) / len(samples) if samples else 0.0
