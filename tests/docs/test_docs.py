"""The user guide cannot drift from the CLI: every ``mhctool ...`` command line that the README and
the guide (docs/) show, in code blocks and inline, names commands and options that exist."""
import re
import shlex
from pathlib import Path

import pytest
import typer

from mhctool.cli.app import app

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
START = re.compile(r"^(?:\$ )?(?:[A-Z_]+=\S* )*(?:mhctool|python3? -m mhctool\.cli) ")


def _commands(text: str) -> list[str]:
    """Command lines: in fenced blocks, lines that start with mhctool (a prompt and environment
    assignments before it allowed); in prose, inline code spans that do."""
    found, fence = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fence = not fence
            continue
        if fence:
            s = line.strip()
            if START.match(s):
                found.append(s)
        else:
            found += [m for m in re.findall(r"`([^`]+)`", line) if START.match(m)]
    return found


def _tokens(line: str) -> list[str]:
    line = re.split(r"\s(?:&&|\||#)\s?|;", line)[0]  # the mhctool command alone
    try:
        words = shlex.split(line)
    except ValueError:
        words = line.split()
    words = [w.strip("[]") for w in words]
    while words and (re.match(r"^[A-Z_]+=", words[0]) or words[0] == "$"):
        words.pop(0)
    if words[:3] in (["python3", "-m", "mhctool.cli"], ["python", "-m", "mhctool.cli"]):
        words = ["mhctool", *words[3:]]
    return words[1:]


def _check(line: str) -> str | None:
    """Why the line names something the CLI lacks, or None."""
    cmd = typer.main.get_command(app)  # a click-like command (Typer may carry its own click)
    words = _tokens(line)
    while words and words[0] == "--debug":
        words.pop(0)
    while hasattr(cmd, "commands") and words and not words[0].startswith("-"):
        if words[0] in ("...", "COMMAND"):
            return None
        sub = cmd.commands.get(words[0])
        if sub is None:
            return f"no command {words[0]!r}"
        cmd, words = sub, words[1:]
    options = {"--help"} | {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)}
    for w in words:
        if w.startswith("-") and w not in ("-", "--"):
            name = w.split("=", 1)[0]
            if name not in options and not name.startswith("---"):
                return f"{cmd.name} has no option {name}"
    return None


LINES = sorted({(page.relative_to(ROOT).as_posix(), line) for page in PAGES for line in _commands(page.read_text())})


def test_the_guide_shows_many_command_lines():
    assert len(LINES) > 60
    assert {p for p, _ in LINES} >= {"README.md", "docs/commands/parity.md", "docs/commands/identify.md",
                                     "docs/commands/bench.md", "docs/libraries/writing-an-adapter.md"}


@pytest.mark.parametrize("page,line", LINES, ids=[f"{p}:{i}" for i, (p, _) in enumerate(LINES)])
def test_every_command_line_in_the_guide_parses(page, line):
    assert _check(line) is None, f"{page}: {line}: {_check(line)}"


def test_the_checker_catches_a_renamed_option():
    assert _check("mhctool parity --kernel sinkhorn --kernal x") == "parity has no option --kernal"
    assert _check("mhctool parityy --kernel sinkhorn") == "no command 'parityy'"
    assert _check("mhctool goldens diff A.json B.json --metrics 'lm loss'") is None
