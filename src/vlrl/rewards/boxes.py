"""Box verifiers: one box (`bbox_iou`) and open-vocabulary detection (`ovd_map`), plus their helpers.

Boxes are ``[x1, y1, x2, y2]`` (xyxy). Accepted prediction forms: ``[x1, y1, x2, y2]``, ``(x1, y1, x2, y2)``,
``x1, y1, x2, y2``, ``(x1, y1), (x2, y2)``, and JSON such as ``{"bbox_2d": [...]}`` (Qwen2.5-VL) or
``{"bbox": [...]}``. Coordinates: pixels, 0–1000 (Qwen2-VL) or 0–1 — see `to_pixels`.
Parsing is linear (a number tokenizer plus checks on the short gaps between numbers), so no input can
make it backtrack.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from vlrl.rewards.base import RewardOutput, register_reward
from vlrl.rewards.extract import extract_json, final_answer

MAX_BOXES = 1000  # detections beyond this are not matched (they still count in N_pred)

_NUM = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)")


def _gap_kind(gap: str) -> int:
    """1 for a comma gap (``, ``), 2 for a point gap (``), (``), 0 otherwise."""
    if len(gap) > 12:
        return 0
    squeezed = "".join(gap.split())
    return 1 if squeezed == "," else 2 if squeezed in ("),(", ")(") else 0


def parse_boxes(text: str, limit: int = MAX_BOXES) -> list[list[float]]:
    """Every ``x1, y1, x2, y2`` run of four numbers in ``text`` (see the module docstring), in order;
    one pass over the number tokens, stopping at ``limit`` boxes."""
    boxes: list[list[float]] = []
    window: list[re.Match] = []  # the last ≤ 4 tokens, each joined to the previous by an allowed gap
    for token in _NUM.finditer(text):
        if window:
            kind = _gap_kind(text[window[-1].end() : token.start()])
            if not (kind == 1 or (kind == 2 and len(window) == 2)):
                window = []
        window.append(token)
        if len(window) == 4:
            boxes.append([float(t.group()) for t in window])
            window = []
            if len(boxes) >= limit:
                break
    return boxes


def parse_box(text: str) -> list[float] | None:
    """The first ``[x1, y1, x2, y2]`` in ``text``, as floats, or None."""
    boxes = parse_boxes(text, limit=1)
    return boxes[0] if boxes else None


def box_iou(a: Sequence[float], b: Sequence[float]) -> float:
    """IoU = Intersection / (Area₁ + Area₂ − Intersection) of two xyxy boxes (0 for degenerate boxes)."""
    if a[2] <= a[0] or a[3] <= a[1] or b[2] <= b[0] or b[3] <= b[1]:
        return 0.0
    ix = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = ix * iy
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def iou_matrix(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(N, M) pairwise IoU of xyxy boxes a (N, 4) and b (M, 4); degenerate boxes have IoU 0."""
    if len(a) == 0 or len(b) == 0:
        return np.zeros((len(a), len(b)))
    ix = np.clip(np.minimum(a[:, None, 2], b[None, :, 2]) - np.maximum(a[:, None, 0], b[None, :, 0]), 0, None)
    iy = np.clip(np.minimum(a[:, None, 3], b[None, :, 3]) - np.maximum(a[:, None, 1], b[None, :, 1]), 0, None)
    inter = ix * iy  # (N, M)
    area_a = np.clip(a[:, 2] - a[:, 0], 0, None) * np.clip(a[:, 3] - a[:, 1], 0, None)
    area_b = np.clip(b[:, 2] - b[:, 0], 0, None) * np.clip(b[:, 3] - b[:, 1], 0, None)
    union = area_a[:, None] + area_b[None, :] - inter
    with np.errstate(divide="ignore", invalid="ignore"):
        iou = np.where((union > 0) & (area_a[:, None] > 0) & (area_b[None, :] > 0), inter / union, 0.0)
    return iou


def to_pixels(box: Sequence[float], coords: str, image_size: Sequence[float] | None) -> list[float]:
    """Convert a box from ``coords`` (``pixel``, ``norm1000`` = 0–1000, ``norm1`` = 0–1) to pixels.

    Without ``image_size`` (width, height) only ``pixel`` boxes can be converted; others are returned
    as they are (and then compared in their own system).
    """
    if coords == "pixel" or image_size is None:
        return [float(v) for v in box]
    scale = {"norm1000": 1000.0, "norm1": 1.0}.get(coords)
    if scale is None:
        raise ValueError(f"coords must be 'pixel', 'norm1000' or 'norm1', got {coords!r}")
    w, h = float(image_size[0]), float(image_size[1])
    return [box[0] * w / scale, box[1] * h / scale, box[2] * w / scale, box[3] * h / scale]


