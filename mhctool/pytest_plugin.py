"""pytest plugin: ``--mhctool-report PATH`` collects every ``mhctool.testing`` parity call of a
session into one Parquet report (the schema of ``mhctool parity``'s).

Registered through the ``pytest11`` entry point, so it loads in every pytest session of an
environment where mhctool is installed: it only adds the option and imports nothing heavy
(torch, Triton) unless the option is given.
"""
from __future__ import annotations

_KEY = "_mhctool_collector"


def pytest_addoption(parser):
    group = parser.getgroup("mhctool")
    group.addoption("--mhctool-report", metavar="PATH", default=None,
                    help="write every mhctool.testing.assert_parity/check_parity result of the session "
                         "to one Parquet report at PATH")


class _Collector:
    def __init__(self, path: str):
        self.path = path
        self.test = None  # node id of the running test
        self.results: list = []

    def __call__(self, result) -> None:
        self.results.append((self.test, result))

    def pytest_runtest_setup(self, item):
        self.test = item.nodeid

    def pytest_runtest_teardown(self, item):
        self.test = None

    def write(self):
        import pyarrow as pa

        from mhctool.core import environment, report
        tables = [r.table.replace_schema_metadata(None) for _, r in self.results]
        table = pa.concat_tables(tables) if tables else report.SCHEMA.empty_table()
        calls = [{"test": test, "run_id": r.table.column("run_id")[0].as_py() if r.table.num_rows else None,
                  "impl": r.impls, "passed": r.passed, "settings": r.settings} for test, r in self.results]
        run = {"command": "pytest --mhctool-report", "calls": calls}
        return report.write_atomic(report.with_metadata(table, "parity", environment.metadata(), run), self.path)


def pytest_configure(config):
    path = config.getoption("--mhctool-report", default=None)
    if path is None or hasattr(config, "workerinput"):  # pytest-xdist workers: see docs/api.md
        return
    import pytest

    from mhctool.core import report
    from mhctool import testing
    from mhctool.core.errors import UsageError
    try:
        report.check_writable(path, "--mhctool-report", suffixes=None, make_folder=True)
    except UsageError as e:
        raise pytest.UsageError(str(e)) from None
    collector = _Collector(path)
    testing._sinks.append(collector)
    config.pluginmanager.register(collector, "mhctool-collector")
    setattr(config, _KEY, collector)


def pytest_unconfigure(config):
    collector = getattr(config, _KEY, None)
    if collector is None:
        return
    from . import testing
    if collector in testing._sinks:
        testing._sinks.remove(collector)
    collector.write()


def pytest_report_header(config):
    collector = getattr(config, _KEY, None)
    return f"mhctool: parity results go to {collector.path}" if collector else None
