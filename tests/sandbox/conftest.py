"""Fixtures for the sandbox tests: one sandbox per tier variant that works on this host.

Variants: "bwrap" and "rlimit" (the host side runs as the test's uid: root here), their
"-unprivileged" twins (the host side runs as an unused non-root uid, as most users run it;
see _as_user.py), and "docker" (a real daemon and the image `actloop sandbox build-image`
makes). A variant that cannot exist here is skipped with the reason.
"""

from __future__ import annotations

import os
import sys
import warnings

import pytest

from actloop.sandbox import BwrapSandbox, Limits, RlimitSandbox, probe_bwrap
from actloop.sandbox.docker import DEFAULT_IMAGE
from actloop.sandbox.factory import probe_docker

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # for _as_user (importlib mode)

# Small limits keep the attack suite fast on 2 shared cores; test_attacks.py asserts
# against the same numbers and checks they match (test_limits_match_conftest).
ATTACK_LIMITS = Limits(timeout_s=1.5, max_procs=32, memory_mb=256, tmpfs_mb=8, max_output_bytes=4096)

VARIANTS = ["bwrap", "bwrap-unprivileged", "rlimit", "rlimit-unprivileged", "docker"]


# The Docker variant's client and image: `ACTLOOP_TEST_DOCKER=podman` runs it against Podman.
DOCKER_CLI = os.environ.get("ACTLOOP_TEST_DOCKER", "docker")
DOCKER_IMAGE = os.environ.get("ACTLOOP_TEST_DOCKER_IMAGE", DEFAULT_IMAGE)


def docker_skip_reason() -> str | None:
    status = probe_docker(DOCKER_IMAGE, DOCKER_CLI)
    return None if status.available else f"docker tier unavailable here: {status.reason}"


def _make_sandbox(variant: str):  # type: ignore[no-untyped-def]
    """Build the sandbox for a variant, or skip with the reason it cannot exist here."""
    tier, _, how = variant.partition("-")
    if tier == "bwrap":
        status = probe_bwrap()
        if not status.available:
            pytest.skip(f"bwrap tier unavailable here: {status.reason}")
    if how == "unprivileged":
        from _as_user import AsUser, unavailable_reason

        why = unavailable_reason()
        if why:
            pytest.skip(f"unprivileged variant not run: {why}")
        return AsUser(tier, ATTACK_LIMITS)
    if variant == "bwrap":
        return BwrapSandbox(ATTACK_LIMITS)
    if variant == "rlimit":
        if os.geteuid() != 0:
            pytest.skip("the rlimit tier as the test's own uid is the rlimit-unprivileged variant")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            return RlimitSandbox(ATTACK_LIMITS, warn=False)
    if variant == "docker":
        why = docker_skip_reason()
        if why:
            pytest.skip(why)
        from actloop.sandbox import DockerSandbox

        return DockerSandbox(ATTACK_LIMITS, image=DOCKER_IMAGE, docker=DOCKER_CLI)
    raise ValueError(variant)


@pytest.fixture(params=VARIANTS, scope="module")
def variant(request: pytest.FixtureRequest) -> str:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def sandbox(variant: str):  # type: ignore[no-untyped-def]
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


@pytest.fixture(scope="session")
def docker_sandbox():  # type: ignore[no-untyped-def]
    why = docker_skip_reason()
    if why:
        pytest.skip(why)
    from actloop.sandbox import DockerSandbox

    return DockerSandbox(image=DOCKER_IMAGE, docker=DOCKER_CLI)
