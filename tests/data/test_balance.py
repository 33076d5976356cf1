import json
import math

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from vlrl.data import Sample, generate, read_samples, write_samples
from vlrl.data.balance import (
    balance,
    balance_samples,
    coverage,
    read_vocabulary,
    resample,
    resampled,
    top_k_concepts,
)
from vlrl.models.embedders import EMBEDDERS, get_embedder

VOCAB = ["cat", "dog", "car", "tree"]


class OneHotEmbedder:
    """Images: the concept index is the image's red value; texts: the vocabulary word they contain."""

    def __init__(self, n: int = len(VOCAB)) -> None:
        self.n = n

    def embed_images(self, images):
        out = np.zeros((len(images), self.n))
        for row, image in enumerate(images):
            out[row, image.getpixel((0, 0))[0]] = 1.0
        return out

    def embed_texts(self, texts):
        out = np.zeros((len(texts), self.n))
        for row, text in enumerate(texts):
            out[row, next(k for k, w in enumerate(VOCAB) if w in text) if self.n == len(VOCAB) else int(text[1:])] = 1.0
        return out


def _samples(concepts):
    return [Sample(id=f"s{i}", task="t", messages=[{"role": "user", "content": [{"type": "image"}]}],
                   images=[Image.new("RGB", (4, 4), (c, 0, 0))], reward="number", response="1")
            for i, c in enumerate(concepts)]


def test_hand_worked_balancing_flattens_seven_two_one():
    # 7 cats, 2 dogs, 1 car, no tree; K = 1. f = (7, 2, 1, 0); w_i = 1 / f_c: every concept carries 1/3 of the mass.
    samples = _samples([0] * 7 + [1] * 2 + [2])
    result = balance_samples(samples, OneHotEmbedder(), VOCAB, top_k=1, n_out=9, replace=True)
    assert result.topk[:, 0].tolist() == [0] * 7 + [1] * 2 + [2]
    assert result.weights[0] == pytest.approx(1 / 21) and result.weights[9] == pytest.approx(1 / 3)
    pool, after = result.report["pool"], result.report["balanced"]
    # pool: 3 of 4 concepts covered; H(.7, .2, .1) = 0.8018 nats; evenness 0.8018 / ln 3 = 0.7298; top concept 70 %
    assert (pool["concepts_covered"], pool["coverage"]) == (3, 0.75)
    assert pool["entropy"] == pytest.approx(0.80182, abs=1e-4) and pool["evenness"] == pytest.approx(0.72985, abs=1e-4)
    assert pool["head_1pct_share"] == pytest.approx(0.7)
    # systematic resampling over samples grouped by concept: exactly 3 draws per concept → perfectly even
    counts = np.bincount(result.topk[result.indices, 0], minlength=4).tolist()
    assert counts == [3, 3, 3, 0]
    assert after["evenness"] == pytest.approx(1.0) and after["head_1pct_share"] == pytest.approx(1 / 3)
    assert after["coverage"] == 0.75  # tree never appears in the pool, no resampling can add it
    # a budget of 3: one draw per concept
    small = balance(result.topk, VOCAB, 3, replace=True)
    assert np.bincount(result.topk[small.indices, 0], minlength=4).tolist() == [1, 1, 1, 0]


def test_balancing_flattens_a_zipf_pool_better_than_uniform_sampling():
    rng = np.random.default_rng(0)
    n_concepts = 200
    p = 1 / np.arange(1, n_concepts + 1) ** 1.3
    concept = rng.choice(n_concepts, size=4000, p=p / p.sum())
    topk = concept.reshape(-1, 1)
    vocab = [f"c{k}" for k in range(n_concepts)]
    result = balance(topk, vocab, 800, seed=1)  # without replacement: 800 distinct samples of 4000
    assert result.report["distinct_samples"] == 800
    pool, uniform, balanced = (result.report[k] for k in ("pool", "uniform", "balanced"))
    assert pool["concepts_covered"] == len(np.unique(concept))
    assert balanced["concepts_covered"] == pool["concepts_covered"]  # every pool concept kept at 1/5 of the data
    assert uniform["concepts_covered"] < pool["concepts_covered"] - 20
    assert balanced["evenness"] > uniform["evenness"] + 0.1
    assert balanced["head_1pct_share"] < 0.5 * uniform["head_1pct_share"]
    assert balanced["max_over_median"] < uniform["max_over_median"] / 3


def test_top_k_order_and_ties():
    embeddings = np.array([[1.0, 0, 0], [0.6, 0.8, 0]])
    assert top_k_concepts(embeddings, np.eye(3), 2).tolist() == [[0, 1], [1, 0]]  # tie 0 = 0: lower index first
    assert top_k_concepts(embeddings, np.eye(3), 3).tolist() == [[0, 1, 2], [1, 0, 2]]
    with pytest.raises(ValueError, match="top_k must be in 1..3"):
        top_k_concepts(embeddings, np.eye(3), 4)


