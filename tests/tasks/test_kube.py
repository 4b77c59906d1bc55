"""The deploy lock in a cluster (tasks/lib/kube.py): a coordination.k8s.io Lease against an
in-process API server with Kubernetes' optimistic concurrency (tests/kube_api.py)."""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Iterator

import pytest
from kube_api import FakeKubeApi

from tasks.lib.kube import KubeApi, Lease, LeaseLost, micro_time

NAMESPACE = "llm-pipeline"
LEASE = f"/apis/coordination.k8s.io/v1/namespaces/{NAMESPACE}/leases/llm-serving-deploy"


@pytest.fixture
def api() -> Iterator[tuple[FakeKubeApi, KubeApi]]:
    with FakeKubeApi(NAMESPACE) as fake:
        yield fake, KubeApi(fake.url, "token", None, timeout_s=5)


def lease(client: KubeApi, duration_s: int = 30) -> Lease:
    return Lease(client, NAMESPACE, "llm-serving-deploy", duration_s, poll_s=0.01)


def test_one_deployer_holds_the_lock_at_a_time(api: tuple[FakeKubeApi, KubeApi]) -> None:
    """Six deployers race for the Lease from the start (it does not exist yet: they race to create
    it, then to take it from each other): never two inside at once, and each gets its turn."""
    fake, client = api
    inside, most, turns = 0, 0, []
    count = threading.Lock()
    start = threading.Barrier(6)

    def deployer(index: int) -> None:
        nonlocal inside, most
        held = lease(client)
        start.wait()
        held.acquire()
        try:
            with count:
                inside += 1
                most = max(most, inside)
            time.sleep(0.05)
            turns.append(index)
            with count:
                inside -= 1
        finally:
            held.release()

    threads = [threading.Thread(target=deployer, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert most == 1 and sorted(turns) == list(range(6))
    conflicts = [r for r in fake.requests if r[2] == 409]
    assert conflicts, "the deployers never raced: the test proved nothing"  # 409s: the API server said no
    assert not fake.get(LEASE)["spec"].get("holderIdentity")  # released
    assert fake.get(LEASE)["spec"]["leaseTransitions"] >= 5


def test_a_dead_holders_lock_is_free_after_its_duration_and_it_can_no_longer_deploy(
        api: tuple[FakeKubeApi, KubeApi]) -> None:
    fake, client = api
    dead = lease(client, duration_s=2)
    dead.acquire()
    dead.check()
    dead._stop.set()  # its pod paused or died: nothing renews the Lease any more, nothing releases it
    successor = lease(client, duration_s=2)
    assert successor.try_acquire() == dead.identity  # its record still changing, as far as we know: held
    started = time.monotonic()
    successor.acquire()
    waited = time.monotonic() - started
    assert 1.5 < waited < 4, waited  # its record unchanged for the duration, on our clock: free (not an hour)
    assert fake.get(LEASE)["spec"]["holderIdentity"] == successor.identity
    # the paused holder resumes: on its own clock its last good write is too old, before any API call
    with pytest.raises(LeaseLost, match=r"was not renewed for 2s \(this process paused, or the API server "
                                        r"unreachable\): another deployer may hold it: this deploy stopped"):
        dead.check()
    dead.renew()  # and the API server says who holds it
    with pytest.raises(LeaseLost, match=f"held by {successor.identity} now: this deploy stopped"):
        dead.check()
    dead.release()  # releases nothing of the successor's
    assert fake.get(LEASE)["spec"]["holderIdentity"] == successor.identity
    successor.release()


def test_the_holder_renews_its_lock_while_it_deploys(api: tuple[FakeKubeApi, KubeApi]) -> None:
    fake, client = api
    held = lease(client, duration_s=1)  # renewed every third of a second
    held.acquire()
    first = renewed_at(fake)
    time.sleep(2.5)  # longer than the duration: without renewals a rival would take it
    assert renewed_at(fake) > first + 1.5
    rival = lease(client, duration_s=1)
    assert rival.try_acquire() == held.identity
    time.sleep(1.5)
    assert rival.try_acquire() == held.identity  # still: its record keeps changing
    held.check()
    held.release()


def test_a_live_holder_with_a_skewed_clock_keeps_its_lock(api: tuple[FakeKubeApi, KubeApi]) -> None:
    """A holder on a node whose clock is 26 years behind writes renewTimes long past by ours: it
    is alive as long as its record keeps changing (client-go's rule), so nobody takes it over."""
    fake, client = api
    behind = dt.datetime(2000, 1, 1, tzinfo=dt.UTC).timestamp()
    skewed = lease(client, duration_s=1)
    skewed.acquire()
    skewed._stop.set()  # renewed by hand below, with its clock
    stop = threading.Event()

    def renew_with_a_skewed_clock() -> None:
        while not stop.wait(0.2):
            current = fake.get(LEASE)
            current["spec"]["renewTime"] = micro_time(behind + time.monotonic())
            client.call("PUT", LEASE, current)

    renewer = threading.Thread(target=renew_with_a_skewed_clock)
    renewer.start()
    rival = lease(client, duration_s=1)
    try:
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            assert rival.try_acquire() == skewed.identity
            time.sleep(0.05)
    finally:
        stop.set()
        renewer.join()


def renewed_at(fake: FakeKubeApi) -> float:
    return dt.datetime.fromisoformat(fake.get(LEASE)["spec"]["renewTime"]).timestamp()


def test_a_failed_release_never_hides_the_deploys_own_outcome(api: tuple[FakeKubeApi, KubeApi]) -> None:
    fake, client = api
    held = lease(client)
    held.acquire()
    fake.server.shutdown()  # the API server unreachable when the deploy ends
    fake.server.server_close()
    started = time.monotonic()
    held.release()  # logged, not raised
    assert time.monotonic() - started < 15
