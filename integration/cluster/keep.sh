#!/usr/bin/env bash
# keep.sh LOG CMD...: runs CMD again whenever it exits, as the kubelet does
# for a static pod (the controller-manager, for one, exits when it starts
# before the API server's RBAC roles exist), appending its output to LOG.
log=$1
shift
exec >>"$log" 2>&1 </dev/null
while :; do
	"$@"
	echo "keep.sh: $1 exited $?; restarting in 1 s"
	sleep 1
done
