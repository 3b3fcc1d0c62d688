"""`serve`: stand-in judges as real HTTP servers on loopback (tests/rewards/judge_server.py)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # test material: judge_server, standin_judges, redteam
from judge_server import ScriptedServer  # noqa: E402


@pytest.fixture
def serve():
    """`serve(script)` starts a `ScriptedServer`; every one is closed after the test."""
    servers = []

    def start(script):
        s = ScriptedServer(script)
        servers.append(s)
        return s

    yield start
    for s in servers:
        s.close()
