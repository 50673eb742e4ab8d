"""Rollout engines: the `RolloutEngine` interface and the built-in Hugging Face sampler."""

from gspo.rollout.base import RolloutBatch, RolloutEngine, SamplingParams
from gspo.rollout.sampler import HFSampler, filter_scores, row_seed, sample_from_logits

__all__ = [
    "HFSampler",
    "RolloutBatch",
    "RolloutEngine",
    "SamplingParams",
    "filter_scores",
    "row_seed",
    "sample_from_logits",
]
