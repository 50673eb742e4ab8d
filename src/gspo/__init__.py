"""gspo: Group Sequence Policy Optimization (arXiv 2507.18071) for RL post-training of language models."""

__version__ = "0.1.0"
