"""Token data for language models: tokenizers, prepared token shards on disk, and packed training batches.

- :mod:`dtrain.data.tokenizer`: :class:`~dtrain.data.tokenizer.Tokenizer`, any Hugging Face ``tokenizer.json``
  or a byte-level BPE trained here.
- :mod:`dtrain.data.prepare`: text, JSONL and Parquet files -> ``train-*.bin`` / ``val-*.bin`` token shards and
  ``meta.json``.
- :mod:`dtrain.data.loader`: :class:`~dtrain.data.loader.TokenDataset` (the shards as read-only memory maps) and
  :class:`~dtrain.data.loader.PackedBatches` (seeded, resumable next-token batches, split over data-parallel
  ranks).
- :mod:`dtrain.data.default`: a dataset that needs no download, Python's own help texts.
"""
