"""The pool soak: parent (plan, checks) and client processes."""
