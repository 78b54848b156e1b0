"""A training run's configuration (the device's default model, what was given, checked) and its
seeded synthetic data: a Markov source a small model learns."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from mhctool.core.errors import UsageError
from mhctool.references.model import ModelConfig

# the mHC families the model calls, in the order a layer calls them
FAMILIES = ("mapping", "sinkhorn", "h_aggregate", "h_post_bda")
# what it calls under a whole-module variant (``--impl X[module]``): the pre-path in one call (the
# mapping, Sinkhorn and the aggregation: mhctool's fused pre-path), then the post-path
MODULE_FAMILIES = ("mix_aggregate", "h_post_bda")


def families_of(keys) -> tuple[str, ...]:
    """The families a run's model calls, from what its specs (or pieces) are keyed by."""
    return MODULE_FAMILIES if "mix_aggregate" in keys else FAMILIES


# what a trajectory's verdict is judged on (iteration time and memory are recorded, not judged)
JUDGED = ("lm loss", "grad-norm", "num-zeros")


GOLDEN_METRICS = ("lm loss", "num-zeros", "grad-norm", "iteration-time", "mem-allocated-bytes",
                  "mem-max-allocated-bytes")


@dataclass(frozen=True)
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    steps: int = 30
    batch: int = 2
    lr: float = 1e-2
    weight_decay: float = 0.01
    clip: float = 1.0  # gradient clipping at this total norm, as Megatron's --clip-grad
    dtype: str = "fp32"  # the activations' dtype (the mapping path is fp32 whatever it is)
    device: str = "cpu"
    seed: int = 0
    branch: int = 3  # the synthetic source: successors a token may have


# the default model: small enough for Triton's CPU interpreter (about a second a step), and a
# larger one on a GPU
CPU_DEFAULTS = dict(layers=4, streams=4, hidden=32, heads=2, ffn=128, seq=16, vocab=64, batch=2, steps=20)


GPU_DEFAULTS = dict(layers=4, streams=4, hidden=256, heads=4, ffn=1024, seq=256, vocab=512, batch=8, steps=100)
# the seeds a verdict is judged over (``--seeds``), by device. On the CPU, four keep ``mhctool train
# --impl triton`` at about a minute on two cores (Triton's interpreter takes most of it: 20 steps,
# about 25 s a seed); their verdicts held in 10 of 10 ensembles for the correct kernels and the
# defects (docs/commands/train.md). On the GPU default, bf16, lr 0.05, four seeds called a correct
# kernel DRIFT in 1 of 40 ensembles (lm loss, 3 seeds of 4 past native's by chance); eight, in none
# of 20 (the largest geometric mean 0.89), at about twice an ensemble's time.
DEFAULT_SEEDS = {"cpu": 4, "cuda": 8}


def default_seeds(device: str) -> int:
    return DEFAULT_SEEDS["cuda" if str(device).startswith("cuda") else "cpu"]


def config(device: str, **given) -> TrainConfig:
    """The run's configuration: the device's defaults, then what was given (None: the default);
    a shape the model cannot take is a UsageError."""
    d = {**(GPU_DEFAULTS if device == "cuda" else CPU_DEFAULTS),
         **{k: v for k, v in given.items() if v is not None}}
    model_keys = {f for f in ModelConfig.__dataclass_fields__}
    m = ModelConfig(**{k: v for k, v in d.items() if k in model_keys})
    cfg = TrainConfig(model=m, device=device, **{k: v for k, v in d.items() if k not in model_keys})
    check(cfg)
    return cfg


def check(cfg: TrainConfig) -> None:
    m = cfg.model
    for name, v, least in (("steps", cfg.steps, 1), ("layers", m.layers, 1), ("streams", m.streams, 2),
                           ("hidden", m.hidden, 2), ("heads", m.heads, 1), ("seq", m.seq, 2),
                           ("batch", cfg.batch, 1), ("vocab", m.vocab, 2), ("ffn", m.ffn, 1)):
        if not (isinstance(v, int) and v >= least):
            raise UsageError(f"--{name} {v!r} must be at least {least}")
    if m.hidden % m.heads:
        raise UsageError(f"--hidden {m.hidden} must be a multiple of the attention heads ({m.heads})")
    if not (cfg.lr > 0 and math.isfinite(cfg.lr)):
        raise UsageError(f"--lr {cfg.lr!r} must be a positive number")
    if cfg.branch < 1 or cfg.branch > m.vocab:
        raise UsageError(f"the source's branching {cfg.branch} must be between 1 and the vocabulary ({m.vocab})")
    if cfg.dtype not in ("fp32", "bf16", "fp16"):
        raise UsageError(f"unknown dtype {cfg.dtype!r}; accepted: fp32, bf16, fp16")


class MarkovSource:
    """Token sequences from a fixed random Markov chain: every token has ``branch`` successors with
    random probabilities, so the next token is predictable from the current one; a model that
    learns the chain approaches :meth:`entropy` nats a token (from ``log(vocab)`` untrained)."""

    def __init__(self, vocab: int, branch: int, seed: int):
        g = torch.Generator().manual_seed(seed * 7919 + 17)
        succ = torch.stack([torch.randperm(vocab, generator=g)[:branch] for _ in range(vocab)])
        w = -torch.log(torch.rand(vocab, branch, generator=g, dtype=torch.float64))  # Dirichlet(1)
        self.probs = torch.zeros(vocab, vocab, dtype=torch.float64).scatter_(1, succ, w / w.sum(1, keepdim=True))
        self.seed, self.vocab = seed, vocab

    def entropy(self) -> float:
        """The chain's entropy rate under a uniform start (nats a token): the loss floor."""
        p = self.probs
        return float(-(p * torch.log(p.clamp_min(1e-300))).sum(1).mean())

    def batch(self, step: int, batch: int, seq: int) -> torch.Tensor:
        """``tokens[seq + 1, batch]`` of step ``step``: the same in every run with this seed.
        Drawn on one CPU thread: ``seq`` tiny draws in a row, which PyTorch's thread pool made
        2.5 s a step on a 64-core host (its threads spinning between them), about 50 ms on one;
        the draws are the same whatever the thread count."""
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
            tok = [torch.randint(0, self.vocab, (batch,), generator=g)]
            for _ in range(seq):
                tok.append(torch.multinomial(self.probs[tok[-1]].float(), 1, generator=g).squeeze(1))
            return torch.stack(tok)
        finally:
            torch.set_num_threads(threads)


def to_dict(cfg: TrainConfig) -> dict:
    return asdict(cfg)


def from_dict(d: dict) -> TrainConfig:
    return TrainConfig(**{**d, "model": ModelConfig(**d["model"])})
