"""A pytest plugin for GPU runs: each failure's report appended to ``$OUT/failures.txt`` as it
happens, so a run stopped by its time limit keeps them (``PYTHONPATH=benchmarks/probes pytest -p
faillog ...``)."""

import os


def pytest_runtest_logreport(report):
    # under xdist the controller receives every worker's reports: only it writes, once each
    if report.failed and not os.environ.get("PYTEST_XDIST_WORKER"):
        with open(os.path.join(os.environ.get("OUT", "."), "failures.txt"), "a") as f:
            f.write(f"=== {report.nodeid} [{report.when}]\n{str(report.longrepr)[-2500:]}\n")
