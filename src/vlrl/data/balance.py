"""Concept balancing: resample a dataset so that rare visual concepts are not drowned by frequent ones.

LLaVA-OneVision-1.5 ("Concept Balancing"): embed all images and a concept vocabulary into one space with a
contrastive encoder (MetaCLIP there), retrieve the top-K most similar concepts per image, count concept
frequencies, and resample with inverse-frequency weights. Here:

    topK(i)  = the K concepts c with the largest cos(image_i, concept_c)
    f_c      = |{i : c ∈ topK(i)}|                                  (concept frequency, "mentions")
    w_i      = mean_{c ∈ topK(i)} f_c^(−power)                         (inverse-frequency weight; power 1)

and ``n_out`` samples are drawn with probability ∝ w_i: without replacement (Efraimidis–Spirakis weighted
keys u^(1/w), the default when n_out ≤ N) or with replacement (systematic resampling over the samples
ordered by their top concept, so a concept's share of the draws is within one of its expectation).

The embedder is any object with the `Embedder` protocol; the command picks it by name from
`vlrl.models.embedders.EMBEDDERS` (``clip`` is transformers' CLIP loaded from a local path); any ``pkg.mod:factory`` with ``factory(path, **options)`` returning an object with
``embed_images(list[PIL.Image]) -> (N, D)`` and ``embed_texts(list[str]) -> (K, D)`` (L2-normalised rows)
works. A sample with several images uses the mean of their embeddings; a sample without images is embedded
by its text (prompt + response). Embeddings are streamed in batches; only the (N, K) top-K table is kept.

The coverage report (the seed's Figure 1(a)) compares the concept distribution of the selection with the
whole pool and with a uniform random selection of the same size: concepts covered (≥ 1 mention), evenness
H / ln(covered), and the share of mentions taken by the 1 % most frequent concepts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from PIL import Image

from vlrl.data.sample import Sample, load_image


class Embedder(Protocol):
    def embed_images(self, images: list[Image.Image]) -> np.ndarray:
        """(N, D) L2-normalised image embeddings."""
        ...

    def embed_texts(self, texts: list[str]) -> np.ndarray:
        """(K, D) L2-normalised text embeddings, in the same space."""
        ...


@dataclass
class BalanceResult:
    """Resampled indices and everything they were computed from."""

    indices: np.ndarray  # (n_out,) sample indices, sorted; repeats only with replacement
    weights: np.ndarray  # (N,) normalised sampling probabilities
    topk: np.ndarray  # (N, K) concept indices per sample
    vocabulary: list[str]
    report: dict[str, Any] = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------- retrieval
def top_k_concepts(embeddings: np.ndarray, concepts: np.ndarray, k: int) -> np.ndarray:
    """(N, K) indices of the ``k`` concepts most similar (dot product of normalised rows) to each embedding,
    most similar first (equal scores: lower concept index first)."""
    if not 1 <= k <= len(concepts):
        raise ValueError(f"top_k must be in 1..{len(concepts)} (the vocabulary size), got {k}")
    scores = embeddings @ concepts.T  # (N, C)
    part = np.argpartition(-scores, k - 1, axis=1)[:, :k] if k < scores.shape[1] else np.tile(np.arange(k), (len(scores), 1))
    order = np.lexsort((part, -np.take_along_axis(scores, part, axis=1)), axis=1)
    return np.take_along_axis(part, order, axis=1)


def embed_samples(
    samples: Sequence[Sample], embedder: Embedder, concepts: np.ndarray, k: int, *, batch_size: int = 64,
    on_progress: Callable[[int], None] | None = None,
) -> np.ndarray:
    """Stream the samples through the embedder in batches and keep only their (N, K) top-K concepts."""
    out = np.zeros((len(samples), k), dtype=np.int64)
    for start in range(0, len(samples), batch_size):
        chunk = samples[start : start + batch_size]
        images, owners = [], []
        texts, text_rows = [], []
        for j, sample in enumerate(chunk):
            if sample.images:
                for source in sample.images:
                    images.append(load_image(source))
                    owners.append(j)
            else:
                texts.append(sample.prompt_text() + ("\n" + sample.response if sample.response else ""))
                text_rows.append(j)
        vectors = np.zeros((len(chunk), concepts.shape[1]), dtype=np.float64)
        if images:
            np.add.at(vectors, np.array(owners), np.asarray(embedder.embed_images(images), dtype=np.float64))
        if texts:
            vectors[np.array(text_rows)] = np.asarray(embedder.embed_texts(texts), dtype=np.float64)
        vectors /= np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
        rows = top_k_concepts(vectors, concepts, k)
        out[start : start + len(chunk)] = rows
        if on_progress is not None:
            on_progress(start + len(chunk))
    return out


# ----------------------------------------------------------------------------------------------- weights and draws
def concept_counts(topk: np.ndarray, n_concepts: int, indices: np.ndarray | None = None) -> np.ndarray:
    """(C,) mentions of every concept among the samples ``indices`` (all samples when None; repeats count)."""
    rows = topk if indices is None else topk[indices]
    return np.bincount(rows.reshape(-1), minlength=n_concepts)


def balance_weights(topk: np.ndarray, counts: np.ndarray, *, power: float = 1.0) -> np.ndarray:
    """(N,) sampling probabilities w_i ∝ mean_{c ∈ topK(i)} f_c^(−power)."""
    inverse = np.zeros(len(counts))
    present = counts > 0
    inverse[present] = counts[present].astype(np.float64) ** -power
    weights = inverse[topk].mean(axis=1)
    return weights / weights.sum()


def resample(weights: np.ndarray, n_out: int, *, seed: int = 0, replace: bool = False,
             strata: np.ndarray | None = None) -> np.ndarray:
    """Draw ``n_out`` sample indices with probability ∝ ``weights`` (sorted on return).

    Without replacement: Efraimidis–Spirakis — the n_out largest keys log(u_i) / w_i. With replacement:
    systematic resampling (one uniform offset, n_out evenly spaced points on the cumulative weights) over the
    samples ordered by ``strata`` (their top concept), so each stratum gets its expected share ± 1.
    """
    rng = np.random.default_rng(seed)
    n = len(weights)
    if not replace:
        if n_out > n:
            raise ValueError(f"n_out = {n_out} > {n} samples: draw with replacement (replace=True) to upsample")
        keys = np.full(n, -np.inf)
        positive = weights > 0
        keys[positive] = np.log(rng.random(int(positive.sum()))) / weights[positive]
        return np.sort(np.argpartition(-keys, n_out - 1)[:n_out]) if n_out else np.zeros(0, np.int64)
    order = np.argsort(strata, kind="stable") if strata is not None else np.arange(n)
    cumulative = np.cumsum(weights[order])
    points = (rng.random() + np.arange(n_out)) / n_out * cumulative[-1]
    picks = np.minimum(np.searchsorted(cumulative, points, side="right"), n - 1)
    return np.sort(order[picks])


# ----------------------------------------------------------------------------------------------- the report
def coverage(topk: np.ndarray, n_concepts: int, indices: np.ndarray | None = None) -> dict[str, float]:
    """How the concept mentions of a selection spread over the vocabulary."""
    counts = concept_counts(topk, n_concepts, indices)
    mentions = int(counts.sum())
    covered = int((counts > 0).sum())
    p = counts[counts > 0] / max(mentions, 1)
    entropy = float(-(p * np.log(p)).sum()) if mentions else 0.0
    head = max(1, math.ceil(0.01 * n_concepts))
    nonzero = counts[counts > 0]
    return {
        "samples": int(len(topk) if indices is None else len(indices)),
        "mentions": mentions,
        "concepts_covered": covered,
        "coverage": covered / n_concepts,
        "entropy": entropy,
        "evenness": entropy / math.log(covered) if covered > 1 else 1.0,
        "head_1pct_share": float(np.sort(counts)[::-1][:head].sum() / max(mentions, 1)),
        "max_over_median": float(nonzero.max() / np.median(nonzero)) if len(nonzero) else 0.0,
    }


def balance(
    topk: np.ndarray, vocabulary: Sequence[str], n_out: int, *, power: float = 1.0, replace: bool | None = None,
    seed: int = 0,
) -> BalanceResult:
    """Inverse-frequency resampling of the samples whose top-K concepts are ``topk`` (N, K).

    ``replace`` None: without replacement when ``n_out`` ≤ N, else with. The report compares the pool, a
    uniform random draw of the same size and the balanced draw.
    """
    n_concepts = len(vocabulary)
    replace = n_out > len(topk) if replace is None else replace
    counts = concept_counts(topk, n_concepts)
    weights = balance_weights(topk, counts, power=power)
    indices = resample(weights, n_out, seed=seed, replace=replace, strata=topk[:, 0])
    uniform = np.sort(np.random.default_rng(seed + 1).choice(len(topk), size=n_out, replace=replace))
    after = concept_counts(topk, n_concepts, indices)

    def top(c: np.ndarray, m: int = 20) -> list[list[Any]]:
        return [[vocabulary[i], int(c[i])] for i in np.argsort(-c, kind="stable")[:m] if c[i] > 0]

    report = {
        "settings": {"n_out": n_out, "power": power, "replace": replace, "seed": seed, "top_k": int(topk.shape[1]),
                     "vocabulary": n_concepts},
        "pool": coverage(topk, n_concepts),
        "uniform": coverage(topk, n_concepts, uniform),
        "balanced": coverage(topk, n_concepts, indices),
        "top_concepts": {"pool": top(counts), "balanced": top(after)},
        "distinct_samples": int(len(np.unique(indices))),
    }
    return BalanceResult(indices=indices, weights=weights, topk=topk, vocabulary=list(vocabulary), report=report)


def balance_samples(
    samples: Sequence[Sample], embedder: Embedder, vocabulary: Sequence[str], *, top_k: int = 5,
    n_out: int | None = None, power: float = 1.0, replace: bool | None = None, seed: int = 0, batch_size: int = 64,
    template_texts: Sequence[str] | None = None, on_progress: Callable[[int], None] | None = None,
) -> BalanceResult:
    """Embed the vocabulary (``template_texts`` if given, else the words) and the samples, retrieve each
    sample's top-K concepts and resample ``n_out`` (default: as many as there are samples)."""
    concepts = np.asarray(embedder.embed_texts(list(template_texts or vocabulary)), dtype=np.float64)
    concepts /= np.maximum(np.linalg.norm(concepts, axis=1, keepdims=True), 1e-12)
    topk = embed_samples(samples, embedder, concepts, top_k, batch_size=batch_size, on_progress=on_progress)
    return balance(topk, vocabulary, len(samples) if n_out is None else n_out, power=power, replace=replace, seed=seed)


