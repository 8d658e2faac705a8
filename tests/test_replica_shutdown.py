"""Serve calls a replica's `__del__` once when it stops it: every engine replica closes its KV
endpoint (prefill: the pushes in its send pool finish, then the sender closes; decode: the
receiver) and then stops its engine thread, also when closing the endpoint fails. No Ray cluster: the deployments' own classes with fakes."""

import concurrent.futures
import time

import pytest

from colocated_service.server import ColocatedServer
from decode_service.server import DecodeServer
from prefill_service.server import PrefillServer


class Fake:
    def __init__(self, log: list, name: str, fail: bool = False):
        self.log, self.name, self.fail = log, name, fail

    def close(self):
        self.log.append(f"{self.name}.close")
        if self.fail:
            raise RuntimeError("close failed")

    def shutdown(self):
        self.log.append(f"{self.name}.shutdown")


def replica(deployment, **attrs):
    obj = object.__new__(deployment.func_or_class)
    for name, value in attrs.items():
        setattr(obj, name, value)
    return obj


@pytest.mark.parametrize("fail", [False, True])
def test_prefill_closes_its_sender_then_the_engine(fail):
    log = []
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    r = replica(PrefillServer, host=Fake(log, "host"), sender=Fake(log, "sender", fail), _send_pool=pool)
    pool.submit(lambda: time.sleep(0.2) or log.append("push"))     # a push already handed to the pool
    r.__del__()
    assert log == ["push", "sender.close", "host.shutdown"]
    with pytest.raises(RuntimeError):
        pool.submit(print)          # the send pool is shut down too


@pytest.mark.parametrize("fail", [False, True])
def test_decode_closes_its_receiver_then_the_engine(fail):
    log = []
    r = replica(DecodeServer, host=Fake(log, "host"), receiver=Fake(log, "receiver", fail))
    r.__del__()
    r.__del__()                     # Python's own call at collection does nothing more
    assert log == ["receiver.close", "host.shutdown"]


def test_colocated_stops_its_engine():
    log = []
    r = replica(ColocatedServer, host=Fake(log, "host"))
    r.__del__()
    assert log == ["host.shutdown"]


def test_a_half_built_replica_tears_down_quietly():
    replica(PrefillServer).__del__()
