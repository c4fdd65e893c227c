"""The ``netdam`` command: one thin module per subcommand (parse, call, print)."""
