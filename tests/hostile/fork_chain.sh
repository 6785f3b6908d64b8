#!/bin/sh
# Hostile agent: a descendant that leaves the agent's session, then forks and exits in a
# loop, so the pid a cleanup finds is gone by the time it is killed (a red-team pass kept
# one alive for thousands of generations past the run, and the cleanup busy for 6 s).
# Usage: fork_chain.sh TOKEN SECONDS [GAP]. TOKEN stays in every generation's command
# line, so a test can look for survivors; the chain gives up by itself after SECONDS;
# each generation lives GAP seconds (0.0005 by default) before it forks and exits.
python3 -c '
import os, sys, time
os.setsid()
give_up = time.monotonic() + float(sys.argv[2])
while time.monotonic() < give_up:
    if os.fork():
        os._exit(0)
    time.sleep(float(sys.argv[3]))
' "$1" "$2" "${3:-0.0005}" &
sleep 0.5
printf '{}' > "$RUNTIME_NODE.json"
