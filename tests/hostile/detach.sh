#!/bin/sh
# Hostile agent: leaves a double-forked, setsid child behind that would outlive the
# attempt. Usage: detach.sh TOKEN [hang]. The orphan carries TOKEN in its environment
# and command line, so the test can look for it from outside any sandbox.
export HOSTILE_TOKEN="$1"
( setsid sh -c "while :; do sleep 1; done; : $1" </dev/null >/dev/null 2>&1 & ) &
wait
echo spawned > spawned.txt
printf '{"ok": true}' > "$RUNTIME_NODE.json"
if [ "$2" = hang ] && [ "$RUNTIME_ATTEMPT" = 1 ]; then
  exec sleep 300
fi
