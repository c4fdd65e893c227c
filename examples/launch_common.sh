# Shared by examples/launch_{torchrun,mpirun,slurm}.sh (sourced, not run). The caller sets
# NETDAM, CLUSTER (where rank 0 writes the cluster file) and WORK (a scratch directory to remove,
# or empty), then starts the launcher in the background as LAUNCHER=$! and calls
# `allreduce_once_formed NAME`. On any exit the nodes and the launcher are stopped.

LAUNCHER=""
cleanup() {
    [ -f "${CLUSTER:-}" ] && $NETDAM down --cluster "$CLUSTER" >/dev/null 2>&1 || true
    [ -n "$LAUNCHER" ] && kill "$LAUNCHER" 2>/dev/null || true
    [ -n "${WORK:-}" ] && rm -rf "$WORK" || true
}
trap cleanup EXIT

# Wait for rank 0 to write $CLUSTER, all-reduce over the nodes through it (checked against
# numpy), stop them, and exit with the all-reduce's status.

allreduce_once_formed() {
    local launcher_name=$1
    for _ in $(seq 3000); do   # up to 300 s: with a cold numba cache every node compiles first
        [ -f "$CLUSTER" ] && break
        kill -0 "$LAUNCHER" 2>/dev/null || { echo "$launcher_name exited before the cluster formed" >&2; exit 3; }
        sleep 0.1
    done
    [ -f "$CLUSTER" ] || { echo "no cluster file after 300 s" >&2; exit 3; }

    local status=0
    $NETDAM allreduce --cluster "$CLUSTER" --size 1MiB || status=$?
    $NETDAM down --cluster "$CLUSTER"
    wait "$LAUNCHER" || true
    LAUNCHER=""
    exit "$status"
}
