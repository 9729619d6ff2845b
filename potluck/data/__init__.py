"""Real training data: tokenizers, token shards on disk, where shards come from, and the sample order.

* :mod:`.tokenizer`: byte-level (the dependency-free default) or a Hugging Face tokenizer, each with
  an identity (name + sha256) the run manifest records;
* :mod:`.shards`: fixed-size shards of uint16/uint32 tokens read by memory map, with an index that
  holds every shard's sha256, token count and document boundaries;
* :mod:`.prepare`: ``potluck data prepare``: text / jsonl / parquet / a ``datasets`` dataset -> shards;
* :mod:`.fetch`: shards from a local folder, a ``file://`` or ``https://`` base URL (resumable,
  hash-checked, cached);
* :mod:`.order`: the run's sample order, one seeded permutation per epoch addressed by a global
  position, which the coordinator's cursor hands out in disjoint ranges.
"""


class DataError(ValueError):
    """Data that cannot serve the run: a missing or corrupt shard, a wrong tokenizer, a bad range."""
