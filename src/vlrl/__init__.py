"""vlrl: reinforcement learning from verifiable rewards for vision-language models and LLMs."""

__version__ = "0.1.0"