@register_reward("bbox_iou")
def bbox_iou(response: str, answer: Any, *, coords: str = "pixel", image_size: Sequence[float] | None = None,
             **meta: Any) -> RewardOutput:
    """IoU of the first predicted box with the ground-truth box ``answer`` (xyxy), in [0, 1].

    LLaVA-OV-1.5 ``reward/bbox.py``: IoU = Intersection / (Area₁ + Area₂ − Intersection). ``accuracy`` is
    IoU ≥ 0.5 (Acc@0.5). ``answer``: a list of 4 numbers or a string holding them. ``coords`` is the
    coordinate system of the answer and of the asked prediction; given ``image_size`` (width, height), a
    prediction whose four values all lie in [0, 1] is read as normalised 0–1 coordinates. Only the first
    box counts, so listing many boxes does not help.
    """
    target = answer if isinstance(answer, (list, tuple)) else parse_box(str(answer))
    text = final_answer(response)
    predicted = parse_box(text) if text is not None else None
    if predicted is None or target is None or len(target) != 4:
        return RewardOutput(overall=0.0, parts={"accuracy": 0.0})
    target_px = to_pixels(target, coords, image_size)
    pred_coords = "norm1" if image_size is not None and coords != "norm1" and all(0 <= v <= 1 for v in predicted) \
        else coords
    iou = box_iou(to_pixels(predicted, pred_coords, image_size), target_px)
    return RewardOutput(overall=iou, parts={"accuracy": float(iou >= 0.5)})


# ---- detection -------------------------------------------------------------------------------------


def parse_detections(value: Any, *, strict: bool = False) -> list[tuple[list[float], str]]:
    """``[(box, label)]`` from JSON-like detections: a list of ``{"bbox_2d"|"bbox"|"box": [4 numbers],
    "label"|"category"|"name": str}`` (or a dict holding such a list). Malformed entries are skipped, or
    with ``strict`` (for ground truth) raise ``ValueError`` naming the entry."""
    if isinstance(value, dict):
        value = next((v for v in value.values() if isinstance(v, list)), [value])
    if not isinstance(value, list):
        if strict:
            raise ValueError(f"detections must be a JSON list of {{'bbox_2d': [...], 'label': ...}}, got {value!r:.80}")
        return []
    out = []
    for i, item in enumerate(value):
        box = next((item[k] for k in ("bbox_2d", "bbox", "box") if k in item), None) if isinstance(item, dict) else None
        if isinstance(box, list) and len(box) == 4 and all(isinstance(v, (int, float)) for v in box):
            label = next((item[k] for k in ("label", "category", "name") if k in item), "")
            out.append(([float(v) for v in box], " ".join(str(label).lower().split())))
        elif strict:
            raise ValueError(f"detection [{i}]: needs a 'bbox_2d' (or 'bbox') of 4 numbers, got {item!r:.80}")
    return out


def greedy_match(predicted: list[tuple[list[float], str]], truth: list[tuple[list[float], str]], *,
                 iou_threshold: float = 0.5) -> int:
    """Number of one-to-one matches (same label, IoU ≥ threshold), matching pairs in order of
    decreasing IoU (VLM-R1's greedy matching)."""
    if not predicted or not truth:
        return 0
    iou = iou_matrix(np.array([b for b, _ in predicted]), np.array([b for b, _ in truth]))  # (P, G)
    same = np.array([[p == g for _, g in truth] for _, p in predicted])
    iou = np.where(same & (iou >= iou_threshold), iou, -1.0)
    matched, used_p, used_g = 0, set(), set()
    for flat in np.argsort(-iou, axis=None):
        p, g = divmod(int(flat), iou.shape[1])
        if iou[p, g] < 0:
            break
        if p not in used_p and g not in used_g:
            used_p.add(p)
            used_g.add(g)
            matched += 1
    return matched


def greedy_precision_recall(predicted, truth, *, iou_threshold: float = 0.5) -> tuple[float, float]:
    """GP = matched / N_pred, GR = matched / N_gt (Syn-GRPO §4 / VLM-R1), with `greedy_match`."""
    matched = greedy_match(predicted, truth, iou_threshold=iou_threshold)
    return (matched / len(predicted) if predicted else 0.0), (matched / len(truth) if truth else 0.0)


_RECALL_POINTS = np.linspace(0, 1, 101)  # COCO's 101 recall thresholds


