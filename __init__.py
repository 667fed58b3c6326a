"""flipguard: measure and train away sycophantic deference in LLMs."""

import logging as _logging

__version__ = "0.1.0"

# bitsandbytes' CPU backend warns on import (on AVX512-BF16 CPUs) that it could not fetch an
# optional kernel from the Hugging Face hub; it then uses its built-in CPU path. flipguard runs
# offline, so the line is noise on every run that imports peft/bitsandbytes.
_logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(_logging.ERROR)
