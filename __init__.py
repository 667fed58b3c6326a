"""flipguard: measure and train away sycophantic deference in LLMs."""

__version__ = "0.1.0"
