"""Stick-or-switch (Guo et al.): conviction and flexibility over multi-turn chats.

`flipguard sos` (= `flipguard run sos`) runs the registered task `protocol.SosTask`;
`sos_summary(run_dir)` feeds the before/after comparison.
"""

from flipguard.eval.sos.report import sos_summary, write_report

__all__ = ["sos_summary", "write_report"]
