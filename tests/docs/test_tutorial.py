"""The tutorial's commands, run in an empty folder as a newcomer would: each file it shows
written, each command run, its exit code the one the page gives (0 unless `# exit N`), and each
output it shows (`<!-- sample of the command above -->`) what the command before it printed."""
import re
import shlex
from pathlib import Path

from sampling import mismatches
from typer.testing import CliRunner

from mhctool.cli.app import app

PAGE = Path(__file__).resolve().parents[2] / "docs" / "tutorial.md"


def steps(text: str) -> list[tuple]:
    """("file", name, content), ("run", argv, exit code) and ("shown", lines, None), in the page's
    order."""
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = re.match(r"<!-- file: (\S+) -->", lines[i])
        if m and lines[i + 1].startswith("```"):
            j = lines.index("```", i + 2)
            out.append(("file", m.group(1), "\n".join(lines[i + 2:j]) + "\n"))
            i = j
        elif lines[i] == "<!-- sample of the command above -->" and lines[i + 1].startswith("```"):
            j = lines.index("```", i + 2)
            out.append(("shown", lines[i + 2:j], None))
            i = j
        elif lines[i].startswith("$ mhctool "):
            cmd, _, comment = lines[i][2:].partition("#")
            code = int(re.search(r"exit (\d+)", comment).group(1)) if "exit" in comment else 0
            out.append(("run", shlex.split(cmd)[1:], code))
        i += 1
    return out


def test_every_command_of_the_tutorial_runs_with_its_exit_code(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    found = steps(PAGE.read_text())
    assert sum(s[0] == "run" for s in found) >= 7 and sum(s[0] == "file" for s in found) == 2
    assert sum(s[0] == "shown" for s in found) >= 1
    res = None
    for kind, what, arg in found:
        if kind == "file":
            (tmp_path / what).write_text(arg)
            continue
        if kind == "shown":
            assert not mismatches(what, res.output), (mismatches(what, res.output), res.output)
            continue
        res = runner.invoke(app, what, env={"MHCTOOL_PROGRESS_SECONDS": "3600"})
        assert res.exit_code == arg, (what, res.output)
    assert (tmp_path / "mhctool-gate.xml").is_file() and (tmp_path / "after.parquet").is_file()
