"""The GRPO-workflow side of Syn-GRPO: template, diversity shaping, description selection, and swapping
synthesised samples into the dataset (against a real synthesis server, and a dead one)."""

import time
from types import SimpleNamespace

import numpy as np
import pytest

from vlrl.config import SynthConfig
from vlrl.data import generate
from vlrl.rewards import compose, get_reward
from vlrl.serving import bind_socket
from vlrl.synth.backends import boxes_mask
from vlrl.synth.client import AsyncSynthesizer, SynthClient
from vlrl.synth.workflow import GALLERY_FILE, SynGRPO, apply_syn_template, foreground_boxes

from .conftest import API_KEY, synth_server


def _locate(n=4, **options):
    return [apply_syn_template(s, template="short") for s in generate("shapes", n, tasks=["locate"], **options)]


def test_the_template_rewrites_prompt_reward_and_reference():
    [plain] = generate("shapes", 1, tasks=["count"])
    sample = apply_syn_template(plain, template="think", format_weight=0.5)
    text = sample.messages[0]["content"][-1]["text"]
    assert text.startswith("How many shapes are there? Think step by step inside <think></think>.")
    assert "Put ONLY your final answer within <answer></answer>." in text and text.count("<answer>") == 1
    assert sample.reward == {"number": 1.0, "syn_format": 0.5} and sample.metadata["require_think"] is True
    assert get_reward("syn_format")(sample.response) == 1.0
    scored = compose(sample.response, sample.answer, sample.reward, sample.metadata)
    assert scored.overall == pytest.approx(1.5) and scored.parts["accuracy"] == 1.0
    short = apply_syn_template(plain, template="short")
    assert "<think>" not in short.response and short.metadata["require_think"] is False
    assert compose(short.response, short.answer, short.reward, short.metadata).overall == pytest.approx(2.0)
    assert plain.reward == "number" and "require_think" not in plain.metadata  # the original is untouched


def test_foreground_boxes_from_objects_answers_and_detections():
    [sample] = generate("shapes", 1, tasks=["locate"], coords="norm1000")
    objects = [o["box"] for o in sample.metadata["objects"]]
    boxes = foreground_boxes(sample, (112, 112), margin=0)
    assert boxes == [[float(v) for v in b] for b in objects]
    # answer only: 0-1000 coordinates scaled to the 112-pixel image, grown by the margin, clipped
    answer = foreground_boxes(sample, (112, 112), preserve="answer", margin=2)
    expected = [v * 112 / 1000 for v in sample.answer]
    assert answer == [pytest.approx([expected[0] - 2, expected[1] - 2, expected[2] + 2, expected[3] + 2])]
    edge = SimpleNamespace(metadata={}, answer=[0, 0, 10, 10])
    assert foreground_boxes(edge, (50, 40), margin=3) == [[0.0, 0.0, 13.0, 13.0]]
    detections = SimpleNamespace(metadata={}, answer=[{"bbox_2d": [1, 2, 3, 4], "label": "cat"}, {"label": "no box"}])
    assert foreground_boxes(detections, (50, 40), margin=0) == [[1.0, 2.0, 3.0, 4.0]]
    assert foreground_boxes(SimpleNamespace(metadata={}, answer="7"), (50, 40)) is None


def _trajectory(sample, group, response, accuracy):
    return SimpleNamespace(sample=sample, group_index=group, response_text=response, reward=accuracy,
                           accuracy=accuracy, reward_parts={"accuracy": accuracy})


def _response(v, description):
    return f"<diversity>{v}</diversity><description>{description}</description><answer>[0, 0, 1, 1]</answer>"


