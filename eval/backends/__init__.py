"""Backends: what turns conversations into replies or answer-token probabilities (hf, vllm,
openai; base.py says how to write one)."""
