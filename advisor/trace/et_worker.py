"""`python -m advisor.trace.et_worker ET_PATH`: parse an execution trace in a second process.

load.py runs this for big traces so that the two files are parsed on two cores at once (regex and
Python work hold the GIL, so threads would not do). The result (node frame + argument templates) goes
back pickled on stdout; a user-facing error goes back as ("error", message).
"""
from __future__ import annotations

import pickle
import sys
from pathlib import Path

from advisor.errors import AdvisorError
from advisor.trace.load import _et, gc_paused


def main() -> None:
    try:
        with gc_paused():
            result = _et(Path(sys.argv[1]))
    except AdvisorError as e:
        result = ("error", str(e))
    pickle.dump(result, sys.stdout.buffer, protocol=pickle.HIGHEST_PROTOCOL)
    sys.stdout.buffer.flush()


if __name__ == "__main__":
    main()
