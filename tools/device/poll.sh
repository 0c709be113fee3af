#!/usr/bin/env bash
# Poll the background job of tools/device/steps.sh from a later device call, safely:
#   bash tools/device/poll.sh SECONDS
# Exits 3 at once when no job is on this machine (/tmp/lab/out missing: the call landed on a fresh machine, because
# the one that ran the job was given back), so a lost job costs seconds of device time, not a whole sleep.
# Otherwise waits until the job's DONE marker or SECONDS, whichever comes first, then packs everything the job has
# written so far into $OUT/out.tgz (so each poll brings back a complete copy: copy it into the repository at once)
# and prints the timeline. Exit 0: the job is done; 2: still running (poll again at once: a machine idle for
# 30 s is given back).
set -u
LIMIT=${1:-560}
O=/tmp/lab/out
if [ ! -d "$O" ]; then
  echo "poll: no job on this machine ($O missing): a fresh machine; the job's machine was given back" >&2
  exit 3
fi
T0=$(date +%s)
while [ ! -f "$O/DONE" ] && [ $(( $(date +%s) - T0 )) -lt "$LIMIT" ]; do sleep 5; done
tar czf "$OUT/out.tgz" -C "$O" . 2>/dev/null
grep -E "^===|exit" "$O/session.log" | tail -n 12
[ -f "$O/DONE" ] && exit 0
exit 2
