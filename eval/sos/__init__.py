"""Stick-or-switch (Guo et al.): conviction and flexibility over multi-turn chats.

`flipguard sos` (= `flipguard run sos`) runs the registered task `protocol.SosTask`;
`sos_summary(run_dir)` (a `SosReport`: sos_summary.json, and the `numbers` per system) feeds the
before/after comparison.
"""

from flipguard.eval.sos.report import SosReport, sos_summary, write_report

__all__ = ["SosReport", "sos_summary", "write_report"]
