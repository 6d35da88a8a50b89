"""Test setup: eight fake CPU devices, so meshes and cross-mesh transfers are exercised.

GPU-marked tests run only where JAX sees a GPU: `JAX_PLATFORMS=cuda,cpu pytest -m gpu`.

Every compiled program goes to a persistent compilation cache for the session: a training run
builds its jitted steps afresh, so tests that start several runs of one config (resume, kill
and restart) load the programs the first run compiled instead of compiling them again.

The README demo's base model (configs/tiny.py's pretraining, about two CPU-minutes) is trained
in a background process started once the tests are collected, when a selected test asks for
the `tiny_pretrained_cache` fixture: the process runs at the lowest CPU priority, so it soaks
up the core that compilation and single-threaded tests leave idle instead of adding its time
to the suite's.
"""
import os

# Must happen before JAX initialises its backends. Child processes the tests start inherit these
# flags, and so load the programs this process wrote to the compilation cache (its key holds them).
# The launchers' XLA defaults too: launch/*.py adds them, and a flag missing here would give
# every program a child launcher compiles another cache key than this process's.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from digen_jax import xla_flags  # noqa: E402  (imports no JAX)

# The flags only: GPU tests share the card with their PyTorch references, so JAX keeps its own
# default share of the memory here (the launchers raise it).
xla_flags.set_defaults(memory=False)

import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402
from jax.experimental.compilation_cache import compilation_cache  # noqa: E402

# Parity tests compare against float32 torch references: keep matmuls exact.
jax.config.update("jax_default_matmul_precision", "highest")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_PRETRAINED = "tiny_pretrained_cache"
# The demo's pretraining along the path `launch/train.py --config=configs/tiny.py` takes (the
# workload pretrains through the cache), into the cache directory given as argv[1].
# It exits when its stdin closes: the test process is gone (killed, so no cleanup ran).
_PRETRAIN_TINY = """
import os
import sys
import threading
threading.Thread(target=lambda: (os.read(0, 1), os._exit(1)), daemon=True).start()
from configs import tiny
from digen_jax.app import workload
config = tiny.get_config()
config.pretrain.cache_dir = sys.argv[1]
workload.make_workload(config)
"""


class _BackgroundPretraining:
    """The child process filling a fresh cache directory with configs/tiny.py's pretrained model."""

    def __init__(self):
        self.cache_dir = tempfile.mkdtemp(prefix="digen_tiny_pretrained_")
        self.log_path = os.path.join(self.cache_dir, "pretraining.log")
        # The test process's devices (set above) and matmul precision.
        env = dict(os.environ, JAX_DEFAULT_MATMUL_PRECISION="highest")
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _PRETRAIN_TINY, self.cache_dir],
                cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
            )
        # Lowest priority from the start (the threads it starts inherit it); `wait` restores it.
        os.setpriority(os.PRIO_PROCESS, self.proc.pid, 19)

    def wait(self, timeout_s: float = 1800) -> str:
        """Block until the model is cached; the cache directory."""
        self._restore_priority()
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.returncode != 0:
            with open(self.log_path) as f:
                raise RuntimeError(f"pretraining configs/tiny.py failed ({self.proc.returncode}):\n{f.read()[-3000:]}")
        return self.cache_dir

    def _restore_priority(self):
        """Back to normal priority, where this user may raise it: nothing is left to overlap it
        with, and on a shared machine the lowest priority would starve it. Linux sets priority
        per thread, so every thread of the child (XLA's workers) is reniced."""
        try:
            for tid in os.listdir(f"/proc/{self.proc.pid}/task"):
                os.setpriority(os.PRIO_PROCESS, int(tid), 0)
        except OSError:  # not permitted, no /proc, or the child has finished
            pass

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdin.close()
        shutil.rmtree(self.cache_dir, ignore_errors=True)


_pretraining = None


def pytest_collection_modifyitems(config, items):
    has_gpu = any(d.platform == "gpu" for d in jax.devices())
    skip_gpu = pytest.mark.skip(reason="needs a GPU (run with JAX_PLATFORMS=cuda,cpu)")
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip_gpu)


def _xdist_worker() -> bool:
    """True in a pytest-xdist worker (`pytest -n N`)."""
    return "PYTEST_XDIST_WORKER" in os.environ


def pytest_collection_finish(session):
    """Start the demo's pretraining once the selected tests are known and one of them needs it.
    Under pytest-xdist every worker collects every test but runs only some: the pretraining
    starts when a test asks for it (the other worker keeps the second core busy meanwhile)."""
    global _pretraining
    wanted = any(TINY_PRETRAINED in getattr(item, "fixturenames", ()) for item in session.items)
    if wanted and not session.config.option.collectonly and not _xdist_worker():
        _pretraining = _BackgroundPretraining()


def pytest_sessionfinish(session):
    """Stop a pretraining no test waited for (a failed or interrupted session) and drop its cache."""
    if _pretraining is not None:
        _pretraining.close()


@pytest.fixture(scope="session", autouse=True)
def compile_cache(tmp_path_factory):
    """The session's persistent compilation cache (its path; child processes that should load
    the programs compiled here pass it as JAX_COMPILATION_CACHE_DIR). pytest-xdist's workers
    share one: a program one compiled, the other loads (the cache writes each entry atomically)."""
    if _xdist_worker():
        shared = tmp_path_factory.getbasetemp().parent / "compiled"
        shared.mkdir(exist_ok=True)
        path = str(shared)
    else:
        path = str(tmp_path_factory.mktemp("compiled"))
    settings = {
        "jax_compilation_cache_dir": path,
        "jax_persistent_cache_min_compile_time_secs": 0,
        "jax_persistent_cache_min_entry_size_bytes": -1,
    }
    before = {name: getattr(jax.config, name) for name in settings}
    for name, value in settings.items():
        jax.config.update(name, value)
    compilation_cache.reset_cache()  # JAX sets the cache up once per process, at its first compile
    yield path
    for name, value in before.items():
        jax.config.update(name, value)
    compilation_cache.reset_cache()


@pytest.fixture(scope="session")
def pretrain_cache_dir(tmp_path_factory):
    """A `pretrain.cache_dir` for the whole session: a base model one test module pretrained is
    loaded by the next module that asks for the same recipe (the cache key names all of it)."""
    return tmp_path_factory.mktemp("pretrained")


@pytest.fixture(scope="session")
def tiny_pretrained_cache():
    """A `pretrain.cache_dir` holding configs/tiny.py's pretrained model (its cache key names the
    whole recipe, so a run of that config loads it instead of pretraining)."""
    global _pretraining
    if _pretraining is None:  # asked for outside the collected selection
        _pretraining = _BackgroundPretraining()
    return _pretraining.wait()
