"""The operators: one object per operator, one file each (its declaration, its description for the
fingerprint, its runtime).

- :mod:`.base`: the contract every operator follows, Zephon's built-ins and yours: :class:`~zephon.Transform`
  (stateless, on executors) and :class:`~zephon.Accumulator` (serial per lane, ``push``/``flush``), plus
  :class:`~zephon.Merge` (the mixer's contract) and :class:`~zephon.LaneContext`;
- stateless transforms: :mod:`.map`, :mod:`.filter`, :mod:`.flat_map`, :mod:`.map_batch` (user functions,
  over :mod:`._function`), :mod:`.tokenize`, :mod:`.tokenize_chat`, :mod:`.split`, :mod:`.decode_images`,
  :mod:`.tokenize_images`;
- accumulators: :mod:`.mix` (where the sources meet; its weights over steps: :mod:`.schedule`),
  :mod:`.shuffle`, :mod:`.accumulate` (yours), :mod:`.pack` (documents into rows; where a document with
  images may be cut: :mod:`.image_layout`) and :mod:`.batch` (the rows each lane adds to a global batch).

The builder (:class:`zephon.Pipeline`) declares them; :mod:`zephon.graph` compiles them into what the lanes run.
This package imports nothing: ``import zephon`` stays lazy (tests/test_layering.py).
"""
