"""No stall outlives its budget on s3://, end to end (issue 33 item 6): persist (`path` on s3://),
tier copy (an s3:// tier) and load, against the throwaway Ceph's real radosgw (the `ceph`
fixture; skipped without it), with a radosgw of this module's own (test_tier_faults.Gateway) so
that stopping it disturbs no other test.

Two kinds of fault:
- radosgw SIGSTOPped in the middle of an upload or a download (at a known point: after the
  gateway answered a given part), and SIGCONTed either after a request was seen retried (a
  stall shorter than the retry budget: the operation ends well, and the parts uploaded before
  the stall are not uploaded again) or after the operation failed (past the budget: an error
  naming the rank, the object and the endpoint; nothing partial listed; the next one works);
- a fault-injecting proxy in front of the same gateway (tests/common/s3_proxy.py: every request
  it does not fault is forwarded to radosgw) that answers bursts of `503 SlowDown` with S3's
  XML error, or holds a request without answering (a part that makes no progress).

The proxy also counts what the client sent: UploadPart requests per part number, which
connection each came on, and whether the client closed the connection of a request that timed
out. Waits only guard against hangs (tests/common/processes.py); no assertion depends on how
long anything takes.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from typing import Optional

import pytest

import safepoint
from safepoint import Checkpointer, Tier

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "common"))
from processes import HANG, agent_log, wait_until  # noqa: E402
from s3_proxy import IMAGE_GET, UPLOAD_PART, FaultProxy, matches  # noqa: E402
from test_tier_faults import (  # noqa: E402  (one gateway helper for both modules)
    Gateway,
    every_listed_step_is_whole,
    loads_bit_exact,
    s3_uri,
    steps_or_none,
    tier_idle,
    tier_state,
)
from test_tiers import state  # noqa: E402

# A load of step 1 from argv[1] that prints its step and whether it is bit-exact.
LOADER = """
import sys
import safepoint
from test_tiers import same, state
step, got = safepoint.load(sys.argv[1], 1)
print(step, same(got, state(1, int(sys.argv[2]))))
"""

N = 8 << 20  # float32 elements: a 32 MiB image, 4 parts of 8 MiB and a short fifth
PART = "part_size=8M"  # a multiple of the image's 4 MiB checksum chunks (whole-part writes)


@pytest.fixture(scope="module")
def _gateway(ceph):
    gw = Gateway(ceph["SAFEPOINT_TEST_CEPH_DIR"])
    gw.name = f"client.rgw.sps3f{os.getpid()}"  # not test_tier_faults' own gateway's name
    gw.start()
    yield gw
    gw.kill()
    shutil.rmtree(gw.files, ignore_errors=True)


@pytest.fixture
def proxy(ceph, _gateway, monkeypatch):
    """A fresh proxy in front of the module's running gateway; this process and the agents it
    starts reach the gateway through it."""
    _gateway.healthy()
    p = FaultProxy(_gateway.port)
    monkeypatch.setenv("AWS_ENDPOINT_URL", p.endpoint)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    # A fresh (or resumed) radosgw can take seconds over its first answers on a loaded machine:
    # one listing with a generous timeout before the tests' short ones.
    safepoint.steps(f"{s3_uri(ceph, 'warm-up')}?timeout=120")
    yield p
    p.close()
    _gateway.healthy()


def multipart_creates(proxy: FaultProxy, key: str) -> int:
    return sum(1 for r in proxy.requests
               if r.method == "POST" and "uploads" in r.query and r.path == key)


def aborted(proxy: FaultProxy, key: str) -> bool:
    return any(r.method == "DELETE" and "uploadId" in r.query and r.path == key
               for r in proxy.requests)


def image_key(proxy: FaultProxy, step: int) -> str:
    """The key of the (one) multipart image of `step` the client uploaded."""
    keys = {r.path for r in proxy.requests if r.part is not None
            and f"/step-{step:020d}/" in r.path}
    assert len(keys) == 1, keys
    return keys.pop()


def names_the_failure(message: str, key: str, proxy: FaultProxy) -> None:
    """The error a user sees names the rank (rank-00000 is rank 0's image), the object (its
    s3:// name) and the endpoint the requests went to."""
    assert "s3://" + key.lstrip("/") in message and "/rank-00000." in message, (message, key)
    assert f"endpoint {proxy.endpoint}" in message, message


# --- a part that makes no progress -------------------------------------------------------------

def test_a_stalled_part_is_retried_on_a_fresh_connection_and_the_upload_resumes(
        ceph, proxy, dirs):
    tmp, shm = dirs
    base = s3_uri(ceph, "stalled-part")
    # 10 s: on a loaded machine no part that makes progress comes near it.
    ck = Checkpointer(f"{base}?timeout=10&retries=2&{PART}", job="s3f-part", shm_dir=shm,
                      keep=10)
    # Part 3 of step 1's image is read by the proxy and never answered, once: no byte comes
    # back, so the request times out (stall detection) and is sent again.
    proxy.stall({"part": 3, "path_contains": "/step-00000000000000000001/"})
    ck.save(1, state(1, N))
    ck.wait()
    key = image_key(proxy, 1)
    stalled = [r for r in proxy.requests if r.action == "stalled"]
    assert len(stalled) == 1 and stalled[0].part == 3, stalled
    # The client closed the connection of the request that timed out (its curl handle is not
    # reused) and sent the part again on another connection.
    assert wait_until(lambda: proxy.requests[stalled[0].id].client_closed), stalled
    again = [r for r in proxy.requests if r.part == 3 and r.path == key and r.id != stalled[0].id]
    assert [r.status for r in again] == [200] and again[0].conn != stalled[0].conn, again
    # The upload resumed: one multipart upload, every other part sent exactly once.
    parts = proxy.part_uploads(key)
    assert parts[3] == 2 and all(n == 1 for p, n in parts.items() if p != 3), parts
    assert sorted(parts) == list(range(1, 6)), parts
    assert multipart_creates(proxy, key) == 1 and not aborted(proxy, key)
    ck.close()
    assert safepoint.steps(base) == [1]
    assert loads_bit_exact(base, 1, N)


def test_a_download_that_stops_mid_body_is_retried_on_a_fresh_connection(ceph, proxy):
    base = s3_uri(ceph, "stalled-get")
    uri = f"{base}?timeout=10&retries=2&{PART}"
    safepoint.save(uri, 1, state(1, N))
    # The image's second part-sized range: its answer stops after 1 MiB of its 8 MiB body.
    second = {**IMAGE_GET, "range": f"bytes={8 << 20}-{(16 << 20) - 1}"}
    proxy.stall(second, after_bytes=1 << 20)
    assert loads_bit_exact(uri, 1, N)  # the retry's bytes replace the first attempt's
    stalled = [r for r in proxy.requests if r.action == "stalled"]
    assert len(stalled) == 1 and matches(second, stalled[0]), stalled
    assert wait_until(lambda: proxy.requests[stalled[0].id].client_closed), stalled
    again = [r for r in proxy.requests if matches(second, r) and r.id > stalled[0].id]
    assert again and again[0].status == 206 and again[0].conn != stalled[0].conn, again


# --- radosgw SIGSTOPped mid-upload and mid-download --------------------------------------------

def stop_after_part(proxy: FaultProxy, gw: Gateway, part: int) -> None:
    """SIGSTOPs the gateway when its answer to UploadPart `part` arrives (before the client sees
    it)."""
    proxy.on_answer({"part": part}, gw.proc.pid, signal.SIGSTOP)


def parts_done_at_the_stop(proxy: FaultProxy) -> set[int]:
    """The parts the gateway had answered 200 when it was stopped (the one whose answer stopped
    it included)."""
    [answered] = proxy.signalled()
    return {r.part for r in proxy.requests if r.id in answered and r.part is not None}


def a_request_was_retried(proxy: FaultProxy, match: Optional[dict] = None) -> bool:
    """The client sent a request (that `match`es) again that had got no answer: it outlasted its
    timeout."""
    unanswered = set()
    for r in proxy.requests:
        if not matches(match or {}, r):
            continue
        what = (r.method, r.path, tuple(sorted(r.query.items())), r.range)
        if what in unanswered:
            return True
        if r.status == 0:
            unanswered.add(what)
    return False




def test_persist_resumes_its_multipart_upload_after_a_short_gateway_stop(ceph, _gateway, proxy,
                                                                         dirs):
    tmp, shm = dirs
    base = s3_uri(ceph, "sigstop-persist")
    # connections=2: at most two parts in flight, so parts are still to go when it stops.
    ck = Checkpointer(f"{base}?timeout=5&retries=4&{PART}&connections=2", job="s3f-stop",
                      shm_dir=shm, keep=10)
    stop_after_part(proxy, _gateway, 2)
    ck.save(1, state(1, N))
    # The stop outlasts a request (one is sent again), not the retries; then it resumes.
    assert wait_until(lambda: a_request_was_retried(proxy, UPLOAD_PART)), proxy.requests
    _gateway.signal(signal.SIGCONT)
    ck.wait()
    key = image_key(proxy, 1)
    parts = proxy.part_uploads(key)
    done = parts_done_at_the_stop(proxy)
    assert 2 in done and all(parts[p] == 1 for p in done), (done, parts)  # not uploaded again
    assert sorted(parts) == list(range(1, 6)) and max(parts.values()) >= 2, parts
    assert multipart_creates(proxy, key) == 1 and not aborted(proxy, key)
    st = ck.status()
    assert st["persists_failed"] == 0 and st["newest_committed"] == 1, st
    ck.close()
    assert safepoint.steps(base) == [1]
    assert loads_bit_exact(base, 1, N)


def test_persist_past_its_budget_fails_wait_naming_rank_object_and_endpoint(ceph, _gateway,
                                                                             proxy, dirs):
    tmp, shm = dirs
    base = s3_uri(ceph, "sigstop-persist-fail")
    # timeout=5: the stop outlasts both attempts (about 10 s), while an 8 MiB part through a
    # resumed gateway on a loaded machine does not come near it (with 2 s, CI once saw step 3's
    # first part time out twice after the SIGCONT).
    path = f"{base}?timeout=5&retries=1&{PART}&connections=2"
    ck = Checkpointer(path, job="s3f-stopfail", shm_dir=shm, keep=10)
    ck.save(1, state(1, N))
    ck.wait()
    stop_after_part(proxy, _gateway, 2)
    ck.save(2, state(2, N))
    with pytest.raises(safepoint.Error) as failed:
        ck.wait()
    key = image_key(proxy, 2)
    names_the_failure(str(failed.value), key, proxy)
    st = ck.status()  # the agent answers, and says the same
    assert st["persists_failed"] >= 1, st
    names_the_failure(st["last_persist_error"], key, proxy)

    _gateway.signal(signal.SIGCONT)
    # Nothing of step 2 is listed (its upload was aborted); the next step goes down.
    assert wait_until(lambda: aborted(proxy, key)), proxy.requests
    assert safepoint.steps(base) == [1]
    ck.save(3, state(3, N))
    ck.wait()
    ck.close()
    assert every_listed_step_is_whole(base, 1, 3, n=N) == [1, 3]


def test_a_tier_copy_stopped_mid_upload_fails_in_status_and_catches_up(ceph, _gateway, proxy,
                                                                       dirs):
    tmp, shm = dirs
    path = tmp / "nvme"
    tier = s3_uri(ceph, "sigstop-tier")
    ck = Checkpointer(path, job="s3f-tier", shm_dir=shm, keep=10,
                      tiers=[Tier(f"{tier}?timeout=2&retries=1&{PART}&connections=2", keep=10)])
    stop_after_part(proxy, _gateway, 2)
    ck.save(1, state(1, N))
    ck.wait()  # `path` is not held up
    assert wait_until(lambda: tier_state(ck)["failures"] > 0), tier_state(ck)
    bad = tier_state(ck)
    key = image_key(proxy, 1)
    assert "s3://" + key.lstrip("/") in bad["last_error"], bad
    assert f"endpoint {proxy.endpoint}" in bad["last_error"], bad
    assert bad["newest_step"] is None, bad
    assert safepoint.steps(path) == [1]

    _gateway.signal(signal.SIGCONT)
    assert wait_until(lambda: 1 in (steps_or_none(tier) or []) and tier_idle(ck)), \
        (tier_state(ck), agent_log(shm, "s3f-tier")[-3000:])
    assert tier_state(ck)["last_error"] == ""
    ck.close()
    assert every_listed_step_is_whole(tier, 1, n=N) == [1]


def test_a_tier_copy_resumes_its_upload_after_a_short_gateway_stop(ceph, _gateway, proxy, dirs):
    tmp, shm = dirs
    path = tmp / "nvme"
    tier = s3_uri(ceph, "sigstop-tier-resume")
    ck = Checkpointer(path, job="s3f-tierok", shm_dir=shm, keep=10,
                      tiers=[Tier(f"{tier}?timeout=5&retries=4&{PART}&connections=2", keep=10)])
    stop_after_part(proxy, _gateway, 2)
    ck.save(1, state(1, N))
    ck.wait()
    assert wait_until(lambda: a_request_was_retried(proxy, UPLOAD_PART)), proxy.requests
    _gateway.signal(signal.SIGCONT)
    assert wait_until(lambda: tier_state(ck)["newest_step"] == 1 and tier_idle(ck)), \
        (tier_state(ck), agent_log(shm, "s3f-tierok")[-3000:])
    done = tier_state(ck)
    assert done["failures"] == 0 and done["last_error"] == "", done  # the copy never failed
    key = image_key(proxy, 1)
    parts = proxy.part_uploads(key)
    before = parts_done_at_the_stop(proxy)
    assert 2 in before and all(parts[p] == 1 for p in before), (before, parts)
    assert multipart_creates(proxy, key) == 1 and not aborted(proxy, key)
    ck.close()
    assert every_listed_step_is_whole(tier, 1, n=N) == [1]


@pytest.mark.parametrize("resume", ["after-a-retry", "after-the-failure"])
def test_a_load_stopped_mid_download(ceph, _gateway, proxy, resume):
    base = s3_uri(ceph, "sigstop-load")
    # After a retry: a budget of 5 requests of up to 5 s (whole 8 MiB ranges through a gateway
    # that has just resumed, on a loaded machine); after the failure: 2 of 2 s.
    uri = f"{base}?{'timeout=5&retries=4' if resume == 'after-a-retry' else 'timeout=2&retries=1'}"
    uri += f"&{PART}"
    safepoint.save(uri, 1, state(1, N))
    # The gateway stops when it has answered the first ranged GET of the image.
    proxy.on_answer(IMAGE_GET, _gateway.proc.pid, signal.SIGSTOP)
    if resume == "after-a-retry":
        # In a process of its own: this one must resume the gateway while the load runs, and a
        # call into the core may hold Python's GIL while its requests wait.
        loader = subprocess.Popen(
            [sys.executable, "-c", LOADER, uri, str(N)], stdout=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        assert wait_until(lambda: a_request_was_retried(proxy) or loader.poll() is not None), \
            proxy.requests
        _gateway.signal(signal.SIGCONT)
        out, _ = loader.communicate(timeout=HANG)
        assert loader.returncode == 0 and out.split() == ["1", "True"], (loader.returncode, out)
        if not a_request_was_retried(proxy):
            # Every ranged GET was answered before the stop held one (a timing of a loaded
            # machine, seen once in `make test`): the load is checked, but nothing was retried.
            pytest.skip("every ranged GET of the load was answered before the gateway stopped")
        return
    with pytest.raises(safepoint.Error) as failed:
        safepoint.load(uri, 1)
    key = next(r.path for r in proxy.requests if matches(IMAGE_GET, r))
    names_the_failure(str(failed.value), key, proxy)
    _gateway.signal(signal.SIGCONT)
    assert loads_bit_exact(uri, 1, N)


# --- bursts of 503 SlowDown --------------------------------------------------------------------

def test_persist_through_503_bursts(ceph, proxy, dirs):
    tmp, shm = dirs
    base = s3_uri(ceph, "slowdown-persist")
    ck = Checkpointer(f"{base}?timeout=10&retries=3&{PART}", job="s3f-503", shm_dir=shm, keep=10)
    # A burst of 3 (every request, whichever comes): no request gets more than its 3 retries.
    proxy.slow_down(3)
    ck.save(1, state(1, N))
    ck.wait()
    assert proxy.count("slowdown") == 3
    # Past the retries: every UploadPart is answered SlowDown.
    proxy.slow_down(None, UPLOAD_PART)
    ck.save(2, state(2, N))
    with pytest.raises(safepoint.Error) as failed:
        ck.wait()
    key = image_key(proxy, 2)
    message = str(failed.value)
    names_the_failure(message, key, proxy)
    assert "SlowDown" in message and "after 4 attempts" in message, message
    assert wait_until(lambda: aborted(proxy, key))
    proxy.clear()
    ck.save(3, state(3, N))
    ck.wait()
    ck.close()
    assert every_listed_step_is_whole(base, 1, 3, n=N) == [1, 3]


def test_a_tier_copy_through_503_bursts(ceph, proxy, dirs):
    tmp, shm = dirs
    path = tmp / "nvme"
    tier = s3_uri(ceph, "slowdown-tier")
    ck = Checkpointer(path, job="s3f-503t", shm_dir=shm, keep=10,
                      tiers=[Tier(f"{tier}?timeout=10&retries=2&{PART}", keep=10)])
    proxy.slow_down(2)
    ck.save(1, state(1, N))
    ck.wait()
    assert wait_until(lambda: tier_state(ck)["newest_step"] == 1 and tier_idle(ck)), \
        tier_state(ck)
    assert proxy.count("slowdown") == 2 and tier_state(ck)["failures"] == 0, tier_state(ck)

    # Past the retries: the copy fails in status(), naming the object and the endpoint.
    proxy.slow_down(None, UPLOAD_PART)
    ck.save(2, state(2, N))
    ck.wait()
    assert wait_until(lambda: tier_state(ck)["failures"] > 0), tier_state(ck)
    bad = tier_state(ck)
    key = image_key(proxy, 2)
    assert "s3://" + key.lstrip("/") in bad["last_error"], bad
    assert f"endpoint {proxy.endpoint}" in bad["last_error"], bad
    assert "SlowDown" in bad["last_error"] and bad["newest_step"] == 1, bad
    assert safepoint.steps(tier) == [1]
    # The burst ends: the tier catches up (its retry of the failed copy).
    proxy.clear()
    assert wait_until(lambda: 2 in (steps_or_none(tier) or []) and tier_idle(ck)), \
        (tier_state(ck), agent_log(shm, "s3f-503t")[-3000:])
    assert tier_state(ck)["last_error"] == ""
    ck.close()
    assert every_listed_step_is_whole(tier, 1, 2, n=N) == [1, 2]


def test_a_load_through_503_bursts(ceph, proxy):
    base = s3_uri(ceph, "slowdown-load")
    uri = f"{base}?timeout=10&retries=2&{PART}"
    safepoint.save(uri, 1, state(1, N))

    proxy.slow_down(2, IMAGE_GET)
    assert loads_bit_exact(uri, 1, N)
    assert proxy.count("slowdown") == 2
    proxy.slow_down(None, IMAGE_GET)
    with pytest.raises(safepoint.Error) as failed:
        safepoint.load(uri, 1)
    message = str(failed.value)
    key = next(r.path for r in proxy.requests if r.action == "slowdown")
    names_the_failure(message, key, proxy)
    assert "SlowDown" in message and "after 3 attempts" in message, message
    proxy.clear()
    assert loads_bit_exact(uri, 1, N)
