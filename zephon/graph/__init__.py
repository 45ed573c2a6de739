"""From a :class:`~zephon.pipeline.Pipeline` to what its lanes run, one job per module: :mod:`.program` (check
the graph, place every operator, add the implied ones, bind them), :mod:`.fingerprint` (the description of the
whole graph, what a checkpoint must match) and :mod:`.explain` (``explain()`` and ``validate()``)."""
