#!/usr/bin/env bash
# A `cluster.sh up` killed at a random moment, as a run is when its job is
# cancelled or times out: `make cluster-test` runs this first, so that its
# own `up` right after (which begins with `down`) shows on every run that
# nothing a killed run leaves trips the next one.
#
#   interrupted-up.sh [SECONDS [group|script]]
#
# SECONDS (default: random, 1 to 30; a full `up` takes about 30) after the
# start, SIGKILL goes either to the whole process group, the machines' unshare
# with it (a runner killing the job), or to the script alone, its machines
# and whatever it was running left behind (an operator's kill -9): random
# unless given. Prints which, and what `up` was doing at that moment.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
AT=${1:-$((RANDOM % 30 + 1))}
HOW=${2:-$( ((RANDOM % 2)) && echo group || echo script)}
LOG=$(mktemp)
trap 'rm -f "$LOG"' EXIT
# timeout(1) makes a process group of its own and kills all of it, or with
# --foreground the script alone.
rc=0
case "$HOW" in
group) timeout -s KILL "$AT" "$HERE/cluster.sh" up >"$LOG" 2>&1 || rc=$? ;;
script) timeout --foreground -s KILL "$AT" "$HERE/cluster.sh" up >"$LOG" 2>&1 || rc=$? ;;
*) sed -n '2,13p' "$0" >&2; exit 2 ;;
esac
last=$(grep '^cluster:' "$LOG" | tail -1)
if [ "$rc" = 137 ]; then
	echo "interrupted-up: SIGKILL to the $HOW after ${AT} s, during: $last" >&2
else
	echo "interrupted-up: up ended by itself (exit $rc) before ${AT} s: $last" >&2
fi
