"""`vlrl.config.rollout`: the rollout section's sub-sections (engine, agent, servers, weight_sync) and the old flat
keys, each refused with an error naming its new place — from a YAML file, from an override, through the CLI."""

import pytest
import yaml
from typer.testing import CliRunner

from vlrl.cli import app
from vlrl.config import MOVED_KEYS, ConfigError, RLConfig, RolloutConfig, dump_config, load_config

# a value of the old key's own type, for each old key (the error must not depend on the value)
OLD_VALUES = {
    "max_batch_size": "64", "compile": "true", "function": "multi_turn", "generate": "agent",
    "function_options": "{turns: 2}", "env": "shapes_feedback", "env_kwargs": "{zoom: true}", "max_turns": "3",
    "max_total_tokens": "512", "max_env_retries_per_turn": "1", "env_timeout_seconds": "5",
    "api_key_env": "KEY", "admin_api_key_env": "ADMIN", "max_concurrent_rollouts": "8", "on_weight_update": "abort",
    "prompt_check": "warn", "request_timeout": "60", "max_retries": "1", "max_server_failures": "3",
    "weights_dir": "/tmp/w", "weight_sync_address": "10.0.0.1", "weight_sync_port": "29500",
    "weight_sync_bucket_mb": "64", "weight_sync_timeout": "30", "weight_update_timeout": "60",
    "servers": "[http://127.0.0.1:30000]", "weight_sync": "distributed",
}


def _expected(old: str) -> str:
    if old == "servers":
        return "rollout.servers is a section now: the URL list is rollout.servers.urls"
    if old == "weight_sync":
        return "rollout.weight_sync is a section now: the method (disk | distributed) is rollout.weight_sync.method"
    return f"rollout.{old} moved to rollout.{MOVED_KEYS[old]}"


def test_the_table_covers_every_old_key_and_points_at_real_fields():
    assert set(OLD_VALUES) == set(MOVED_KEYS)
    for old, new in MOVED_KEYS.items():
        section, field = new.split(".")
        assert field in RolloutConfig.model_fields[section].annotation.model_fields, new
        assert old not in RolloutConfig.model_fields or old in ("servers", "weight_sync"), old


@pytest.mark.parametrize("old", sorted(MOVED_KEYS))
def test_an_old_key_as_an_override_names_its_new_place(old):
    with pytest.raises(ConfigError) as err:
        load_config(RLConfig, None, [f"rollout.{old}={OLD_VALUES[old]}"])
    assert str(err.value) == f"config field 'rollout': {_expected(old)}"


@pytest.mark.parametrize("old", sorted(MOVED_KEYS))
def test_an_old_key_in_a_yaml_file_names_its_new_place(tmp_path, old):
    path = tmp_path / "old.yaml"
    path.write_text(f"rollout:\n  n: 4\n  {old}: {OLD_VALUES[old]}\n")
    with pytest.raises(ConfigError) as err:
        load_config(RLConfig, path)
    assert str(err.value) == f"{path}: config field 'rollout': {_expected(old)}"


def test_every_old_key_of_a_config_is_named_at_once_and_in_a_stage():
    with pytest.raises(ConfigError) as err:
        load_config(RLConfig, None, ["rollout.env=shapes_feedback", "rollout.weights_dir=w"])
    assert "rollout.env moved to rollout.agent.env; rollout.weights_dir moved to rollout.weight_sync.dir" in str(err.value)
    with pytest.raises(ConfigError, match=r"'stages.0.rollout': rollout.max_turns moved to rollout.agent.max_turns"):
        load_config(RLConfig, None, ["stages=[{rollout: {max_turns: 3}}]"])


@pytest.mark.parametrize("section", ["engine", "agent"])
def test_a_plain_value_where_a_section_goes_is_pointed(section):
    with pytest.raises(ConfigError, match=rf"rollout.{section} is a section: set its fields, e.g. rollout.{section}\."):
        load_config(RLConfig, None, [f"rollout.{section}=multi_turn"])


def test_the_cli_and_vlrl_check_report_the_new_place(tmp_path):
    runner = CliRunner()
    result = runner.invoke(app, ["rl", f"out={tmp_path}", "rollout.servers=[http://127.0.0.1:30000]"])
    assert result.exit_code == 2
    assert "rollout.servers is a section now: the URL list is rollout.servers.urls" in result.output
    config = tmp_path / "old.yaml"
    config.write_text("rollout: {n: 4, function: multi_turn, env: shapes_feedback}\n")
    result = runner.invoke(app, ["check", str(config)])
    assert result.exit_code == 1
    assert "rollout.function moved to rollout.agent.function; rollout.env moved to rollout.agent.env" in result.output


