"""The evaluation core every protocol shares (tasks, records, runner, backends, statistics)
and, in subpackages, the protocols themselves (dds, afr, sos), runs other tools made (interop)
and the embedded models (embedded)."""
