"""The parts of ``asyncconn demo`` (:mod:`asyncconn_tools.cli.demo`): ``engine`` runs vLLM's real engine
(the default parts ``ec`` and ``kv``), ``hybrid`` a hybrid model's KV; ``ec_sim`` and ``kv_sim`` run the
offline engine of :mod:`asyncconn_tools.sim` (parts ``ec-sim``, ``kv-sim``)."""
