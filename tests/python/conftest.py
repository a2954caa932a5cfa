import collections
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

# OpenMP threads that wait for work sleep instead of spinning (torch's libgomp spins by default),
# in this process and in every process a test starts (they inherit the environment). The suite
# runs more processes than this machine has cores (`make test`: 4 workers on 2, each starting
# training processes with torch's default of one thread per core), and a spinning thread then
# burns the cores that the thread it waits for needs: a training step of examples/train.py took
# 2.3 CPU-seconds instead of 0.17 on the 2-core machine under the suite's load. What runs is the
# same (the same threads, the same kernels); only how an idle thread waits differs. Set here,
# before anything imports torch, so that this process's OpenMP runtime reads it too.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
# tests/common: the helpers that the Python tests share with the crash driver (tests/crash).
sys.path.insert(0, os.path.join(REPO, "tests", "common"))
from processes import agents_of, kill_agents, kill_and_wait, start_script  # noqa: E402,F401

_SHORT_BASETEMP = None


def pytest_configure(config):
    # Agents listen on a Unix socket inside the shm directory, and socket paths are limited to
    # 107 bytes. pytest's default base (/tmp/pytest-of-<user>/pytest-<n>/<test name>/) grows with
    # n and with test names, so tests that put an shm directory under tmp_path would start to
    # fail after enough runs. A short base keeps every such path well under the limit.
    global _SHORT_BASETEMP
    if not config.option.basetemp and not hasattr(config, "workerinput"):
        import tempfile

        _SHORT_BASETEMP = tempfile.mkdtemp(prefix="sp-", dir="/tmp")
        config.option.basetemp = _SHORT_BASETEMP


# Modules whose tests must run alone (`make test` runs them after the parallel run, without
# pytest-xdist; the marker `serial`): they measure time, throughput or memory of this machine,
# which other tests running beside them would distort. Every other module runs under
# `pytest -n N --dist loadgroup --no-loadscope-reorder` (Makefile, test-python): tests there use
# tmp_path, their own shm directory (the `shm` fixture), free ports, their own subnet lock for
# node clusters (tests/common/nodes.py) and their own pools, buckets and prefixes on the shared
# Ceph.
SERIAL_MODULES = {"test_saveperf", "test_loadperf", "test_restore_at_scale"}
# Modules whose tests are spread over the workers one by one: each test runs its own processes
# with a private shm directory, a fresh temporary directory, its own job names and free ports, and
# the module has no module-scoped fixture; its tests together take longer than one worker should
# spend on one module (the examples: minutes; the frameworks' SIGKILL-and-resume tests: a minute
# each). Every other module's tests stay on one worker (an xdist_group named after the module, as
# with --dist loadfile), so that a module-scoped fixture such as test_tier_faults' own gateway
# starts once.
SPREAD_MODULES = {"test_examples", "test_lightning_sharded", "test_lightning_multirank",
                  "test_lightning", "test_hf", "test_hf_multirank", "test_reshard",
                  "test_deepspeed"}
