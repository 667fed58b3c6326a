"""Runs made by other evaluation tools, read in; flipguard's runs, written out for them.

- `flipguard import inspect LOG...` / `flipguard import lm-eval DIR...` (importer.py): inspect_ai eval
  logs (read by inspect_ai's own `read_eval_log`: inspect_log.py) and lm-evaluation-harness
  `--log_samples` output (lm_eval_log.py) become one flipguard run folder, each run a system of it,
  its samples records (runs.py), the items checked to be the same across its runs;
- the registered tasks `inspect` and `lm-eval` (protocol.py) give those runs' numbers and per-sample
  units to `flipguard compare` and `flipguard view`, as a protocol's runs give theirs;
- `flipguard export --format inspect RUN` (export.py): a DDS, AFR or stick-or-switch run as an
  inspect_ai eval log, built from inspect_ai's log types and written by its writer.

inspect_ai and lm-evaluation-harness are optional (`pip install 'flipguard[interop]'`), imported
only inside the functions that need them.
"""
