"""The check every one-line-error test makes: exit 2, one line on stderr, no traceback."""

from __future__ import annotations


def one_line(capsys, code: int, *needles: str) -> str:
    """Exit 2, one line on stderr holding every needle, no traceback."""
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err
    return err
