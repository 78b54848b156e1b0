"""Scenario TOML -> validated cases.

A scenario file::

    name = "my-scenario"            # required
    description = "..."              # optional

    [verdict]                        # optional
    kappa = 2.0                      # error may be kappa x the native error ...
    floor_roundoffs = 2.0            # ... plus this many unit roundoffs of the output dtype

    [[cases]]                        # one or more
    kernel = "sinkhorn"              # sinkhorn, h_aggregate, h_post_bda, proj_rms
    shapes = ["33x2x4x1"]            # SxBxNxC strings
    dtypes = ["fp32"]                # fp32, bf16, fp16 (default ["fp32"])
    families = ["random"]            # input families (default: all of the kernel's)
    seeds = [0]                      # default [0]
    [cases.knobs]                    # each knob: a value or a list of values (their product runs)
    iters = [20]
    eps = 1e-6

Unknown keys, kernels, families, knobs or values are rejected naming the file and the key.
"""
from __future__ import annotations

import itertools
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from mhctool.core.dtypes import parse_dtype
from mhctool.core.errors import UsageError
from mhctool.core.shapes import Shape, parse_shape_for
from mhctool.core.verdict import VerdictRule
from mhctool.families import get_family, input_families, input_family
from mhctool.runner.case import Case

TOP_KEYS = {"name", "description", "verdict", "cases"}
CASE_KEYS = {"kernel", "shapes", "dtypes", "families", "seeds", "knobs"}
VERDICT_KEYS = {"kappa", "floor_roundoffs"}


@dataclass
class CaseSpec:
    kernel: str
    shapes: list[Shape]
    dtypes: list[str]
    families: list[str]
    seeds: list[int]
    knobs: dict[str, list]


@dataclass
class Scenario:
    name: str
    description: str = ""
    specs: list[CaseSpec] = field(default_factory=list)
    rule: VerdictRule = field(default_factory=VerdictRule)
    source: str = "<built-in>"

    def cases(self, device: str, kernels: list[str] | None = None, dtypes: list[str] | None = None,
              shapes: list[str] | None = None, seeds: list[int] | None = None,
              families: list[str] | None = None) -> list[Case]:
        """Expand to cases; command-line overrides replace the file's lists (shape strings are
        read in the form of each kernel's kind); ``families`` keeps those input families only."""
        out = []
        for k in kernels or []:
            for f in families or []:
                if f not in input_families(k):
                    raise UsageError(f"unknown input family {f!r} for kernel {k}; accepted: "
                                     + ", ".join(input_families(k)))
        for spec in self.specs:
            if kernels and spec.kernel not in kernels:
                continue
            kind = get_family(spec.kernel).shape_kind
            override = [parse_shape_for(kind, t) for t in shapes] if shapes else None
            names = list(spec.knobs)
            for values in itertools.product(*(spec.knobs[k] for k in names)):
                knobs = tuple(sorted(zip(names, values)))
                for shape, dtype, fam, seed in itertools.product(
                        override or spec.shapes, dtypes or spec.dtypes,
                        [f for f in spec.families if not families or f in families], seeds or spec.seeds):
                    out.append(Case(spec.kernel, fam, dtype, shape, knobs, seed, device, self.name))
        return out


def _err(src: str, key: str, msg: str) -> UsageError:
    return UsageError(f"{src}: {key}: {msg}")


def _as_list(v):
    return v if isinstance(v, list) else [v]


