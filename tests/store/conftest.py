from __future__ import annotations

import os
import shutil

import pytest


@pytest.fixture(scope="session")
def redis_binary() -> str:
    """The system's ``redis-server`` (``make test`` installs it when it can); without it the Redis
    tests skip, except under ``CI=true``."""
    binary = shutil.which("redis-server")
    if binary is None:
        if os.environ.get("CI") == "true":
            pytest.fail("redis-server is not installed; make setup installs it when run as root")
        pytest.skip("redis-server is not installed (apt-get install redis-server, or run make test as root)")
    return binary
