import pytest

from vlrl.rewards import RewardExecutor

# Short deadlines so hostile probes are cut quickly in tests; the benchmark uses the defaults.
TEST_DEADLINES = {"math": 3.0, "code": 8.0, "svg": 8.0, "html": 5.0}


@pytest.fixture(autouse=True, scope="session")
def _sandbox_as_this_machine_allows():
    """On a machine without namespaces for the sandbox (a container without them) the `code` reward refuses by
    default; there the reward tests run it the way a user must then ask for it, VLRL_SANDBOX_ISOLATION=none (the
    refusal itself is tested everywhere, with a failing `unshare`, in test_sandbox.py)."""
    from vlrl.rewards.sandbox import SandboxUnavailable, isolation

    patch = pytest.MonkeyPatch()
    try:
        isolation()
    except SandboxUnavailable:
        patch.setenv("VLRL_SANDBOX_ISOLATION", "none")
    yield
    patch.undo()


@pytest.fixture(scope="session")
def executor():
    """One worker pool for the whole rewards test session (starting one costs ~1-2 s)."""
    with RewardExecutor(workers=2, deadlines=TEST_DEADLINES) as ex:
        yield ex.start()
