"""`exit_worker`: the end of a test's spawned rank that finished its work."""

import os
import sys


def exit_worker() -> None:
    """Exit this spawned rank with status 0 at once, its process group already destroyed. At interpreter
    exit, gloo's threads now and then abort the process ("terminate called without an active
    exception", SIGABRT, no Python frame), which `torch.multiprocessing.start_processes` reports as the
    rank's failure after the work has passed; `os._exit` skips that teardown. Call it only on success
    (after the try/finally), so a failing rank still raises."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
