"""Data as shards: WebDataset tar shards and their index (format.py) at a local folder or any fsspec URL, written by
`accel-train shard` (writer.py), read through this node's block cache (cache.py) in an order that is a function of
(seed, epoch) (order.py), prefetched ahead of the loader (prefetch.py)."""
