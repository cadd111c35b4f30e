"""The command line: the top layer. It imports every other package and nothing imports
it. ``main`` holds ``deinfer`` / ``deinfer-gen`` and the one-line error handling; each
other module is one subcommand's arguments and glue."""