def test_descriptions_are_chosen_by_the_diversity_reward_and_diversity_is_logged():
    a, b = _locate(2)
    trajectories = [_trajectory(a, 0, _response(0.9, "grass"), 1.0), _trajectory(a, 0, _response(0.2, "sand"), 0.0),
                    _trajectory(a, 0, "no template", 1.0), _trajectory(a, 0, _response(1.0, "snow"), 0.0),
                    _trajectory(b, 1, _response(0.0, "ocean"), 1.0), _trajectory(b, 1, _response(0.5, "fog"), 1.0)]
    syn = SynGRPO(SynthConfig(enabled=True, synthesize=False), [a, b])
    # R_diversity as the syn_diversity shaper computes it on this batch (first step: Ṽ = V; group 0: accuracies
    # 1, 0, 1, 0 → V = 1; group 1: 1, 1 → V = 0): .9, .2, 0 (no diversity), 1 | 1, .5
    metrics = syn.after_step(trajectories, 1, diversity_reward=[0.9, 0.2, 0.0, 1.0, 1.0, 0.5])
    assert syn.counts["skipped_no_description"] == 0
    assert metrics["diversity/v_batch"] == pytest.approx(0.5)  # (1 + 0) / 2
    assert metrics["diversity/template_frac"] == pytest.approx(5 / 6)
    assert metrics["diversity/predicted_mean"] == pytest.approx((0.9 + 0.2 + 1.0 + 0.0 + 0.5) / 5)
    syn._select(trajectories, [0.9, 0.2, 0.0, 1.0, 1.0, 0.5])
    assert syn._chosen == [(a, "snow"), (b, "ocean")]  # argmax R_diversity per group (Eq. 8)
    syn._select(trajectories, None)
    assert syn._chosen == [(a, "grass"), (b, "ocean")]  # without the reward: the first with a description
    with pytest.raises(ValueError, match="6 trajectories"):
        syn._select(trajectories, [1.0])


def _one_step(syn, samples, step, *, descriptions=("a striped red wall",)):
    trajectories = [_trajectory(s, g, _response(0.5, descriptions[k % len(descriptions)]), float(k % 2))
                    for g, s in enumerate(samples) for k in range(2)]
    return syn.after_step(trajectories, step)


def test_results_replace_their_source_and_inherit_its_labels(tmp_path):
    dataset = _locate(3)
    originals = list(dataset)
    with synth_server() as (url, service):
        synthesizer = AsyncSynthesizer(SynthClient(url, api_key=API_KEY), poll_interval=0.02)
        syn = SynGRPO(SynthConfig(enabled=True, mode="sync", max_generations=2, gallery=2), dataset, seed=3,
                      run_dir=tmp_path, synthesizer=synthesizer)
        metrics = _one_step(syn, dataset[:2], step=1)
        assert metrics["synth/completed"] == 2 and metrics["synth/swapped"] == 2 and metrics["synth/failed"] == 0
        assert metrics["synth/dataset_synthetic_frac"] == pytest.approx(2 / 3) and metrics["synth/in_flight"] == 0
        for old, new in zip(originals[:2], dataset[:2], strict=True):
            assert new.id == f"{old.id}~syn1" and new.answer == old.answer and new.reward == old.reward
            assert new.messages == old.messages and new.metadata["synth"]["description"] == "a striped red wall"
            before, after = np.asarray(old.images[0].convert("RGB")), np.asarray(new.images[0])
            keep = boxes_mask(before.shape[:2], foreground_boxes(old, (112, 112)))
            assert np.array_equal(after[keep], before[keep]) and not np.array_equal(after, before)
        assert dataset[2] is originals[2]
        # the synthetic samples are the sources of the next generation; then the cap stops them
        _one_step(syn, dataset[:2], step=2)
        assert [s.id for s in dataset[:2]] == [f"{o.id}~syn2" for o in originals[:2]]
        assert dataset[0].metadata["synth"]["parent"] == f"{originals[0].id}~syn1"
        metrics = _one_step(syn, dataset[:2], step=3)
        assert metrics["synth/skipped_cap"] == 2 and metrics["synth/swapped"] == 4
        metrics = _one_step(syn, originals[:1], step=4)  # a sample that is no longer in the dataset
        assert metrics["synth/skipped_stale"] == 1
        syn.close()
    rows = (tmp_path / GALLERY_FILE).read_text().splitlines()
    assert len(rows) == 2 and (tmp_path / "synth_gallery").is_dir() and len(list((tmp_path / "synth_gallery").iterdir())) == 4


def test_append_keeps_the_source_and_adds_the_result():
    dataset = _locate(2)
    with synth_server() as (url, _):
        syn = SynGRPO(SynthConfig(enabled=True, mode="sync", replacement="append"), dataset,
                      synthesizer=AsyncSynthesizer(SynthClient(url, api_key=API_KEY), poll_interval=0.02))
        metrics = _one_step(syn, dataset[:1], step=1)
        assert len(dataset) == 3 and dataset[2].id == f"{dataset[0].id}~syn1" and metrics["synth/batch_synthetic_frac"] == 0
        syn.close()


