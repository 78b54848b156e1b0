"""The guide's sample outputs and the program's output they must match (tests/docs/test_samples.py).

Every fenced block of the README and the guide (docs/, the developer pages aside) that shows more
than command lines carries a marker on the line above it:

- ``<!-- sample -->`` (or ``<!-- sample in tests/impls -->``): each ``$ mhctool ...`` line of the
  block is run (from the repository's root, or from the folder named), with the exit code its
  comment gives (``# exit 1``; 0 otherwise), and each line shown under it must be a line of what
  the command prints, in the same order (lines it prints and the sample leaves out are fine). A
  ``…`` stands for any text, a line of ``…`` alone for lines left out. The words must be the
  program's and every figure within 2% of it (a last printed digit may move between CPUs; a count
  below 50 must be exact); figures that are the machine's (times) or a chaotic run's are written
  as ``…``.
- ``<!-- dated YYYY-MM-DD MACHINE: why -->``: a figure of another machine (a GPU's, a library's not
  installed here): dated and its machine named; it is not run.
- ``<!-- sample of the command above -->``: the output of the command the page ran last (the
  tutorial's, whose test runs its commands in order and checks the block as above).
- ``<!-- not output -->``: a synopsis, a file, a folder tree.

``python tests/docs/sampling.py PAGE`` prints, for each sample of a page, the lines that do not
match and what the command printed, to mend a page after a change.
"""
from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"^<!-- (sample(?: in (\S+))?|sample of the command above|dated (\d{4}-\d{2}-\d{2}) (.+?)|not output) -->$")


@dataclass
class Command:
    argv: list[str]
    code: int
    shown: list[str] = field(default_factory=list)


@dataclass
class Block:
    page: str
    line: int  # the fence's line, 1-based
    marker: str | None  # "sample", "sample of the command above", "dated", "not output" or None
    folder: str | None
    text: list[str]
    commands: list[Command] = field(default_factory=list)

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def pages() -> list[Path]:
    """The README and the user guide (docs/, the developer pages aside)."""
    return [ROOT / "README.md", *(p for p in sorted((ROOT / "docs").rglob("*.md"))
                                  if "dev" not in p.relative_to(ROOT / "docs").parts)]


def _shows_output(lang: str, body: list[str]) -> bool:
    """A block of output or of anything but command lines (a block in a language: a file)."""
    if lang not in ("", "text", "console"):
        return False
    return any(ln.strip() and not ln.startswith("$ ") for ln in body)


def blocks(page: Path) -> list[Block]:
    """The page's fenced blocks that show more than command lines, with their markers."""
    lines, out, i = page.read_text().splitlines(), [], 0
    while i < len(lines):
        if not lines[i].startswith("```"):
            i += 1
            continue
        lang, j = lines[i][3:].strip(), i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        body = lines[i + 1:j]
        if _shows_output(lang, body):
            m = MARKER.match(lines[i - 1].strip()) if i else None
            kind = None if m is None else next(k for k in ("sample of the command above", "sample", "dated", "not output")
                                               if m.group(1).startswith(k))
            b = Block(page.relative_to(ROOT).as_posix(), i + 1, kind, m.group(2) if m else None, body)
            if kind == "sample":
                b.commands = _commands(body)
            out.append(b)
        i = j + 1
    return out


def _commands(body: list[str]) -> list[Command]:
    cmds: list[Command] = []
    for ln in body:
        if ln.startswith("$ "):
            words, _, comment = ln[2:].partition(" #")
            argv = shlex.split(words)
            code = int(m.group(1)) if (m := re.search(r"exit (\d+)", comment)) else 0
            cmds.append(Command(argv, code))
        elif cmds:
            cmds[-1].shown.append(ln)
    return cmds


NUMBER = r"(?<![\w.])-?\d+(?:\.\d+)?(?:e[+-]?\d+)?"
TOLERANCE = 0.02  # a figure's last printed digit may move between CPUs (AVX2 and AVX-512 sum apart)


def norm(line: str) -> str:
    line = re.sub(r"([━─═]){2,}", r"\1", line)  # a table's rules, whatever its column widths
    return " ".join(line.split())


def _pattern(shown: str) -> tuple[re.Pattern, list[float]]:
    """The shown line as a pattern (each figure a group, each ``…`` any text) and its figures."""
    parts, figures = [], []
    for k, chunk in enumerate(norm(shown).split("…")):
        pieces, at = [], 0
        for m in re.finditer(NUMBER, chunk):
            pieces += [re.escape(chunk[at:m.start()]), f"({NUMBER})"]
            figures.append(float(m.group()))
            at = m.end()
        pieces.append(re.escape(chunk[at:]))
        parts.append("".join(pieces))
    return re.compile("^" + ".*?".join(parts) + "$"), figures


def _close(a: float, b: float) -> bool:
    return a == b or abs(a - b) <= TOLERANCE * max(abs(a), abs(b))


def mismatches(shown: list[str], printed: str) -> list[str]:
    """The shown lines (in order) that are no line of what was printed after the one before: the
    words the same, every figure within 2% (counts below 50 exactly)."""
    actual = [norm(a) for a in printed.splitlines()]
    missing, k = [], 0
    for s in shown:
        if not s.strip() or s.strip() == "…":
            continue
        pat, figures = _pattern(s)

        def fits(line: str) -> bool:
            m = pat.match(line)
            return bool(m) and all(_close(float(g), f) for g, f in zip(m.groups(), figures))
        at = next((j for j in range(k, len(actual)) if fits(actual[j])), None)
        if at is None:
            missing.append(s)
        else:
            k = at + 1
    return missing


def run(block: Block, cmd: Command, into: Path):
    """The command run as the page shows it, in-process (stdout and stderr together), in the folder
    ``into``: the files of the repository's root (or of the folder the marker names) are linked
    there, so that what the command writes (its report) lands beside them, never in the tree."""
    import os

    from typer.testing import CliRunner

    from mhctool.cli.app import app
    if not cmd.argv or cmd.argv[0] != "mhctool":
        raise AssertionError(f"{block.where}: a sample runs mhctool commands only: {' '.join(cmd.argv)}")
    source = ROOT / (block.folder or ".")
    for entry in source.iterdir():
        if not (into / entry.name).exists() and not entry.name.startswith("."):
            (into / entry.name).symlink_to(entry)
    here = os.getcwd()
    os.chdir(into)
    try:
        return CliRunner().invoke(app, cmd.argv[1:], env={"MHCTOOL_PROGRESS_SECONDS": "3600"})
    finally:
        os.chdir(here)


if __name__ == "__main__":  # pragma: no cover - a tool for mending pages
    import tempfile
    for page in sys.argv[1:]:
        for b in blocks(Path(page).resolve()):
            into = Path(tempfile.mkdtemp(prefix="mhctool-sample-"))
            for c in b.commands:
                res = run(b, c, into)
                miss = mismatches(c.shown, res.output)
                print(f"== {b.where} $ {' '.join(c.argv)}: exit {res.exit_code} (page: {c.code}); "
                      f"{len(miss)} line(s) not printed")
                for m in miss:
                    print(f"  missing: {m}")
                if miss or res.exit_code != c.code:
                    print(res.output)
