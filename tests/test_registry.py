import pytest

from vlrl.registry import Registry, RegistryError


def test_register_get_and_names():
    reg = Registry("thing")

    @reg.register("a")
    def a(x):
        return x + 1

    assert reg.get("a") is a
    assert "a" in reg and reg.names() == ["a"]


def test_duplicate_name_is_rejected():
    reg = Registry("thing")
    reg.register("a")(lambda: 1)
    with pytest.raises(RegistryError, match="already registered"):
        reg.register("a")(lambda: 2)


def test_dotted_path_lookup():
    reg = Registry("thing")
    assert reg.get("os.path:join") is __import__("os").path.join


def test_unknown_name_lists_registered_names():
    reg = Registry("reward")
    reg.register("number")(lambda: 0)
    with pytest.raises(RegistryError, match="unknown reward 'nope'; registered: number"):
        reg.get("nope")
    with pytest.raises(RegistryError, match="cannot import module"):
        reg.get("no_such_module_xyz:fn")
    with pytest.raises(RegistryError, match="has no 'nope'"):
        reg.get("os:nope")


def test_register_path_imports_at_the_first_lookup_and_refuses_duplicates():
    import os.path

    reg = Registry("thing")
    reg.register_path("join", "os.path:join")
    assert "join" in reg and reg.names() == ["join"]
    assert reg.get("join") is os.path.join
    with pytest.raises(RegistryError, match="already registered"):
        reg.register("join")(lambda: 1)
    with pytest.raises(RegistryError, match="already registered"):
        reg.register_path("join", "os.path:split")
    reg.register_path("missing", "no_such_module_xyz:fn")
    with pytest.raises(RegistryError, match="thing 'missing': cannot import module"):
        reg.get("missing")


def test_builtins_are_found_in_their_package_at_the_first_lookup(tmp_path, monkeypatch):
    """``discover=<package>``: each public module of the package registers itself when first looked up; the package
    lists none of them (a built-in is one file), and a private module (``_x``) is left alone."""
    package = tmp_path / "probe_plugins"
    package.mkdir()
    (package / "__init__.py").write_text("from vlrl.registry import Registry\n"
                                         "THINGS = Registry('thing', discover=__name__)\n")
    (package / "alpha.py").write_text("from probe_plugins import THINGS\n\n@THINGS.register('alpha')\ndef alpha(): ...\n")
    (package / "beta.py").write_text("from probe_plugins import THINGS\n\n@THINGS.register('beta')\ndef beta(): ...\n")
    (package / "_private.py").write_text("raise AssertionError('a private module is not a plug-in')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import sys

    from probe_plugins import THINGS

    assert "probe_plugins.alpha" not in sys.modules  # nothing imported before the first lookup
    assert THINGS.names() == ["alpha", "beta"]
    assert THINGS.get("beta").__module__ == "probe_plugins.beta"


def test_the_builtins_of_rewards_environments_and_task_suites_are_found():
    """The packages import none of their plug-in modules; the registries still know every built-in."""
    from vlrl.data.tasks import TASK_SUITES
    from vlrl.rewards import REWARDS
    from vlrl.rollout.envs import ENVIRONMENTS

    assert {"shapes", "arith", "embodied"} <= set(TASK_SUITES.names())
    assert {"number", "math", "bbox_iou", "format", "code", "json_plan", "critic", "syn_format"} <= set(REWARDS.names())
    assert {"shapes_feedback", "tool_zoom", "judge"} <= set(ENVIRONMENTS.names())


def test_the_step_credit_shaper_is_registered_by_its_own_module_and_the_config_check_sees_it():
    """The shaper scores responses with a model, so it lives in the training room and registers itself there (no
    registration by location from a lower room); the config check, a room above, looks it up."""
    import subprocess
    import sys

    code = ("import sys, vlrl.algos as a; assert 'step_credit' not in a.ADVANTAGE_SHAPING; "
            "from vlrl.config import RLConfig, load_config; from vlrl.check.options import config_problems; "
            "cfg = load_config(RLConfig, None, ['algo.advantage_shaping=[{name: step_credit, options: {nope: 1}}]']); "
            "problems = config_problems(cfg); assert any('nope' in f for f, _ in problems), problems; "
            "from vlrl.train.step_credit import step_credit; assert a.get_advantage_shaping('step_credit') is step_credit")
    subprocess.run([sys.executable, "-c", code], check=True)
