"""The I/O shell: the only Python code that touches sockets, clocks and processes (node process, socket options, shared memory)."""
