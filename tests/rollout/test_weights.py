"""Moving weights to rollout servers: checkpoint names, in-place copies with named errors, the checksum."""

import pytest
import torch

from vlrl.rollout.batcher import private_copy
from vlrl.rollout.weights import (
    WeightLoadError,
    checkpoint_names,
    copy_weights,
    read_weights,
    weight_checksum,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_save_pretrained_directory_reads_back_under_the_state_dict_names(tiny_vlm, tmp_path):
    """transformers 5 saves Qwen2-VL's ``model.language_model.*`` as ``model.*``: the reverse renaming is found
    once, and the file then reads back as exactly the model's state dict."""
    tiny_vlm.model.save_pretrained(tmp_path)
    names = checkpoint_names(tiny_vlm.model)
    assert names is not None and any(saved != name for saved, name in names.items())  # a real renaming
    weights = read_weights(tmp_path, names)
    state = tiny_vlm.model.state_dict()
    assert set(weights) == set(state)
    assert all(torch.equal(weights[name], state[name]) for name in state)
    assert read_weights(tmp_path / "..", names) is None  # no safetensors there: the caller falls back


def test_copy_weights_writes_in_place_and_names_what_does_not_fit(tiny_vlm):
    target = private_copy(tiny_vlm).model
    first = next(iter(target.parameters()))
    state = {name: t + 1.0 for name, t in tiny_vlm.model.state_dict().items()}
    copy_weights(target, state)
    assert all(torch.equal(target.state_dict()[name], state[name]) for name in state)
    assert next(iter(target.parameters())) is first  # the same parameter objects, new values
    name = next(iter(state))
    with pytest.raises(WeightLoadError, match="does not have"):
        copy_weights(target, {**state, "head.extra": torch.zeros(1)})
    with pytest.raises(WeightLoadError, match="missing"):
        copy_weights(target, {k: v for k, v in state.items() if k != name})
    with pytest.raises(WeightLoadError, match=name.replace(".", r"\.")):
        copy_weights(target, {**state, name: torch.zeros(3)})


def test_the_checksum_sees_one_element_and_predicts_a_lower_precision_server(tiny_vlm):
    state = {name: t.clone() for name, t in tiny_vlm.model.state_dict().items()}
    before = weight_checksum(state)
    assert weight_checksum(tiny_vlm.model) == before
    name = next(iter(state))
    state[name].view(-1)[0] += 1e-6  # one element, one ulp-scale change
    assert weight_checksum(state) != before
    bf16 = {k: v.to(torch.bfloat16) for k, v in state.items()}
    assert weight_checksum(state, dtype=torch.bfloat16) == weight_checksum(bf16) != weight_checksum(state)
