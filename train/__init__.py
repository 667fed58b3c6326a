"""Training: the pair builder (pairs.py) and the SFT, DPO and KTO trainers and the merge over
utils.py; each trainer is also a script accelerate launches."""
