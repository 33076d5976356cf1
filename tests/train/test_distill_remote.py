"""On-policy distillation with the teacher on a server (``algo.distill.teacher_urls``; `vlrl.train.distill_remote`):
a `vlrl serve` app of the teacher's checkpoint gives the in-process teacher's log-probs (fp32, to 1e-4) on the same
trajectories — text-only (tiny-qwen2 on arith) and with images (tiny-qwen2-vl on shapes) — and the same
distill/reverse_kl and advantages; a server of another tokenizer is refused naming both; the config takes exactly
one teacher and refuses a rollout temperature a server cannot score at."""

import pytest
import torch

from rollout.conftest import API_KEY, running_server  # tests/ is on sys.path (the test packages' root)
from vlrl.config import RLStage
from vlrl.data import generate
from vlrl.models import load_policy
from vlrl.models.forward import PassLayout
from vlrl.rollout import HFEngine, SamplingParams
from vlrl.rollout.image_url import encode_image
from vlrl.train.batch import build_algorithm, prepare_batch
from vlrl.train.distill import load_teacher

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=[("tiny-qwen2", "arith"), ("tiny-qwen2-vl", "shapes")], ids=["text", "image"])
def world(request, tmp_path_factory):
    """(student dir, teacher dir, 2 prompts × 3 sampled trajectories, a served teacher's URL): the preset at init
    seed 0 (student) and 1 (teacher), the teacher served from its own saved checkpoint."""
    preset, suite = request.param
    root = tmp_path_factory.mktemp(preset)
    student, teacher = root / "student", root / "teacher"
    load_policy(preset).save(student)
    load_policy(preset, seed=1).save(teacher)
    policy = load_policy(str(student))
    torch.manual_seed(0)
    engine = HFEngine(policy)
    trajectories = engine.generate([engine.encode(s) for s in generate(suite, 2)], SamplingParams(n=3, max_new_tokens=6))
    for k, t in enumerate(trajectories):
        t.reward = 0.1 * k
    with running_server(load_policy(str(teacher))) as served:
        yield student, teacher, trajectories, served.url, served.batcher


def _stage(distill: dict, **train) -> RLStage:
    return RLStage.model_validate({"algo": {"distill": distill}, "rollout": {"n": 3, "max_new_tokens": 6},
                                   "train": {"steps": 1, "prompts_per_step": 2, "micro_batch_size": 6, **train}})


def test_a_served_teacher_gives_the_in_process_teachers_logprobs_kl_and_advantages(world, monkeypatch):
    student, teacher, trajectories, url, batcher = world
    monkeypatch.setenv("VLRL_API_KEY", API_KEY)
    policy = load_policy(str(student))
    local = load_teacher(_stage({"teacher": str(teacher)}).algo.distill, policy)
    remote = load_teacher(_stage({"teacher_urls": [url]}).algo.distill, policy)
    try:
        def whole(fn):
            return fn(trajectories, None)

        mask = torch.zeros(len(trajectories), max(len(t.response_ids) for t in trajectories))
        for i, t in enumerate(trajectories):
            mask[i, : len(t.response_ids)] = 1
        mine = local.score(policy, whole, temperature=1.0, layout=PassLayout()).logp
        served = remote.score(policy, whole, temperature=1.0, layout=PassLayout()).logp
        assert mask.sum() > 0 and served.shape == mine.shape
        assert (served * (1 - mask)).abs().max() == 0  # nothing off the responses
        worst = float(((served - mine) * mask).abs().max())
        assert worst <= 1e-4, worst
        print(f"worst |served − in-process| over {int(mask.sum())} tokens: {worst:.2e}")
        # through the step: distill/reverse_kl and the advantages as with the in-process teacher — also under a token
        # budget (the step's passes in micro-batches, one of them a no-op): every trajectory is still asked once
        longest = max(len(t.prompt_ids) + len(t.response_ids) for t in trajectories)
        batches, rows = [], batcher.rows
        budget = {"max_tokens_per_micro_batch": longest}
        for spec, train in (({"teacher": str(teacher)}, {}), ({"teacher_urls": [url]}, {}),
                            ({"teacher_urls": [url]}, budget)):
            stage = _stage(spec, **train)
            algorithm = build_algorithm(stage, load_policy(str(student)), apply_behaviour_weight=False)
            batches.append(prepare_batch(algorithm, load_policy(str(student)), trajectories, step=0, max_new_tokens=6))
            if hasattr(algorithm.teacher, "close"):
                algorithm.teacher.close()
        assert batcher.rows - rows == 2 * sum(len(t.response_ids) > 0 for t in trajectories)
        (kl_in, n_in), *served_kl = (b.token_sums["distill/reverse_kl"] for b in batches)
        assert n_in > 0 and kl_in / n_in != 0.0  # another teacher: the KL is not 0
        for (kl_out, n_out), batch in zip(served_kl, batches[1:], strict=True):
            assert n_out == n_in and abs(kl_in / n_in - kl_out / n_out) <= 1e-4, (kl_in / n_in, kl_out / n_out)
            assert torch.allclose(batches[0].advantages, batch.advantages, rtol=0, atol=1e-4)
    finally:
        remote.close()


