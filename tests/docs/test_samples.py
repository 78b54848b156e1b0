"""The guide's sample outputs are the program's: every block of output in docs/ is run and
matched (tests/docs/sampling.py says how), or dated with the machine it came from."""
import pytest
import torch
from sampling import blocks, mismatches, pages, run

BLOCKS = [b for p in pages() for b in blocks(p)]
SAMPLES = [b for b in BLOCKS if b.marker == "sample"]
_RUNS: dict = {}


def test_every_block_of_output_is_a_checked_sample_or_dated():
    unmarked = [b.where for b in BLOCKS if b.marker is None]
    assert not unmarked, f"blocks without <!-- sample -->, <!-- dated ... --> or <!-- not output -->: {unmarked}"
    assert len(SAMPLES) >= 15
    assert all(b.commands for b in SAMPLES), [b.where for b in SAMPLES if not b.commands]
    above = [b.where for b in BLOCKS if b.marker == "sample of the command above"]  # their pages' tests run them
    assert above and all(w.split(":")[0] in ("docs/tutorial.md", "docs/api.md") for w in above), above


@pytest.mark.skipif(torch.cuda.is_available(), reason="the guide's samples are of a machine without a GPU")
@pytest.mark.parametrize("block", SAMPLES, ids=[b.where for b in SAMPLES])
def test_a_sample_is_what_its_command_prints(block, tmp_path):
    for cmd in block.commands:
        # a page's single command that another page shows too (the README's and the guide's) runs once
        key = (block.folder, tuple(cmd.argv)) if len(block.commands) == 1 else None
        res = _RUNS.get(key) or run(block, cmd, tmp_path)
        if key is not None:
            _RUNS[key] = res
        assert res.exit_code == cmd.code, (cmd.argv, res.output)
        missing = mismatches(cmd.shown, res.output)
        assert not missing, f"{block.where}: not printed by {' '.join(cmd.argv)}: {missing}\n{res.output}"


def test_the_summary_jq_shows_is_the_one_the_command_above_it_printed():
    """share-results.md: `jq '.summary'` of the JSON report the page's checked sample wrote."""
    import json
    import re

    from sampling import ROOT
    text = (ROOT / "docs" / "how-to" / "share-results.md").read_text()
    shown = json.loads(re.search(r"jq '\.summary' parity\.json +# (\{.*\})", text).group(1))
    printed = re.search(r"PASSED (\d+) passed, (\d+) failed, (\d+) skipped .*report parity\.json", text)
    assert [shown["passed"], shown["failed"], shown["skipped"]] == [int(g) for g in printed.groups()]
    assert shown["ok"] is (shown["failed"] == 0)
