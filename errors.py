"""The one error type of the library files: what a user can fix (an option, a file, a device, a checkpoint), said in
one line that names it. Each script's main is wrapped in script(): the error ends it as `error: <message>` with exit
status 1, never a traceback."""
import functools

class UserError(Exception):
    one_line = True     # a thread that raises it is reported by its message alone (pipeline.Threads.fail)

def script(main):
    """main(argv) whose UserError leaves as SystemExit('error: ...'): Python prints that line and exits with 1."""
    @functools.wraps(main)
    def run(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except UserError as e:
            raise SystemExit(f"error: {e}") from None
    return run