def test_every_new_key_round_trips_through_an_override_and_the_dump(tmp_path):
    overrides = ["rollout.mode=async", "rollout.engine.max_batch_size=64", "rollout.engine.compile=true",
                 "rollout.agent.function=multi_turn", "rollout.agent.env=shapes_feedback",
                 "rollout.agent.env_kwargs={zoom: true}", "rollout.agent.options={}", "rollout.agent.generate=agent",
                 "rollout.agent.max_turns=3", "rollout.agent.max_total_tokens=512",
                 "rollout.agent.max_env_retries_per_turn=1", "rollout.agent.env_timeout_seconds=5",
                 "rollout.servers.urls=[http://127.0.0.1:30000]", "rollout.servers.api_key_env=KEY",
                 "rollout.servers.admin_api_key_env=ADMIN", "rollout.servers.max_concurrent_rollouts=8",
                 "rollout.servers.on_weight_update=abort", "rollout.servers.prompt_check=warn",
                 "rollout.servers.request_timeout=60", "rollout.servers.max_retries=1",
                 "rollout.servers.max_server_failures=3", "rollout.weight_sync.method=distributed",
                 "rollout.weight_sync.dir=w", "rollout.weight_sync.address=10.0.0.1", "rollout.weight_sync.port=29500",
                 "rollout.weight_sync.bucket_mb=64", "rollout.weight_sync.timeout=30",
                 "rollout.weight_sync.update_timeout=60"]
    cfg = load_config(RLConfig, None, overrides)
    rollout = cfg.rollout
    assert (rollout.engine.max_batch_size, rollout.engine.compile) == (64, True)
    assert (rollout.agent.function, rollout.agent.env, rollout.agent.env_kwargs, rollout.agent.max_turns) == \
        ("multi_turn", "shapes_feedback", {"zoom": True}, 3)
    assert (rollout.servers.urls, rollout.servers.on_weight_update, rollout.servers.request_timeout) == \
        (["http://127.0.0.1:30000"], "abort", 60.0)
    assert (rollout.weight_sync.method, rollout.weight_sync.dir, rollout.weight_sync.port,
            rollout.weight_sync.update_timeout) == ("distributed", "w", 29500, 60.0)
    dumped = yaml.safe_load(dump_config(cfg))["rollout"]
    assert dumped["servers"]["urls"] == ["http://127.0.0.1:30000"] and dumped["weight_sync"]["method"] == "distributed"
    assert not set(dumped) & (set(MOVED_KEYS) - {"servers", "weight_sync"})  # the dump writes no old key
    path = tmp_path / "dumped.yaml"
    path.write_text(dump_config(cfg))
    assert load_config(RLConfig, path).rollout == rollout  # a run's config.yaml loads back as it was


def test_the_cross_field_checks_name_the_new_paths():
    with pytest.raises(ConfigError, match=r"rollout.agent.env must name an environment when "
                                          r"rollout.agent.function='multi_turn'"):
        load_config(RLConfig, None, ["rollout.agent.function=multi_turn"])
    with pytest.raises(ConfigError, match="rollout.agent.env is set but rollout.agent.function=single_turn"):
        load_config(RLConfig, None, ["rollout.agent.env=shapes_feedback"])
    with pytest.raises(ConfigError, match=r"rollout.weight_sync.method=distributed sends weights to rollout servers: "
                                          r"set rollout.servers.urls"):
        load_config(RLConfig, None, ["rollout.weight_sync.method=distributed"])


def test_shipped_configs_with_servers_and_an_agent_load_into_the_sections():
    servers = load_config(RLConfig, "configs/recipes/qwen3_vl_8b_servers_grpo.yaml").rollout
    assert servers.servers.request_timeout == 600 and servers.weight_sync.method == "disk"
    agent = load_config(RLConfig, "configs/shapes_feedback_grpo.yaml").rollout
    assert (agent.agent.function, agent.agent.env, agent.agent.env_kwargs, agent.agent.max_turns) == \
        ("multi_turn", "shapes_feedback", {"zoom": True, "zoom_size": 112}, 3)
    llava = load_config(RLConfig, "configs/recipes/llava_ov_1_5_rl_answer_only.yaml").rollout
    assert llava.engine.max_batch_size == 64 and llava.mode == "async"


@pytest.mark.parametrize("yaml_value, override, new", [
    ("servers: [http://127.0.0.1:30000]", "rollout.servers.urls=[http://127.0.0.1:30001]", "servers.urls"),
    ("weight_sync: distributed", "rollout.weight_sync.method=disk", "weight_sync.method"),
])
def test_a_new_key_under_an_old_value_in_the_yaml_names_the_old_key(tmp_path, yaml_value, override, new):
    """A config still holding an old value where a section now goes, given the new key as an override: the
    override cannot descend into it, and says which old key the config still sets."""
    path = tmp_path / "old.yaml"
    path.write_text(f"rollout:\n  {yaml_value}\n")
    old = yaml_value.split(":")[0]
    with pytest.raises(ConfigError, match=rf"it still sets the old rollout\.{old}, now rollout\.{new}"):
        load_config(RLConfig, path, [override])
