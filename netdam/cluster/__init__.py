"""Clusters: start and stop local node processes and the switch, cluster files, launcher environments, rendezvous, control client."""
