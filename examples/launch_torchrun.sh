#!/usr/bin/env bash
# Start NetDAM nodes under torchrun, then all-reduce over them through the cluster file.
#
# torchrun starts one `netdam node` per rank with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
# MASTER_PORT set. Every node binds its UDP socket (--bind auto:0: the local address of the route
# to MASTER_ADDR, any free port), reports to rank 0's rendezvous at MASTER_ADDR:MASTER_PORT+1
# (torchrun's own store holds MASTER_PORT), and rank 0 writes the cluster file once every rank
# has reported. `netdam allreduce --cluster FILE` then plays every rank's host (it maps each
# node's memory file, so it runs on the nodes' host) and checks the result against numpy;
# `netdam down` stops the nodes, and torchrun returns.
#
# Several hosts: run on each host (HOST0 = rank 0's host, the same --nnodes/--master-* everywhere)
#   torchrun --nnodes 2 --node-rank K --nproc-per-node 2 --master-addr HOST0 --master-port 29500 \
#            --no-python netdam node --cluster /shared/cluster.toml
# and join from one host process per rank with netdam.init("/shared/cluster.toml", rank=R).
#
# Environment: NODES (default 3), NETDAM (the command, default `netdam`), NODE_ARGS (more
# `netdam node` options), MASTER_PORT (29500).
set -euo pipefail
# shellcheck source=launch_common.sh
source "$(dirname "$0")/launch_common.sh"

NODES=${NODES:-3}
NETDAM=${NETDAM:-netdam}
PORT=${MASTER_PORT:-29500}
WORK=$(mktemp -d)
CLUSTER=$WORK/cluster.toml

# --no-python: torchrun runs the command as given instead of `python SCRIPT`.
torchrun --nproc-per-node "$NODES" --master-addr 127.0.0.1 --master-port "$PORT" --no-python \
    $NETDAM node --bind auto:0 --memory 16MiB ${NODE_ARGS:-} --cluster "$CLUSTER" &
LAUNCHER=$!

allreduce_once_formed torchrun
