"""The parts of ``asyncconn demo``: ``engine`` runs vLLM's real engine (the default parts ``ec`` and ``kv``);
``ec_sim`` and ``kv_sim`` run the offline engine of :mod:`asyncconn.sim` (parts ``ec-sim``, ``kv-sim``)."""
