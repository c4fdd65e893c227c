"""The emulated NIC, sans-I/O: node and switch cores' shared parts, the node, the collective engine's setup, send queue, events, fault spec, in-memory fabric."""
