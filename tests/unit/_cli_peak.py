"""Run the lmlaunch CLI and write this process's peak resident memory (VmHWM, kB) to the file
named by LMLAUNCH_TEST_PEAK_FILE.

The child's ru_maxrss from wait4 would not do: Linux carries the parent's peak across fork and
exec into it, so a child of a pytest process that imported torch "peaks" at pytest's size.
VmHWM belongs to the memory map, which exec replaces.
"""

import os
import sys

from launcher.cli import main


def _peak_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return -1


if __name__ == "__main__":
    code = main()
    with open(os.environ["LMLAUNCH_TEST_PEAK_FILE"], "w") as out:
        out.write(str(_peak_kb()))
    sys.exit(code)
