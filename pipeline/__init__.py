"""The orchestration above train/ and eval/: the command line (cli.py), the study, compare,
view and the demo."""
