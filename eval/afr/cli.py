"""`flipguard afr CONFIG.yaml [--out DIR] [--limit N]` (= `flipguard run afr ...`): run the
answer-flip protocol for a list of models and write records, run.json, report.md, tables
(csv) and figures (PNG). The options are AFRArgs (eval/afr/protocol.py)."""

from flipguard.eval.afr.protocol import AFRArgs, main, settings_from_args  # noqa: F401
