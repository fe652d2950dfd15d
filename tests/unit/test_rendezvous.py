"""The rendezvous of a launch: a one-process world listens on a port the kernel picks as it
binds; a test launch's ranks meet on a port of ``testing.RENDEZVOUS_PORTS``, below the
ephemeral range, drawn from the pytest-xdist worker's own share."""

import os
import socket

import pytest

from loggra_megatron import testing
from loggra_megatron.parallel import single_process_env


@pytest.fixture
def fresh_walk(monkeypatch):
    """``rendezvous_port`` as a new process would start it."""
    monkeypatch.setattr(testing, "_share_walk", type(testing._share_walk)())


def test_a_one_process_world_listens_on_a_port_the_kernel_picks(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    single_process_env()
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["MASTER_PORT"]) == (
        "0",
        "1",
        "0",
    )
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.delenv("RANK")
    single_process_env()
    assert os.environ["MASTER_PORT"] == "29500"  # the user's choice is kept


def test_the_ports_lie_below_the_kernels_ephemeral_range():
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    assert testing.RENDEZVOUS_PORTS[-1] < low


def test_each_xdist_worker_draws_from_its_own_share(monkeypatch, fresh_walk):
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    drawn = {}
    for worker in ("gw0", "gw1"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        testing._share_walk.clear()
        drawn[worker] = {testing.rendezvous_port() for _ in range(50)}
    assert len(drawn["gw0"]) == len(drawn["gw1"]) == 50  # successive calls differ
    assert {p % 2 for p in drawn["gw0"]} == {0} and {p % 2 for p in drawn["gw1"]} == {1}
    assert all(p in testing.RENDEZVOUS_PORTS for p in drawn["gw0"] | drawn["gw1"])


def test_a_port_in_use_is_passed_over(monkeypatch, fresh_walk):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    first = testing.rendezvous_port()
    testing._share_walk.rotate(1)  # the walk starts again at the same port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", first))
        held.listen()
        assert testing.rendezvous_port() != first
