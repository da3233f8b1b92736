"""The one error type of the library files: what a user can fix (an option, a file, a device, a checkpoint), said in
one line that names it. Each script's main is wrapped in script(): the error ends it as `error: <message>` with exit
status 1, never a traceback."""
import functools

class UserError(Exception):
    one_line = True     # a thread that raises it is reported by its message alone (pipeline.Threads.fail)

def first_line(e):
    """An exception said in one line: its type and its message's first line (a chained traceback says no more)."""
    first = (str(e).splitlines() or [""])[0]
    return f"{type(e).__name__}: {first}" if first else type(e).__name__

def script(main):
    """main(argv) whose UserError leaves as SystemExit('error: ...'): Python prints that line and exits with 1."""
    @functools.wraps(main)
    def run(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except UserError as e:
            raise SystemExit(f"error: {e}") from None
    return run