# Seconds that the longest tests took in a `make test` (`--durations`, 4 workers on the 2-core
# machine, before OMP_WAIT_POLICY above), by the test's name within its module, parameters
# included: the workers take the longest work first (below). Only the order depends on them, so
# rough values do; a test not named here counts 1 s (one spread 20 s).
SLOW_TESTS = {
    "test_getting_started_one_node_then_what_to_watch": 135,
    "test_sharded_two_ranks_sigkill_then_fit_ckpt_last_is_bit_identical[fsdp]": 97,
    "test_sharded_two_ranks_sigkill_then_fit_ckpt_last_is_bit_identical[fsdp2]": 84,
    "test_ddp_two_ranks_sigkill_then_fit_ckpt_last_is_bit_identical": 75,
    "test_two_ranks_sigkill_then_resume_is_bit_identical[fsdp2]": 67,
    "test_two_ranks_sigkill_then_resume_is_bit_identical[ddp]": 64,
    "test_example_runs_and_resumes[lightning_example.py --strategy fsdp2]": 64,
    "test_example_runs_and_resumes[lightning_example.py --devices 2]": 62,
    "test_flash_sigkill_then_fit_ckpt_last_resumes_bit_identical": 58,
    "test_flash_sigkill_then_resume_is_bit_identical": 57,
    "test_example_runs_and_resumes[hf_example.py --ranks 2]": 43,
    "test_killed_during_copy_resumes_from_memory": 41,
    "test_getting_started_several_nodes": 40,
    "test_save_n_ranks_restore_m_ranks[2-load_meshes0]": 39,
    "test_save_sigkill_load_checkpoint_resumes_bit_identical[2-1]": 37,
    "test_ceph_cluster_rados_and_s3_round_trip": 36,
    "test_every_committed_step_has_exactly_w_image_publishes[1]": 30,  # test_scale's three runs
    # test_exact_resume_frameworks and _peers (one worker each: 68 s together alone)
    "test_mid_epoch_kill_then_resume_trains_the_same_samples_to_the_same_weights"
    "[lightning-global-3503]": 37,
    "test_mid_epoch_kill_then_resume_trains_the_same_samples_to_the_same_weights"
    "[hf-global-3509]": 18,
    "test_mid_epoch_kill_then_resume_trains_the_same_samples_to_the_same_weights"
    "[lightning-shuffle-3504]": 15,
    "test_lost_node_resumes_its_data_position_from_peer_memory": 29,
    "test_dp_size_2_then_4_then_3_trains_the_same_samples": 13,
    "test_sync_async_flash_saves_reshard_tp_pp_dp_bit_for_bit": 44,  # test_megatron: 37 s alone
    "test_example_runs_and_resumes[megatron_example.py]": 28,
    # test_s3_faults: 83 s alone, 11 tests on one worker
    "test_a_stalled_part_is_retried_on_a_fresh_connection_and_the_upload_resumes": 30,
    "test_a_download_that_stops_mid_body_is_retried_on_a_fresh_connection": 25,
    "test_persist_past_its_budget_fails_wait_naming_rank_object_and_endpoint": 24,
    "test_a_tier_copy_stopped_mid_upload_fails_in_status_and_catches_up": 22,
}


def _module(item) -> str:
    return item.module.__name__.rpartition(".")[2]


def pytest_collection_modifyitems(config, items):
    units = collections.defaultdict(float)  # what one worker takes at once -> its seconds
    unit_of = {}
    for item in items:
        name = _module(item)
        unit_of[item] = item.nodeid if name in SPREAD_MODULES else name
        units[unit_of[item]] += SLOW_TESTS.get(item.name, 20 if name in SPREAD_MODULES else 1)
        if name in SERIAL_MODULES:
            item.add_marker(pytest.mark.serial)
        elif name not in SPREAD_MODULES:
            item.add_marker(pytest.mark.xdist_group(name))
    # The order in which the workers take the work (xdist keeps it with --no-loadscope-reorder):
    # the longest first, so that the run does not end with one worker still in a long test while
    # the others are idle; a module's tests stay together, in their order (the sort is stable).
    order = {unit: i for i, unit in enumerate(sorted(units, key=lambda u: -units[u]))}
    items.sort(key=lambda item: order[unit_of[item]])


def pytest_unconfigure(config):
    if _SHORT_BASETEMP:
        shutil.rmtree(_SHORT_BASETEMP, ignore_errors=True)


def cli_path() -> str:
    """The safepoint CLI on PATH (`make test` puts the venv's bin first; a development build
    directory can come first instead), else the one installed beside this Python."""
    found = shutil.which("safepoint")
    if found:
        return found
    cand = os.path.join(os.path.dirname(sys.executable), "safepoint")
    if not os.path.exists(cand):
        pytest.skip("the safepoint CLI is not installed")
    return cand


@pytest.fixture
def cli():
    path = cli_path()

    def run(*args, check=None):
        proc = subprocess.run([path, *map(str, args)], capture_output=True, text=True, timeout=120)
        if check is not None:
            assert proc.returncode == check, (proc.returncode, proc.stdout, proc.stderr)
        return proc

    return run


@pytest.fixture
def ckpt(tmp_path):
    return tmp_path / "ckpt"


@pytest.fixture
def shm():
    """A private, short shm directory (the agent's socket path has a length limit) whose agents
    are killed afterwards (those named by this directory on their command line)."""
    import tempfile

    d = tempfile.mkdtemp(prefix="spa-")
    yield d
    for pid in agents_of(d):
        kill_and_wait(pid)
    shutil.rmtree(d, ignore_errors=True)


def communicate(proc: subprocess.Popen, timeout: float) -> subprocess.CompletedProcess:
    """Waits for a started script's output; a script still running when `timeout` expires (or
    the wait fails) is killed and reaped before the error propagates."""
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run_script(path: str, *args, timeout: float) -> subprocess.CompletedProcess:
    return communicate(start_script(path, *args), timeout)