def resampled(samples: Sequence[Sample], indices: np.ndarray) -> list[Sample]:
    """The selected samples in index order; the k-th repeat of a sample (with replacement) gets id ``<id>~k``."""
    import copy

    seen: dict[int, int] = {}
    out = []
    for i in indices.tolist():
        seen[i] = seen.get(i, 0) + 1
        sample = samples[i] if seen[i] == 1 else copy.copy(samples[i])
        if seen[i] > 1:
            sample.id = f"{sample.id}~{seen[i]}"
        out.append(sample)
    return out


def plot_coverage(result: BalanceResult, path: str) -> None:
    """Rank–frequency curves of concept mentions: pool, uniform draw, balanced draw (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n_concepts = len(result.vocabulary)
    uniform = np.sort(np.random.default_rng(result.report["settings"]["seed"] + 1).choice(
        len(result.topk), size=len(result.indices), replace=result.report["settings"]["replace"]))
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    for label, idx in (("pool", None), ("uniform draw", uniform), ("balanced draw", result.indices)):
        counts = np.sort(concept_counts(result.topk, n_concepts, idx))[::-1]
        share = counts / max(counts.sum(), 1)
        ax.plot(np.arange(1, n_concepts + 1), np.where(share > 0, share, np.nan), label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("concept rank")
    ax.set_ylabel("share of concept mentions")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def read_vocabulary(path: str) -> list[str]:
    """Concepts, one per line (blank lines and ``#`` comments skipped); duplicates are an error."""
    words, seen = [], {}
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            word = line.strip()
            if not word or word.startswith("#"):
                continue
            if word in seen:
                raise ValueError(f"{path}:{number}: concept {word!r} repeats line {seen[word]}")
            seen[word] = number
            words.append(word)
    if not words:
        raise ValueError(f"{path}: no concepts")
    return words
