"""``python -m tests.durations``: the per-file table of a JUnit report."""

import subprocess
import sys
import time

import pytest

from tests.conftest import _cpu_seconds, _machine_busy_seconds
from tests.durations import main, seconds_by_test, tables

REPORT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.integration.test_a" name="test_one[x]" time="30.5">
<properties><property name="cpu_seconds" value="52.25" /></properties></testcase>
<testcase classname="tests.integration.test_a" name="test_two" time="9.5" />
<testcase classname="tests.core.test_b" name="test_three" time="10.0">
<properties><property name="cpu_seconds" value="8.5" /></properties></testcase>
</testsuite></testsuites>"""


def test_files_are_ranked_by_their_tests_seconds_with_their_cpu_and_slowest_test(tmp_path, capsys):
    report = tmp_path / "report.xml"
    report.write_text(REPORT)
    seconds = seconds_by_test(report)
    assert seconds == {  # a test without the property (a report of another run) counts 0 CPU seconds
        "tests/integration/test_a.py::test_one[x]": (30.5, 52.25),
        "tests/integration/test_a.py::test_two": (9.5, 0.0),
        "tests/core/test_b.py::test_three": (10.0, 8.5),
    }
    lines = tables(seconds, slowest=1).splitlines()
    assert lines[2] == "| tests/integration/test_a.py | 2 | 40 | 80% | 52 | test_one[x] (30) |"
    assert lines[3] == "| tests/core/test_b.py | 1 | 10 | 20% | 8 | test_three (10) |"
    assert "3 tests, 50 worker-seconds, 61 CPU seconds" in lines
    assert lines[-1] == "| tests/integration/test_a.py::test_one[x] | 30 | 52 |"
    assert main([str(tmp_path / "missing.xml")]) == 2
    assert "make test` writes it" in capsys.readouterr().err


def test_the_cpu_seconds_count_the_processes_a_test_started_and_reaped():
    """tests/conftest.py's ``cpu_seconds``: a child that spins for 0.3 s of CPU adds at least that
    (getrusage's children's times: those waited for)."""
    before = _cpu_seconds()
    spin = "import time\nend = time.process_time() + 0.3\nwhile time.process_time() < end: pass"
    subprocess.run([sys.executable, "-c", spin], check=True)
    assert _cpu_seconds() - before >= 0.3


def test_the_machines_busy_seconds_count_a_spinning_process():
    """tests/conftest.py's run summary: /proc/stat's busy time rises by at least a process's CPU time
    (other processes only add; ticks of 10 ms)."""
    before = _machine_busy_seconds()
    end = time.process_time() + 0.3
    while time.process_time() < end:
        pass
    assert _machine_busy_seconds() - before >= 0.3 - 0.02


def test_a_file_that_is_no_report_and_a_negative_count_are_one_line_each(tmp_path, capsys):
    not_xml = tmp_path / "README.md"
    not_xml.write_text("# a page\n")
    assert main([str(not_xml)]) == 2
    assert capsys.readouterr().err.startswith(f"{not_xml} is not a JUnit XML report (")
    with pytest.raises(SystemExit) as stop:
        main([str(not_xml), "--tests", "-3"])
    assert stop.value.code == 2
    assert "--tests: '-3': allowed values: a whole number of at least 0" in capsys.readouterr().err
