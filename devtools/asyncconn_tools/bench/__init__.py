"""Every benchmark, each behind ``asyncconn bench <what>``: one module per ``<what>`` exposing
``add_arguments(parser)`` and ``run(args) -> int``, listed in :mod:`asyncconn_tools.cli.bench`. ``measure``
holds the helpers they share; ``engine_runs`` the real-engine cases ``bench engine`` drives."""
