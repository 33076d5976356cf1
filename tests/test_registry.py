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
