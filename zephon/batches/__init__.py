"""What a rank receives: its lanes' rows collated into a batch of tensors, one module per concern.

:mod:`.packed` (rows of tokens: ``input_ids``, ``labels``, positions, ``cu_seqlens``, and the batch hash),
:mod:`.images` (the pixels and image keys of vision-language batches), :mod:`.records` (a record per row,
for pipelines without ``pack()``), :mod:`.buffers` (large batch tensors written into released memory) and
:mod:`.rows` (a batch cut by rows, every key consistent: Megatron's micro-batches).
"""