def flip_byte(path, offset: int, mask: int) -> None:
    """Corrupts a file in place: the byte at offset, xor mask."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))


def free_port() -> int:
    """A free TCP port on the loopback (for MASTER_PORT)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(argvs: list, timeout: float = 240) -> list:
    """Starts one Python process per argv (the ranks of a job) at once, waits for all, asserts
    each exited 0, and returns the JSON object each printed last. The processes are forked from
    a server that imported torch and safepoint once (tests/common/zygote.py): each would spend
    about 2.5 CPU-seconds importing them, and the suite starts hundreds."""
    import json

    import zygote

    # Output goes to files, not pipes: an agent a rank started outlives a rank that dies
    # without closing (it keeps the snapshots) and would hold a pipe open.
    outdir = tempfile.mkdtemp(prefix="ranks-")
    files = []
    for i in range(len(argvs)):
        files.append((os.path.join(outdir, f"{i}.out"), os.path.join(outdir, f"{i}.err")))
        for path in files[-1]:
            open(path, "w").close()
    forked = zygote.usable(dict(os.environ))
    try:
        if forked:
            procs = [zygote.start(argv, o, e) for argv, (o, e) in zip(argvs, files)]
        else:
            procs = []
            for argv, (o, e) in zip(argvs, files):
                with open(o, "w") as fo, open(e, "w") as fe:
                    procs.append(subprocess.Popen([sys.executable, *map(str, argv)],
                                                  stdout=fo, stderr=fe, text=True))
        outs = []
        for p, (o, e) in zip(procs, files):
            if forked:
                p.join(timeout)
                code = p.exitcode
                if code is None:
                    for q in procs:
                        q.kill()
                    raise AssertionError(f"a rank did not exit within {timeout} s")
            else:
                code = p.wait(timeout=timeout)
            with open(o) as fo, open(e) as fe:
                out, err = fo.read(), fe.read()
            assert code == 0, f"rank failed ({code}):\n{out}\n{err[-3000:]}"
            outs.append(json.loads(out.strip().splitlines()[-1]))
        return outs
    finally:
        shutil.rmtree(outdir, ignore_errors=True)


@pytest.fixture
def cluster():
    """Makes multi-node clusters (tests/common/nodes.py): `cluster(n, shm_size=...)` returns a
    started Cluster, closed after the test (also when it fails), which must leave no network
    namespace or link behind. Skips when this machine cannot make nodes (not root, no netns)."""
    import nodes

    reason = nodes.unavailable()
    if reason:
        pytest.skip(reason)
    made = []

    def make(n: int, **kw):
        c = nodes.Cluster(n, **kw).__enter__()
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()
    for c in made:
        assert c.leftovers() == [], f"cluster {c.k} left {c.leftovers()}"


CEPH_ENV_KEYS = ("SAFEPOINT_TEST_RADOS_URI", "SAFEPOINT_TEST_S3_URI", "SAFEPOINT_TEST_CEPH_DIR",
                 "CEPH_CONF", "CEPH_ARGS", "AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID",
                 "AWS_SECRET_ACCESS_KEY", "AWS_REGION")


@pytest.fixture(scope="session")
def ceph() -> dict:
    """The test Ceph cluster that scripts/with-ceph.sh started for this run (`make test` does):
    its environment (base URIs SAFEPOINT_TEST_RADOS_URI / SAFEPOINT_TEST_S3_URI, the cluster's
    directory SAFEPOINT_TEST_CEPH_DIR with run/*.pid, CEPH_CONF, CEPH_ARGS, AWS_*). Skips when
    the tests run without one."""
    missing = [k for k in CEPH_ENV_KEYS if not os.environ.get(k)]
    if missing:
        pytest.skip("no test Ceph cluster (run under scripts/with-ceph.sh, as `make test` does): "
                    + ", ".join(missing) + " unset")
    return {k: os.environ[k] for k in CEPH_ENV_KEYS}


@pytest.fixture
def dirs(tmp_path, monkeypatch):
    """(tmp_path, an shm directory of its own) for tests of storage tiers; failed tier copies
    are retried after 0.05, 0.1, 0.2 ... s instead of 1, 2, 4 ... s; the agents are killed
    after the test."""
    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setenv("SAFEPOINT_TIER_RETRY_SECONDS", "0.05")
    yield tmp_path, str(shm)
    kill_agents(str(shm))
