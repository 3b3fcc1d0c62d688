"""Fixtures for the sandbox tests: one sandbox per tier variant that works on this host."""

from __future__ import annotations

import os
import warnings

import pytest

from actloop.sandbox import BwrapSandbox, Limits, RlimitSandbox, probe_bwrap

# Small limits keep the attack suite fast on 2 shared cores; test_attacks.py asserts
# against the same numbers and checks they match (test_limits_match_conftest).
ATTACK_LIMITS = Limits(timeout_s=1.5, max_procs=32, memory_mb=256, tmpfs_mb=8, max_output_bytes=4096)


def _variants() -> list[str]:
    return ["bwrap", "rlimit"]


def _make_sandbox(variant: str) -> BwrapSandbox | RlimitSandbox:
    """Build the sandbox for a variant, or skip with the reason it cannot exist here."""
    if variant == "bwrap":
        status = probe_bwrap()
        if not status.available:
            pytest.skip(f"bwrap tier unavailable here: {status.reason}")
        return BwrapSandbox(ATTACK_LIMITS)
    if variant == "rlimit":
        if os.geteuid() != 0:
            # Without root the fallback runs as *our* uid: several attacks would hit the
            # test runner itself. Those are documented limitations (docs/sandbox.md).
            pytest.skip("rlimit tier without root runs as the test's own uid: attack suite not run")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            return RlimitSandbox(ATTACK_LIMITS, warn=False)
    raise ValueError(variant)


@pytest.fixture(params=_variants(), scope="module")
def variant(request: pytest.FixtureRequest) -> str:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def sandbox(variant: str) -> BwrapSandbox | RlimitSandbox:
    return _make_sandbox(variant)


@pytest.fixture
def make_sandbox():  # type: ignore[no-untyped-def]
    """Build a fresh sandbox of a variant inside a test (e.g. after changing os.environ)."""
    return _make_sandbox


@pytest.fixture(scope="session")
def bwrap_sandbox() -> BwrapSandbox:
    status = probe_bwrap()
    if not status.available:
        pytest.skip(f"bwrap tier unavailable here: {status.reason}")
    return BwrapSandbox()


@pytest.fixture(scope="session")
def rlimit_sandbox() -> RlimitSandbox:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return RlimitSandbox(warn=False)
