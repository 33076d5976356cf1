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


def test_the_step_credit_shaper_is_registered_without_importing_the_training_room():
    """`vlrl.algos` names it by location; nothing imports `vlrl.train.step_credit` to register it."""
    import subprocess
    import sys

    code = ("import sys, vlrl.algos as a; assert 'step_credit' in a.ADVANTAGE_SHAPING; "
            "assert 'vlrl.train.step_credit' not in sys.modules; "
            "from vlrl.train.step_credit import step_credit; assert a.get_advantage_shaping('step_credit') is step_credit")
    subprocess.run([sys.executable, "-c", code], check=True)
