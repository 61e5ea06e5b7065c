"""The suite's CPU report: each test's CPU time (user + system, its own process and the subprocesses it waited for,
from ``getrusage``) and the total, printed at the end beside pytest's wall-clock durations. Wall time grows with the
machine's load; CPU time is what the suite costs, and what its budget is kept in (issue 30: ``make test`` <= 8 min of
CPU on the 2-core machine). Under xdist each worker measures its own tests and the figures travel in the reports.

    python -m pytest --cpu-report=15   # the 15 costliest tests (0: the total only)
"""

from __future__ import annotations

import resource

import pytest


def _cpu() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def pytest_addoption(parser):
    parser.addoption("--cpu-report", type=int, default=None, metavar="N",
                     help="list the N tests that cost the most CPU time, and the suite's total")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    start = _cpu()
    item.user_properties.append(("cpu_start", start))
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "teardown":
        start = dict(item.user_properties).get("cpu_start")
        if start is not None:
            report.user_properties.append(("cpu_s", _cpu() - start))


_costs: dict[str, float] = {}


def pytest_runtest_logreport(report):
    for name, value in report.user_properties:
        if name == "cpu_s":
            _costs[report.nodeid] = value


def pytest_terminal_summary(terminalreporter, config):
    n = config.getoption("--cpu-report")
    if n is None or not _costs:
        return
    total = sum(_costs.values())
    terminalreporter.write_sep("=", f"CPU time: {total / 60:.1f} min over {len(_costs)} tests (user + system, "
                                    "subprocesses included)")
    for nodeid, seconds in sorted(_costs.items(), key=lambda kv: -kv[1])[:n]:
        terminalreporter.write_line(f"{seconds:7.2f}s cpu  {nodeid}")
