"""Writes tests/slow-tests.txt: the tests the README's command leaves to ``pytest --slow``, so that
the suite stays within 3 minutes on CI's 2 cores. From a durations run on a 2-core machine:

    pytest -q -n auto --dist worksteal -p no:cacheprovider --durations=0 [--slow] > /tmp/dur.txt
    python dev/slow_tests.py [--threshold S] /tmp/dur.txt [/tmp/dur2.txt ...]

A test whose call took S (default 2) or more in any of the runs is listed (a test's time moves
with what ran before it in its process: 3 s in one run, 10 s in the next), unless KEEP names it: one
end-to-end test of each thing that only such a test checks stays in the fast suite. The list is
data: a test renamed or a sample moved to another line drops out of it and runs again (slower,
never lost); run this again after a durations run."""
from __future__ import annotations

import re
import sys
from pathlib import Path

# kept in the fast suite whatever they take (about 50 s of a 2-core CPU's time together)
KEEP = {
    "tests/test_packaging.py::test_wheel_builds_and_imports",
    "tests/spread/test_isolation.py::test_ctrl_c_writes_what_was_measured_and_exits_130",
    "tests/analyses/test_first_step.py::test_a_backward_that_skips_the_normalisations_fails_at_the_first_step_naming_h_res",
    "tests/docs/test_samples.py::test_a_sample_is_what_its_command_prints[README.md:48]",
    "tests/cli/test_parity.py::test_parity_all_native_passes_and_writes_the_report",
    "tests/cli/test_parity.py::test_external_errors_are_failed_cases_and_others_still_run",
    "tests/runner/test_checks.py::test_builtin_triton_h_aggregate_passes_both_checks_on_the_cpu",
    "tests/analyses/test_train.py::test_without_an_implementation_it_trains_mhctools_triton_kernels",
    "tests/analyses/test_gate.py::test_junit_markdown_and_report_names_hold_no_absolute_path",
    "tests/analyses/test_strangers.py::test_identify_names_the_overflow_not_a_convention",
    "tests/libraries/test_libraries.py::test_megatron_dev_passes_under_its_declared_conventions",
    "tests/cli/test_shutdown.py::test_a_line_written_at_shutdown_goes_to_the_library_log",
}
# every kernel's numerics against float64 stay in the fast suite, whatever they take
KEEP_FILES = ("tests/kernels/test_triton.py", "tests/kernels/test_moe.py", "tests/references/")

LINE = re.compile(r"^([0-9.]+)s call\s+(\S+)")


def slow_ids(texts: list[str], threshold: float) -> list[str]:
    out = set()
    for text in texts:
        for line in text.splitlines():
            m = LINE.match(line)
            if not m or float(m.group(1)) < threshold:
                continue
            node = m.group(2)
            if node in KEEP or node.startswith(KEEP_FILES):
                continue
            out.add(node)
    return sorted(out)


def main(argv: list[str]) -> int:
    threshold = 2.0
    if argv[:1] == ["--threshold"]:
        threshold, argv = float(argv[1]), argv[2:]
    ids = slow_ids([Path(a).read_text() for a in argv], threshold)
    head = (f"# tests the README's command leaves to `pytest --slow` (a call of {threshold} s or more on a 2-core\n"
            "# CPU; written by dev/slow_tests.py from a durations run, read by tests/conftest.py)\n")
    Path(__file__).resolve().parents[1].joinpath("tests", "slow-tests.txt").write_text(head + "\n".join(ids) + "\n")
    print(f"{len(ids)} tests listed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
