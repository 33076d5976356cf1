import pytest

from vlrl.rewards import RewardExecutor

# Short deadlines so hostile probes are cut quickly in tests; the benchmark uses the defaults.
TEST_DEADLINES = {"math": 3.0, "code": 8.0, "svg": 8.0, "html": 5.0}


@pytest.fixture(scope="session")
def executor():
    """One worker pool for the whole rewards test session (starting one costs ~1-2 s)."""
    with RewardExecutor(workers=2, deadlines=TEST_DEADLINES) as ex:
        yield ex.start()
