import logging
import os
import sys

from trainer.cli import main

rc = main()
if int(os.environ.get("WORLD_SIZE", "1")) > 1:
    # A rank of a multi-process run ends here without the interpreter's finalization: its outputs are
    # written (atomically) and its process groups destroyed, but Gloo can still hold worker threads whose
    # destruction during finalization aborts the process ("terminate called without an active exception",
    # seen in 4-rank CPU runs, pytorch/pytorch#190489 and the atexit discussion in #179291), which turned
    # a finished run into a failed one.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
from trainer.launch import exit_with  # noqa: E402  (an interrupted run's status stays 130: see exit_with)

exit_with(rc)
