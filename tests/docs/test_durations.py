"""``python -m tests.durations``: the per-file table of a JUnit report."""

from tests.durations import main, seconds_by_test, tables

REPORT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.integration.test_a" name="test_one[x]" time="30.5" />
<testcase classname="tests.integration.test_a" name="test_two" time="9.5" />
<testcase classname="tests.core.test_b" name="test_three" time="10.0" />
</testsuite></testsuites>"""


def test_files_are_ranked_by_their_tests_seconds_with_their_slowest_test(tmp_path, capsys):
    report = tmp_path / "report.xml"
    report.write_text(REPORT)
    seconds = seconds_by_test(report)
    assert seconds == {
        "tests/integration/test_a.py::test_one[x]": 30.5,
        "tests/integration/test_a.py::test_two": 9.5,
        "tests/core/test_b.py::test_three": 10.0,
    }
    lines = tables(seconds, slowest=1).splitlines()
    assert lines[2] == "| tests/integration/test_a.py | 2 | 40 | 80% | test_one[x] (30) |"
    assert lines[3] == "| tests/core/test_b.py | 1 | 10 | 20% | test_three (10) |"
    assert (
        "3 tests, 50 worker-seconds" in lines
        and lines[-1] == "| tests/integration/test_a.py::test_one[x] | 30 |"
    )
    assert main([str(tmp_path / "missing.xml")]) == 2
    assert "make test` writes it" in capsys.readouterr().err
