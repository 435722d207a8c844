"""The ``asyncconn`` commands this package adds: ``bench`` (a group, :data:`bench.COMMANDS`), ``chaos`` and
``demo``. :mod:`asyncconn.cli.main` lists them by module path and imports one only when it is run; each
module exposes ``add_arguments(parser)`` and ``run(args) -> int`` like the library's own commands."""