def test_a_dead_server_leaves_the_dataset_alone_counts_failures_and_never_waits():
    sock = bind_socket("127.0.0.1", 0)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()
    dataset = _locate(4)
    before = [s.id for s in dataset]
    syn = SynGRPO(SynthConfig(enabled=True, server=url, poll_interval=0.02), dataset)
    t0 = time.perf_counter()
    _one_step(syn, dataset, step=1)
    assert time.perf_counter() - t0 < 0.5  # async: the step does not wait for the (failing) submissions
    for _ in range(200):
        if syn.synth.outstanding() == 0:
            break
        time.sleep(0.02)
    metrics = syn.after_step([], step=2)
    assert metrics["synth/failed_unavailable"] == 4 and metrics["synth/swapped"] == 0
    assert [s.id for s in dataset] == before
    _one_step(syn, dataset, step=3)  # nothing is stuck "in flight": the originals are submitted again
    assert syn.counts["skipped_in_flight"] == 0
    syn.close()


def test_a_checkpoint_carries_the_pool_and_the_jobs_in_flight_and_a_restore_continues_them(tmp_path):
    """`SynGRPO.state` → the checkpoint's carry-over files → `restore` in a new process's objects: the swapped
    pool (append mode: grown by one), the generation count, and a job still on the server at the checkpoint,
    which the restored client posts again (same seed: the same image) and swaps in at the next step."""
    from vlrl.data.cursor import PromptCursor
    from vlrl.train.carry import read_carry_over, write_carry_over

    from . import fakes

    cfg = SynthConfig(enabled=True, replacement="append", poll_interval=0.02)
    fakes.GATE.set()
    with synth_server(backend=f"{fakes.__name__}:make_gated") as (url, _):
        dataset = _locate(3)
        cursor = PromptCursor(dataset, seed=0)
        cursor.next(3)  # epoch 0 drawn: its order covers the 3 originals
        syn = SynGRPO(cfg, dataset, synthesizer=AsyncSynthesizer(SynthClient(url, api_key=API_KEY), poll_interval=0.02))
        _one_step(syn, dataset[:1], step=1)
        syn.synth.wait_idle(10)
        assert syn.after_step([], step=2)["synth/swapped"] == 1 and len(dataset) == 4  # sample 0's child appended
        cursor.next(1)  # epoch 1 began with 4 samples
        fakes.GATE.clear()  # sample 1's job stays on the server
        _one_step(syn, dataset[1:2], step=3)
        for _ in range(200):
            if syn.synth.snapshot().requests and syn.synth.counts["submitted"] == 2:
                break
            time.sleep(0.02)
        state, position = syn.state(), cursor.state()
        assert len(state.requests) == 1 and state.busy == [dataset[1].id] and state.version == 1
        assert state.client_counts["submitted"] == 1  # the job in flight is posted (and counted) again
        assert position == {"epoch": 1, "position": 1, "size": 4}  # a grown dataset: the epoch's own size
        write_carry_over(state, tmp_path / "synth.json", tmp_path / "synth.safetensors")
        syn.close()
        fakes.GATE.set()

        fresh = _locate(3)
        resumed_cursor = PromptCursor(fresh, seed=0)
        resumed_cursor.load_state(position)
        restored = SynGRPO(cfg, fresh, synthesizer=AsyncSynthesizer(SynthClient(url, api_key=API_KEY), poll_interval=0.02))
        restored.restore(read_carry_over(tmp_path / "synth.json", tmp_path / "synth.safetensors"))
        assert [s.id for s in fresh] == [s.id for s in dataset]
        assert np.array_equal(np.asarray(fresh[3].images[0]), np.asarray(dataset[3].images[0]))  # PNG: lossless
        restored.synth.wait_idle(10)
        metrics = restored.after_step([], step=4)
        assert metrics["synth/swapped"] == 2 and metrics["synth/submitted"] == 2 and metrics["synth/dataset_version"] == 2
        assert fresh[4].id == f"{fresh[1].id}~syn1" and restored._busy == set()
        # epoch 1 goes on over its 4 samples as the uninterrupted cursor does (sample 1's child, the 5th, joins at
        # epoch 2), though the restored dataset already holds 5
        assert [s.id for s in resumed_cursor.next(3)] == [s.id for s in cursor.next(3)]
        assert resumed_cursor.epoch == 1 and len(resumed_cursor.next(1)) == 1 and resumed_cursor.epoch == 2
        with pytest.raises(ValueError, match="other samples"):  # a checkpoint of other data is refused
            SynGRPO(cfg, _locate(2), synthesizer=None).restore(state)
        restored.close()