def test_resample_is_deterministic_and_honours_replacement():
    weights = np.array([0.1, 0.2, 0.3, 0.4])
    assert np.array_equal(resample(weights, 3, seed=5), resample(weights, 3, seed=5))
    assert len(np.unique(resample(weights, 4))) == 4
    with pytest.raises(ValueError, match="draw with replacement"):
        resample(weights, 5)
    drawn = resample(weights, 1000, replace=True)
    assert np.bincount(drawn, minlength=4).tolist() == [100, 200, 300, 400]  # systematic: exact expected counts
    repeated = resampled(_samples([0, 1]), np.array([0, 0, 1]))
    assert [s.id for s in repeated] == ["s0", "s0~2", "s1"]


def test_vocabulary_file(tmp_path):
    path = tmp_path / "v.txt"
    path.write_text("# concepts\ncat\n\ndog\ncat\n")
    with pytest.raises(ValueError, match=r"v.txt:5: concept 'cat' repeats line 2"):
        read_vocabulary(str(path))
    path.write_text("cat\ndog\n")
    assert read_vocabulary(str(path)) == ["cat", "dog"]


def test_text_only_samples_are_embedded_by_their_text():
    sample = Sample(id="t", task="t", messages=[{"role": "user", "content": "a dog"}], reward="number", response="1")
    result = balance_samples([sample] + _samples([0]), OneHotEmbedder(), VOCAB, top_k=1, n_out=2)
    assert result.topk[:, 0].tolist() == [1, 0]


# ----------------------------------------------------------------------------------------------- CLIP (tiny, random)
def build_tiny_clip(path, words):
    """A randomly initialised CLIP with a word-level tokenizer, saved as a transformers directory."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import CLIPConfig, CLIPImageProcessorPil, CLIPModel, PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[EOS]", *sorted({t for w in words for t in w.split()})])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(single="$A [EOS]", special_tokens=[("[EOS]", 2)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]", eos_token="[EOS]")
    torch.manual_seed(0)
    config = CLIPConfig(
        text_config=dict(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, max_position_embeddings=16, eos_token_id=2, bos_token_id=1, pad_token_id=0),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=32, patch_size=16),
        projection_dim=16,
    )
    CLIPModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(path)
    return path


def test_clip_embedder_from_a_local_directory(tmp_path):
    words = ["red circle", "blue square", "green triangle", "yellow", "word"]
    embedder = get_embedder("clip")(str(build_tiny_clip(tmp_path / "clip", words)))
    texts = embedder.embed_texts(words)
    images = embedder.embed_images([s.images[0] for s in generate("shapes", 3)])
    assert texts.shape == (5, 16) and images.shape == (3, 16)
    assert np.allclose(np.linalg.norm(texts, axis=1), 1, atol=1e-5) and np.allclose(np.linalg.norm(images, axis=1), 1, atol=1e-5)
    assert len({tuple(np.round(t, 5)) for t in texts}) == 5  # pooled at [EOS]: different words, different vectors
    assert "clip" in EMBEDDERS


def test_balance_command_with_tiny_clip(tmp_path):
    from vlrl.cli import app

    words = ["red", "green", "blue", "yellow", "circle", "square", "triangle", "cat", "dog", "sun"]
    clip = build_tiny_clip(tmp_path / "clip", words + ["a photo of"])
    (tmp_path / "vocab.txt").write_text("\n".join(words) + "\n")
    write_samples(generate("shapes", 24, tasks=["count", "color", "ocr"]), tmp_path / "data" / "train.jsonl")
    result = CliRunner().invoke(app, ["data", "balance", "--data", str(tmp_path / "data" / "train.jsonl"),
                                      "--vocabulary", str(tmp_path / "vocab.txt"), "--embedder-path", str(clip),
                                      "--top-k", "2", "--n-out", "12", "--out", str(tmp_path / "balanced")])
    assert result.exit_code == 0, result.output
    index = json.loads((tmp_path / "balanced" / "index.json").read_text())
    report = json.loads((tmp_path / "balanced" / "report.json").read_text())
    assert len(index["indices"]) == 12 and len(set(index["ids"])) == 12
    assert report["pool"]["mentions"] == 48 and report["balanced"]["mentions"] == 24  # K = 2 per sample
    assert set(report) >= {"pool", "uniform", "balanced", "top_concepts", "settings"}
    assert (tmp_path / "balanced" / "coverage.png").stat().st_size > 1000
    assert [s.id for s in read_samples(tmp_path / "balanced" / "train.jsonl").samples] == index["ids"]
    assert "evenness" in result.output


def test_coverage_of_an_empty_selection():
    c = coverage(np.zeros((0, 1), dtype=int), 4)
    assert (c["samples"], c["concepts_covered"], c["evenness"]) == (0, 0, 1.0) and not math.isnan(c["entropy"])
