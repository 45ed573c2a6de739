"""Provenance: which records train at a step, where a record lands, and where two pipelines' streams part.

- :func:`zephon.trace` (``zephon trace``): the document pieces in rows of a global step, with their source,
  file, record, token range and text, computed from the lanes that hold those rows only;
- :func:`zephon.locate` (``zephon locate``): every step, row and token range where a record lands, found by
  running only the lane the plan routes its unit to (or the operator that dropped it);
- :func:`zephon.diff` (``zephon diff``): the first global step where two pipelines differ, the lanes that
  differ there, and the delivered tokens per source of both, step by step.

All three rest on ``batch(provenance=True)`` (:mod:`zephon.origins`), which they turn on themselves: it
changes no byte of a batch and not the fingerprint, so a checkpoint of the run they look at applies. This
package's ``__init__`` imports nothing: ``zephon.trace`` and the others load on first use.
"""
