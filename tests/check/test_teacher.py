"""`vlrl check` checks on-policy distillation's teacher (`vlrl.check.teacher`): an in-process teacher reads (config
and tokenizer, no weights) and shares the student's vocabulary; a teacher server answers /server_info with the
student's tokenizer — else a problem naming the field and both sides."""

import pytest

from rollout.conftest import API_KEY, running_server  # tests/ is on sys.path (the test packages' root)
from vlrl.check import preflight
from vlrl.config import RLConfig, load_config
from vlrl.models import load_policy

SMALL = ["data.n_train=8", "data.n_test=4", "check.samples_per_task=1"]

pytestmark = pytest.mark.usefixtures("one_thread")


def _check(*overrides):
    return preflight(load_config(RLConfig, None, [*SMALL, *overrides]))


@pytest.fixture(scope="module")
def other_tokenizer(tmp_path_factory, tiny_vlm_dir):
    """tiny-qwen2-vl with one token more in its tokenizer (its weights the same)."""
    path = tmp_path_factory.mktemp("other")
    policy = load_policy(str(tiny_vlm_dir))
    policy.tokenizer.add_tokens(["<teacher_only>"])
    policy.save(path)
    return path


def test_an_in_process_teacher_reads_and_shares_the_students_tokenizer(tmp_path, other_tokenizer):
    report = _check("algo.distill.teacher=tiny-qwen2-vl")
    assert report.ok, report.format()
    assert any(f.startswith("algo.distill.teacher: tiny-qwen2-vl") and "the student's tokenizer" in f
               for f in report.facts), report.facts
    missing = _check(f"algo.distill.teacher={tmp_path / 'nowhere'}")
    assert [p.where for p in missing.problems] == ["algo.distill.teacher"] and "no such directory" in str(missing.problems[0])
    other = _check(f"algo.distill.teacher={other_tokenizer}")
    assert [p.where for p in other.problems] == ["algo.distill.teacher"], other.format()
    assert str(other_tokenizer) in other.problems[0].message and "tiny-qwen2-vl" in other.problems[0].message


def test_a_teacher_server_answers_with_the_students_tokenizer(monkeypatch, other_tokenizer, tiny_vlm_dir):
    monkeypatch.setenv("VLRL_API_KEY", API_KEY)
    with running_server(load_policy(str(tiny_vlm_dir))) as served:
        report = _check(f"algo.distill.teacher_urls=[{served.url}]")
        assert report.ok, report.format()
        assert any(served.url in f and "the student's tokenizer" in f for f in report.facts), report.facts
        monkeypatch.setenv("VLRL_API_KEY", "wrong")
        unauthorised = _check(f"algo.distill.teacher_urls=[{served.url}]")
        assert "401" in unauthorised.problems[0].message
    with running_server(load_policy(str(other_tokenizer))) as served:
        monkeypatch.setenv("VLRL_API_KEY", API_KEY)
        other = _check(f"algo.distill.teacher_urls=[{served.url}]")
        assert [p.where for p in other.problems] == ["algo.distill.teacher_urls"], other.format()
        assert served.url in other.problems[0].message and str(other_tokenizer) in other.problems[0].message
    gone = _check(f"algo.distill.teacher_urls=[{served.url}]")  # stopped: nobody answers
    assert [p.where for p in gone.problems] == ["algo.distill.teacher_urls"] and "does not answer" in str(gone.problems[0])
