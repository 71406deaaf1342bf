"""A pytest plugin for GPU runs: each failure's report appended to ``$OUT/failures.txt`` as it
happens, so a run stopped by its time limit keeps them (``PYTHONPATH=benchmarks/probes pytest -p
faillog ...``). The file's first line is ``$RUN_HEADER`` (run_on_gpu.sh: device, date, command)."""

import os


def pytest_runtest_logreport(report):
    # under xdist the controller receives every worker's reports: only it writes, once each
    if report.failed and not os.environ.get("PYTEST_XDIST_WORKER"):
        path = os.path.join(os.environ.get("OUT", "."), "failures.txt")
        with open(path, "a") as f:
            if f.tell() == 0 and os.environ.get("RUN_HEADER"):
                f.write(os.environ["RUN_HEADER"] + "\n")
            f.write(f"=== {report.nodeid} [{report.when}]\n{str(report.longrepr)[-2500:]}\n")