def parse(data: dict, src: str) -> Scenario:
    unknown = set(data) - TOP_KEYS
    if unknown:
        raise _err(src, sorted(unknown)[0], f"unknown key; accepted: {', '.join(sorted(TOP_KEYS))}")
    if not isinstance(data.get("name"), str):
        raise _err(src, "name", "required, a string")
    rule = VerdictRule()
    verdict = data.get("verdict", {})
    if not isinstance(verdict, dict):
        raise _err(src, "verdict", "must be a table")
    for k, v in verdict.items():
        if k not in VERDICT_KEYS:
            raise _err(src, f"verdict.{k}", f"unknown key; accepted: {', '.join(sorted(VERDICT_KEYS))}")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
            raise _err(src, f"verdict.{k}", f"must be a non-negative number, got {v!r}")
    if verdict:
        rule = VerdictRule(kappa=float(verdict.get("kappa", rule.kappa)),
                           floor_roundoffs=float(verdict.get("floor_roundoffs", rule.floor_roundoffs)))
    cases = data.get("cases")
    if not isinstance(cases, list) or not cases:
        raise _err(src, "cases", "required: at least one [[cases]] table")
    specs = [_parse_case(c, f"cases[{i}]", src) for i, c in enumerate(cases)]
    return Scenario(data["name"], str(data.get("description", "")), specs, rule, src)


def _parse_case(c: dict, where: str, src: str) -> CaseSpec:
    if not isinstance(c, dict):
        raise _err(src, where, "must be a table")
    unknown = set(c) - CASE_KEYS
    if unknown:
        raise _err(src, f"{where}.{sorted(unknown)[0]}",
                   f"unknown key; accepted: {', '.join(sorted(CASE_KEYS))}")
    if "kernel" not in c:
        raise _err(src, f"{where}.kernel", "required")
    try:
        fam = get_family(c["kernel"])
    except UsageError as e:
        raise _err(src, f"{where}.kernel", str(e)) from None
    try:
        default_shape = "37x64x96x5" if fam.shape_kind == "moe" else "33x2x4x67"
        shapes = [parse_shape_for(fam.shape_kind, s) for s in _as_list(c.get("shapes", [default_shape]))]
        dtypes = [parse_dtype(d).name for d in _as_list(c.get("dtypes", ["fp32"]))]
        fams = _as_list(c.get("families", list(input_families(fam.name))))
        for f in fams:
            input_family(fam.name, f)
        seeds = _as_list(c.get("seeds", [0]))
        if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in seeds):
            raise UsageError(f"seeds must be non-negative integers, got {seeds!r}")
        raw_knobs = c.get("knobs", {})
        if not isinstance(raw_knobs, dict):
            raise UsageError("knobs must be a table")
        knobs = {}
        for k, v in raw_knobs.items():
            if k not in fam.knobs:
                accepted = ", ".join(fam.knobs) or "none"
                raise UsageError(f"unknown knob {k!r} for kernel {fam.name}; accepted: {accepted}")
            knobs[k] = [fam.knobs[k].check(fam.name, k, x) for x in _as_list(v)]
    except UsageError as e:
        raise _err(src, where, str(e)) from None
    return CaseSpec(fam.name, shapes, dtypes, fams, seeds, knobs)


def read_toml(path: str | Path, what: str) -> dict:
    """A TOML file as a dict; a missing or malformed file is a UsageError naming it."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"no {what} file {path}")
    try:
        return tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"{path}: not valid TOML ({e})") from None


def load(path: str | Path) -> Scenario:
    return parse(read_toml(path, "scenario"), str(path))


def builtin(name: str) -> Scenario:
    """A scenario shipped in ``mhctool.scenarios`` (``scenarios/`` in the source tree)."""
    files = resources.files("mhctool.scenarios")
    res = files / f"{name}.toml"
    if not res.is_file():
        avail = sorted(p.name[:-5] for p in files.iterdir() if p.name.endswith(".toml"))
        raise UsageError(f"no built-in scenario {name!r}; built in: {', '.join(avail)}")
    return parse(tomllib.loads(res.read_text()), f"<built-in {name}.toml>")


def resolve(arg: str | None, default: str = "parity-default") -> Scenario:
    """A path to a TOML file, the name of a built-in scenario, or the default."""
    if arg is None:
        return builtin(default)
    if arg.endswith(".toml") or Path(arg).exists():
        return load(arg)
    return builtin(arg)