def test_a_served_teacher_with_another_tokenizer_is_refused_naming_both(world, tmp_path, monkeypatch):
    student, teacher, *_ = world
    monkeypatch.setenv("VLRL_API_KEY", API_KEY)
    other = load_policy(str(teacher))
    other.tokenizer.add_tokens(["<teacher_only>"])  # one token more: another vocabulary
    other.save(tmp_path / "other")
    with running_server(load_policy(str(tmp_path / "other"))) as served:
        with pytest.raises(ValueError, match="tokenizer") as err:
            load_teacher(_stage({"teacher_urls": [served.url]}).algo.distill, load_policy(str(student)))
    assert served.url in str(err.value) and str(student) in str(err.value) and str(tmp_path / "other") in str(err.value)


@pytest.mark.parametrize(("distill", "rollout", "message"), [
    ({"teacher": "tiny-qwen2", "teacher_urls": ["http://127.0.0.1:1"]}, {}, "exactly one teacher"),
    ({"coef": 1.0}, {}, "exactly one teacher"),
    ({"teacher_urls": ["127.0.0.1:30000"]}, {}, "not an http"),
    ({"teacher_urls": ["http://127.0.0.1:1"]}, {"temperature": 0.7}, "temperature 1"),
])
def test_the_config_takes_one_teacher_and_a_temperature_a_server_scores_at(distill, rollout, message):
    with pytest.raises(ValueError, match=message):
        RLStage.model_validate({"algo": {"distill": distill}, "rollout": rollout})


def test_the_scoring_client_retries_on_another_server_and_names_a_refusal(world):
    """Two teacher servers, one stopped after the start: every request is answered by the other (the failure counted,
    the server dropped after 2); a request the server refuses (400) raises with its message, naming the server."""
    from vlrl.rollout.http_settings import ClientSettings
    from vlrl.rollout.server_pool import RolloutRequestError
    from vlrl.rollout.teacher_client import ScoreRequest, ScoringClient

    student, teacher, trajectories, url, _ = world
    t = trajectories[0]
    ids = [int(x) for x in t.prompt_ids] + [int(x) for x in t.response_ids]
    images = [encode_image(im) for im in t.images]
    with running_server(load_policy(str(teacher))) as doomed:
        client = ScoringClient([doomed.url, url], ClientSettings(api_key=API_KEY, max_server_failures=2))
        doomed.thread.stop()
    try:
        scored = client.score([ScoreRequest(ids, images, len(t.prompt_ids) - 1) for _ in range(4)])
        assert len(scored) == 4 and all(len(s) == len(t.response_ids) for s in scored)
        assert [s.url for s in client.pool.live()] == [url] and doomed.url in client.pool.dropped[0]
        with pytest.raises(RolloutRequestError, match="logprob_start_len") as err:
            client.score([ScoreRequest(ids, images, len(ids) + 5)])
        assert url in str(err.value)
    finally:
        client.close()
