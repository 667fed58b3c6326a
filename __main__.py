"""`python -m flipguard ...` = the `flipguard` command; what `accelerate launch -m flipguard eval ...`
runs on every data-parallel rank."""

import sys

from flipguard.pipeline.cli import main

sys.exit(main())
