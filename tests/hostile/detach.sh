#!/bin/sh
# Hostile agent: leaves a double-forked, setsid child behind that would outlive the
# attempt. Usage: detach.sh TOKEN [hang|hang-clean]. The orphan carries TOKEN in its
# environment and command line, so the test can look for it from outside any sandbox.
# hang-clean: the hanging leader drops its environment (RUNTIME_RUN_ID included), so
# only the run's leaders log can name it after a crash.
export HOSTILE_TOKEN="$1"
( setsid sh -c "while :; do sleep 1; done; : $1" </dev/null >/dev/null 2>&1 & ) &
wait
echo spawned > spawned.txt
printf '{"ok": true}' > "$RUNTIME_NODE.json"
if [ "$2" = hang ] && [ "$RUNTIME_ATTEMPT" = 1 ]; then
  exec sleep 300
fi
if [ "$2" = hang-clean ] && [ "$RUNTIME_ATTEMPT" = 1 ]; then
  exec env -i /bin/sh -c "sleep 300; : $1"
fi
