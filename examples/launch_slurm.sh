#!/usr/bin/env bash
#SBATCH --job-name=netdam
#SBATCH --nodes=1
#SBATCH --ntasks=3
#SBATCH --time=00:05:00
# Start NetDAM nodes under Slurm's srun, then all-reduce over them through the cluster file.
#
# Submit with `sbatch examples/launch_slurm.sh` (or run it inside `salloc -N1 -n3`). srun starts
# one `netdam node` per task with SLURM_PROCID, SLURM_NTASKS and SLURM_LOCALID set. Rank 0's
# rendezvous listens on the first host of SLURM_JOB_NODELIST at port 20000 + SLURM_JOB_ID mod
# 10000 (export NETDAM_MASTER_ADDR/NETDAM_MASTER_PORT to choose; needed when the node list is not
# a plain `a,b` or `node[01-04]`). Each node binds the local address of its route to that host,
# port 7744 + SLURM_LOCALID. Rank 0 writes the cluster file once every rank has reported; the
# all-reduce below plays every rank's host, so it needs the nodes on this host (--nodes=1).
# Several hosts: `sbatch -N2 -n4`, the cluster file on a shared filesystem, and one host process
# per rank calling netdam.init(FILE, rank=R) (e.g. a second srun step).
#
# Environment: NETDAM (the command, default `netdam`), NODE_ARGS (more `netdam node` options),
# CLUSTER_DIR (default: the current directory).
set -euo pipefail
# shellcheck source=launch_common.sh
source "$(dirname "$0")/launch_common.sh"

NETDAM=${NETDAM:-netdam}
NODES=${SLURM_NTASKS:-3}
CLUSTER=${CLUSTER_DIR:-$PWD}/netdam-cluster-${SLURM_JOB_ID:-$$}.toml

srun --ntasks "$NODES" $NETDAM node --memory 16MiB ${NODE_ARGS:-} --cluster "$CLUSTER" &
LAUNCHER=$!

allreduce_once_formed srun
