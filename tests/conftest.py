import contextlib
import os
import sys
from pathlib import Path

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs two pytest-xdist workers on the 2 cores: one torch thread each (and in the
    # training subprocesses the tests start), or the two oversubscribe the cores
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, "1")

# rollout.engine=auto means vLLM where it is installed; the tests of the loop, the tasks and the tools run
# on the HF engine, which starts in a second (vLLM: 4-15 s, 55 s before its compile cache holds the model).
# vLLM's own tests name it (tests/rollout/test_vllm_real.py, tests/e2e/test_vllm_e2e.py, which also runs
# the default `auto` with this variable removed).
os.environ.setdefault("ACTLOOP_AUTO_ENGINE", "hf")

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("ACTLOOP_SHARED_DATA", ROOT.parent / "shared" / "data"))


@pytest.fixture(scope="session")
def model_dir() -> str:
    """The embedded model, dequantized into the cache (25 s the first time)."""
    from actloop.models import resolve_model

    return resolve_model("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from actloop.models import load_tokenizer

    return load_tokenizer(model_dir)


@pytest.fixture(scope="session")
def fp32_model(model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(autouse=True, scope="module")
def _release_memory_after_each_module(request):
    """After each test module, the C heap's free pages go back to the OS (`release_freed_memory`).
    Without it a pytest worker's RSS grew over the session (12 and 6 GB for the two workers by
    the Ray tests near its end, when the kernel's OOM killer took the Ray test's vLLM actors).
    ACTLOOP_TEST_RSS_LOG=FILE appends "worker module rss-before rss-after" (MB) per module."""
    yield
    from actloop.train.runtime.memory import release_freed_memory

    log = os.environ.get("ACTLOOP_TEST_RSS_LOG")
    before = _rss_mb() if log else 0
    release_freed_memory()
    if log:
        with open(log, "a") as f:
            worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
            f.write(f"{worker} {request.module.__name__} {before} {_rss_mb()}\n")


def _rss_mb() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 2**20


def pytest_runtest_setup(item):
    """`@pytest.mark.data("gsm8k", ...)`: the test reads those datasets from the local copies
    ($ACTLOOP_DATA_DIR, else ../shared/data); without them it is skipped, saying so."""
    marker = item.get_closest_marker("data")
    if marker is None:
        return
    from actloop.data.sources import data_dir

    missing = [n for n in marker.args if not (data_dir() / n).is_dir()]
    if missing:
        pytest.skip(f"needs the {', '.join(missing)} data in {data_dir()} (set ACTLOOP_DATA_DIR; see README)")
# tiny random GPT-OSS / Qwen3 checkpoints (tests/fixtures/tiny_models.py), built once per session
sys.path.insert(0, str(Path(__file__).resolve().parent))
from fixtures.tiny_models import tiny_gpt_oss_dir, tiny_gpt_oss_o200k_dir, tiny_qwen3_dir  # noqa: E402,F401  (session fixtures)


def _harmony_unavailable() -> str | None:
    """Why the Harmony library cannot load gpt-oss's vocabulary here (None when it can)."""
    try:
        from actloop.rollout.formats.harmony import harmony_encoding

        harmony_encoding()
    except Exception as e:  # noqa: BLE001 - the reason is what the skip says
        return str(e)
    return None


# The test files that take minutes (CI's --durations), longest first: `make test` hands files to its
# two workers in collection order (--no-loadscope-reorder), so these start first and the suite does not
# end on one worker running a long file while the other idles. test_ray_vllm and test_resume both hold
# the many-processes lock (`_one_at_a_time`): they are not handed out together at the start (first and
# fourth), so neither waits on the other.
LONG_FILES = ("rollout/test_ray_vllm.py", "e2e/test_vllm_e2e.py", "e2e/test_tiny_models_train.py",
              "train/test_resume.py", "envs/test_task_envs.py", "rollout/test_ray.py", "train/test_fsdp.py",
              "e2e/test_user_tasks.py", "rollout/test_vllm_gpt_oss.py", "e2e/test_train_cli.py",
              "rollout/test_engine_faults.py", "train/test_dpo.py", "e2e/test_judge_train.py")


def _long_first(item) -> int:
    path = item.nodeid.split("::")[0].removeprefix("tests/")
    return LONG_FILES.index(path) if path in LONG_FILES else len(LONG_FILES)


def pytest_collection_modifyitems(config, items):
    """The long files first (LONG_FILES; a stable sort: each file's tests keep their order). Tests that
    render Harmony (gpt-oss's chat format, through the openai_harmony library) skip
    with the library's reason where it cannot load its vocabulary offline (openai-harmony 0.0.8's
    files over oss-harmony's: `make setup` puts oss-harmony's back)."""
    items.sort(key=_long_first)
    uses = [i for i in items if "harmony" in i.nodeid.lower() or "gpt_oss_o200k" in i.nodeid
            or "tiny_gpt_oss_o200k_dir" in getattr(i, "fixturenames", ())
            or "renderers" in getattr(i, "fixturenames", ()) or ("e2e" in i.nodeid and "gpt_oss" in i.nodeid)]
    reason = _harmony_unavailable() if uses else None
    if reason:
        for item in uses:
            item.add_marker(pytest.mark.skip(reason=f"the Harmony library cannot load: {reason[:400]}"))
from fixtures.calling_gpt_oss import calling_gpt_oss  # noqa: E402,F401  (session fixture)


@contextlib.contextmanager
def _one_at_a_time(tmp_path_factory):
    """An exclusive lock shared by the pytest-xdist workers of one session (their base temp dirs
    share a parent): tests that start several model processes hold it, so two of them never run
    side by side. Ray's vLLM actors beside torchrun's vLLM ranks peaked at 95% of the 24 GB box
    and Ray's memory monitor killed an actor."""
    import fcntl

    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    with open(root / "many-processes.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@pytest.fixture(scope="module")
def many_processes_module(tmp_path_factory):
    """`_one_at_a_time` for a whole module (one Ray session for its tests)."""
    with _one_at_a_time(tmp_path_factory):
        yield


@pytest.fixture
def many_processes(tmp_path_factory):
    """`_one_at_a_time` for one test."""
    with _one_at_a_time(tmp_path_factory):
        yield


@pytest.fixture(scope="module")
def ray_session():
    """One local Ray session (2 CPUs) for a module's tests. Ray's memory monitor is off in it: it
    kills the newest worker when the node passes a share of its memory (95% by default, 98% did
    not stop it in CI), and on a box shared with the other pytest worker that killed our actors
    mid-test; the kernel's OOM killer stays the backstop."""
    ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'actloop[ray]')")
    before = os.environ.get("RAY_memory_monitor_refresh_ms")
    os.environ["RAY_memory_monitor_refresh_ms"] = "0"  # read by the raylet ray.init starts
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()
        if before is None:
            os.environ.pop("RAY_memory_monitor_refresh_ms", None)
        else:
            os.environ["RAY_memory_monitor_refresh_ms"] = before
