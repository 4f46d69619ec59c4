"""``gemport`` on the command line, run in this process through ``gemport.cli.main`` (what ``python -m gemport``
calls), so a command does not pay for importing JAX, torch and transformers again."""

import contextlib
import io
import subprocess

from gemport.cli import main


def gemport(*args, ok=True):
    """``gemport ARGS`` as a ``CompletedProcess``: exit status, stdout and stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in args])
        except SystemExit as e:  # argparse: --help and usage errors
            code = e.code
    result = subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())
    if ok:
        assert result.returncode == 0, result.stderr
    return result


def one_line_error(result, *fragments):
    assert fragments, "name what the message must say"
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.startswith("gemport")]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
