"""Campaign driver processes only (this directory is on their PYTHONPATH): SIGUSR1 dumps every thread's stack.

The driver, Spark's Python daemon and its forked workers all inherit it, so a
supervisor that finds a cycle past its bound can see where each one is.
"""

import faulthandler
import signal
import sys

faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
