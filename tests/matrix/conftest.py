"""``--record-expected``: print the expected-table row of the installed release."""

import pprint


def pytest_addoption(parser):
    parser.addoption("--record-expected", action="store_true", help="print compat.probe()'s row for tests/matrix/expected_table.py")


def pytest_configure(config):
    if config.getoption("--record-expected"):
        import compat
        from tests.matrix.expected_table import release, row

        report = compat.probe()
        print(f'\n    "{release(report)}": ' + pprint.pformat(row(report), indent=8, width=110) + ",")
