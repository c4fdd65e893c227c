#!/usr/bin/env bash
# Start NetDAM nodes under OpenMPI's mpirun, then all-reduce over them through the cluster file.
#
# mpirun sets OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK but no master address, so rank 0's rendezvous
# address is given with --master HOST:PORT (or exported as NETDAM_MASTER_ADDR/NETDAM_MASTER_PORT
# with `mpirun -x`). Every node binds its UDP socket (--bind auto:0: the local address of the
# route to the master, any free port) and reports to rank 0, which writes the cluster file once
# every rank has reported. `netdam allreduce --cluster FILE` then plays every rank's host (it maps
# each node's memory file, so it runs on the nodes' host) and checks the result against numpy;
# `netdam down` stops the nodes, and mpirun returns.
#
# Several hosts: mpirun -np 4 --host h0:2,h1:2 netdam node --master h0:29544 --cluster /shared/c.toml
# As root mpirun needs --allow-run-as-root (added below when run as root); --oversubscribe lets
# more ranks than cores run on one machine.
#
# Environment: NODES (default 3), NETDAM (the command, default `netdam`), NODE_ARGS (more
# `netdam node` options), RDV_PORT (29544).
set -euo pipefail
# shellcheck source=launch_common.sh
source "$(dirname "$0")/launch_common.sh"

NODES=${NODES:-3}
NETDAM=${NETDAM:-netdam}
PORT=${RDV_PORT:-29544}
WORK=$(mktemp -d)
CLUSTER=$WORK/cluster.toml

ROOT_FLAGS=()
[ "$(id -u)" = 0 ] && ROOT_FLAGS=(--allow-run-as-root)
mpirun "${ROOT_FLAGS[@]}" --oversubscribe -np "$NODES" \
    $NETDAM node --master "127.0.0.1:$PORT" --bind auto:0 --memory 16MiB ${NODE_ARGS:-} --cluster "$CLUSTER" &
LAUNCHER=$!

allreduce_once_formed mpirun