def _true_positives(iou: np.ndarray, iou_threshold: float) -> np.ndarray:
    """(P,) 1.0 where prediction p (in rank order) claims the unmatched ground truth of highest IoU ≥ t."""
    used = np.zeros(iou.shape[1], dtype=bool)
    tp = np.zeros(iou.shape[0])
    for p in range(iou.shape[0]):
        candidates = np.where(~used & (iou[p] >= iou_threshold), iou[p], -1.0)  # (G,)
        g = int(np.argmax(candidates))
        if candidates[g] >= 0:
            used[g], tp[p] = True, 1.0
    return tp


def _ap_from_tp(tp: np.ndarray, n_truth: int) -> float:
    """COCO 101-point interpolated AP from the (P,) TP flags of predictions in rank order."""
    if len(tp) == 0 or n_truth == 0:
        return 0.0
    cum_tp = np.cumsum(tp)
    recall = cum_tp / n_truth  # (P,) non-decreasing
    precision = cum_tp / np.arange(1, len(tp) + 1)
    envelope = np.maximum.accumulate(precision[::-1])[::-1]  # best precision at this recall or beyond
    reached = np.searchsorted(recall, _RECALL_POINTS, side="left")  # (101,) first rank reaching each recall
    return float(np.concatenate([envelope, [0.0]])[reached].mean())


def average_precision(predicted: list[list[float]], truth: list[list[float]], iou_threshold: float) -> float:
    """AP of one class at one IoU threshold, COCO-style (101-point interpolated precision).

    Predictions are ranked in output order (a VLM gives no confidences): each, in turn, matches the
    unmatched ground-truth box of highest IoU ≥ threshold (TP) or is a false positive (FP).
    """
    if not truth or not predicted:
        return 0.0
    iou = iou_matrix(np.array(predicted).reshape(-1, 4), np.array(truth).reshape(-1, 4))  # (P, G)
    return _ap_from_tp(_true_positives(iou, iou_threshold), len(truth))


def mean_average_precision(predicted: list[tuple[list[float], str]], truth: list[tuple[list[float], str]], *,
                           iou_thresholds: Sequence[float] = tuple(np.round(np.arange(0.5, 0.96, 0.05), 2))) -> float:
    """mAP = mean over ground-truth classes and IoU thresholds of `average_precision` (COCO 0.5:0.95)."""
    classes = sorted({label for _, label in truth})
    if not classes:
        return 0.0
    total = 0.0
    for label in classes:
        preds = np.array([b for b, lab in predicted if lab == label]).reshape(-1, 4)
        gts = np.array([b for b, lab in truth if lab == label]).reshape(-1, 4)
        iou = iou_matrix(preds, gts)  # (P, G), shared by every threshold
        total += sum(_ap_from_tp(_true_positives(iou, t), len(gts)) for t in iou_thresholds) / len(iou_thresholds)
    return total / len(classes)


@register_reward("ovd_map")
def ovd_map(response: str, answer: Any, *, iou_thresholds: Sequence[float] | None = None, **meta: Any) -> RewardOutput:
    """Open-vocabulary detection reward, Syn-GRPO eq. 3: R = s · mAP(gt, pred), s = min(1, N_gt / N_pred).

    ``s`` penalises redundant predictions (listing many boxes to raise recall). ``answer`` and the
    response: JSON detections ``[{"bbox_2d": [x1, y1, x2, y2], "label": "cat"}, ...]`` (see
    `parse_detections`; the response may wrap them in prose or a fenced block). mAP is COCO's mean over
    IoU 0.5:0.95 unless ``iou_thresholds`` is given. Parts: ``map``, ``redundancy`` (s),
    ``greedy_precision`` / ``greedy_recall`` at IoU 0.5.
    """
    truth = parse_detections(answer if not isinstance(answer, str) else extract_json(answer), strict=True)
    predicted_all = parse_detections(extract_json(response))
    predicted = predicted_all[:MAX_BOXES]
    if not truth or not predicted:  # nothing to find and nothing claimed is right; otherwise nothing scores
        ok = float(not truth and not predicted_all)
        return RewardOutput(overall=ok, parts={"map": ok, "redundancy": 1.0 if not predicted_all else 0.0,
                                               "greedy_precision": ok, "greedy_recall": ok})
    s = min(1.0, len(truth) / len(predicted_all))
    kwargs = {"iou_thresholds": tuple(iou_thresholds)} if iou_thresholds is not None else {}
    m = mean_average_precision(predicted, truth, **kwargs)
    gp, gr = greedy_precision_recall(predicted, truth)
    return RewardOutput(overall=s * m, parts={"map": m, "redundancy": s, "greedy_precision": gp, "greedy_recall": gr})
