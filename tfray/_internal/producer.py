"""The code a ``from_generators`` producer runs on a Ray worker.

It imports nothing and is pickled by value (see generators.py), so a
producer process never imports tfray, and with it TensorFlow.
"""


def run_shard(fn, shard):
    yield from fn(shard)
