"""The one teacher-forced pass (`vlrl.models.forward`): every layout gives the plain pass's log-probs and says which
pass ran; a model's traits are read once; nothing in the training room reaches around the dispatcher into the
decoder's cache or a pass of its own."""

import ast
from pathlib import Path

import pytest
import torch

import vlrl
from vlrl.models import load_policy, traits
from vlrl.models.forward import PassLayout, score, teacher_forced
from vlrl.rollout import HFEngine, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def rollout():
    from vlrl.data import generate

    policy = load_policy("tiny-qwen2-vl")
    engine = HFEngine(policy)
    requests = [engine.encode(s) for s in generate("shapes", 2, tasks=["count"])]
    return policy, engine.generate(requests, SamplingParams(n=3, temperature=1.0, max_new_tokens=5))


def _inputs(trajectories):
    return [t.prompt_ids for t in trajectories], [t.response_ids for t in trajectories], [t.vision for t in trajectories]


@pytest.mark.parametrize("layout, grad, kind", [
    (PassLayout(), False, "padded"),
    (PassLayout(padding_free=True), False, "packed"),
    (PassLayout(shared_prefix=True), False, "cached"),
    (PassLayout(shared_prefix=True), True, "grouped"),
])
def test_every_pass_gives_the_plain_log_probs_and_names_itself(rollout, layout, grad, kind):
    policy, trajectories = rollout
    model = policy.model.eval()
    with torch.no_grad():
        plain = teacher_forced(model, policy.adapter, *_inputs(trajectories), pad_token_id=policy.pad_token_id)
    sums: dict[str, list[float]] = {}
    with torch.set_grad_enabled(grad):
        scores = teacher_forced(model, policy.adapter, *_inputs(trajectories), pad_token_id=policy.pad_token_id,
                                layout=layout, sums=sums)
    assert scores.kind == kind
    assert torch.allclose(scores.logp.detach(), plain.logp, atol=1e-5)
    shared = kind in ("grouped", "cached")
    assert sums["perf/shared_prefix_frac"] == [6.0 if shared else 0.0, 6.0]  # 2 prompts × 3 rows, shared or not
    host = score(model, policy, trajectories, 1.0, layout=layout)  # the no-grad form: on the host, no graph
    assert host.device.type == "cpu" and not host.requires_grad and torch.allclose(host, plain.logp, atol=1e-5)


def test_a_models_traits_are_read_once(rollout, monkeypatch):
    policy, trajectories = rollout
    model = load_policy("tiny-qwen2-vl").model  # a model no pass has seen
    reads = []
    real = traits.shared_prefix_refusal
    monkeypatch.setattr(traits, "shared_prefix_refusal", lambda m: reads.append(m) or real(m))
    for layout in (PassLayout(shared_prefix=True), PassLayout(shared_prefix=True), PassLayout()):
        teacher_forced(model, policy.adapter, *_inputs(trajectories), pad_token_id=policy.pad_token_id, layout=layout)
    assert len(reads) == 1  # read at the model's first pass, kept after
    assert traits.model_traits(model) is traits.model_traits(model)


def test_the_training_room_scores_only_through_the_dispatcher():
    """No module of vlrl.train imports the decoder (`vlrl.rollout.decode`), the KV-cache helpers or a pass of its
    own (`vlrl.models.grouped` / `packed` / `logprobs.response_logprobs`): π_old, π_ref, a teacher, the update and
    SFT all go through `vlrl.models.forward`."""
    root = Path(vlrl.__file__).parent / "train"
    forbidden = {"vlrl.rollout.decode", "vlrl.models.kv_cache", "vlrl.models.grouped", "vlrl.models.packed"}
    found = []
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = {a.name for a in node.names}
                if node.module in forbidden or {f"{node.module}.{n}" for n in names} & forbidden \
                        or "response_logprobs" in names:
                    found.append(f"{path.name}: from {node.module} import {', '.join(sorted(names))}")
    assert found == []
