"""GRAPHSERVE_ENGINE_CPUS (engine/cpu_affinity.py): the list is read as `taskset -c` writes it, refused naming the
switch, the value and the limit where it is no list, names a CPU this process may not use or leaves none for the
front-ends, and moves the calling thread off (server) or onto (engine) the CPUs it names."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from graphserve.engine import cpu_affinity
from graphserve.errors import ConfigError

ENV = "GRAPHSERVE_ENGINE_CPUS"


def test_lists_and_ranges_parse_as_taskset_writes_them():
    assert cpu_affinity.parse_cpus("3") == {3}
    assert cpu_affinity.parse_cpus("0,2") == {0, 2}
    assert cpu_affinity.parse_cpus("4-7") == {4, 5, 6, 7}
    assert cpu_affinity.parse_cpus(" 0, 4-5 ") == {0, 4, 5}
    assert cpu_affinity._ranges({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8"


@pytest.mark.parametrize(("value", "why"), [("a", "'a' is no CPU id"), ("1-", "'1-' is no CPU id"),
                                            ("0,,1", "'' is no CPU id"), ("5-2", "runs backwards")])
def test_a_value_that_is_no_list_is_refused(value, why):
    with pytest.raises(ConfigError) as err:
        cpu_affinity.parse_cpus(value)
    assert ENV in err.value.message and repr(value) in err.value.message and why in err.value.message


def test_cpus_outside_this_process_or_all_of_them_are_refused(monkeypatch):
    monkeypatch.setattr(cpu_affinity.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setenv(ENV, "2,6-7")
    with pytest.raises(ConfigError) as err:
        cpu_affinity.engine_cpus()
    assert "CPU(s) [6, 7] are not among the 4 this process may use (0-3)" in err.value.message
    monkeypatch.setenv(ENV, "0-3")
    with pytest.raises(ConfigError) as err:
        cpu_affinity.engine_cpus()
    assert "takes all 4 CPUs" in err.value.message and "leave at least one" in err.value.message
    monkeypatch.setenv(ENV, "1-2")
    assert cpu_affinity.engine_cpus() == {1, 2}
    monkeypatch.delenv(ENV)
    assert cpu_affinity.engine_cpus() is None and cpu_affinity.keep_server_off_engine_cpus() is None


def test_the_server_leaves_the_engine_cpus_and_the_engine_takes_them(monkeypatch):
    allowed = os.sched_getaffinity(0)
    assert len(allowed) >= 2, f"this test needs 2 CPUs to split, the process may use {sorted(allowed)}"
    engine = max(allowed)
    monkeypatch.setenv(ENV, str(engine))
    threads = torch.get_num_threads()
    started = threading.Event()
    stop = threading.Event()
    earlier = threading.Thread(target=lambda: (started.set(), stop.wait(10)))  # started before: moved as well
    earlier.start()
    started.wait(10)
    try:
        assert cpu_affinity.keep_server_off_engine_cpus() == {engine}
        assert os.sched_getaffinity(0) == os.sched_getaffinity(earlier.native_id) == allowed - {engine}
        torch.set_num_threads(2)
        cpu_affinity.pin_engine_process()
        assert os.sched_getaffinity(0) == os.sched_getaffinity(earlier.native_id) == {engine}
        assert torch.get_num_threads() == 1  # torch's threads fit the one CPU
    finally:
        cpu_affinity.set_process_cpus(allowed)
        torch.set_num_threads(threads)
        stop.set()
        earlier.join(10)
    assert os.sched_getaffinity(0) == allowed


def test_an_engine_cpu_the_machine_lacks_is_refused_in_the_engine(monkeypatch):
    allowed = os.sched_getaffinity(0)
    monkeypatch.setenv(ENV, "4095")
    try:
        with pytest.raises(ConfigError) as err:
            cpu_affinity.pin_engine_process()
    finally:
        cpu_affinity.set_process_cpus(allowed)
    assert f"{ENV}='4095' is invalid: the engine process cannot run there" in err.value.message
