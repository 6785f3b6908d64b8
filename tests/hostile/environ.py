"""Hostile agent: reads every /proc/<pid>/environ it can, and the runtime's by pid.

Usage: python environ.py RUNTIME_PID SECRET_NAME. Writes found.txt: one line per
process whose environment holds SECRET_NAME, and "runtime-environ ok|denied".
"""

import os
import sys

runtime_pid, name = sys.argv[1], sys.argv[2].encode() + b"="
found = []
for pid in os.listdir("/proc"):
    if pid.isdigit():
        try:
            with open(f"/proc/{pid}/environ", "rb") as fh:
                if any(v.startswith(name) for v in fh.read().split(b"\0")):
                    found.append(pid)
        except OSError:
            pass
try:
    with open(f"/proc/{runtime_pid}/environ", "rb") as fh:
        runtime = b"ok " + fh.read()
except OSError:
    runtime = b"denied"
with open("found.txt", "wb") as out:
    out.write(b"".join(f"{pid}\n".encode() for pid in found))
    out.write(b"runtime-environ " + runtime + b"\n")
with open(os.environ["RUNTIME_NODE"] + ".json", "w") as fh:
    fh.write('{"ok": true}')
