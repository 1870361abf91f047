"""The code a ``from_generators`` producer runs on a Ray worker.

It imports nothing and is pickled by value (see generators.py), so a
producer process never imports tfray, and with it TensorFlow.
"""


def run_shard(fn, shard):
    batches = fn(shard)
    if not hasattr(batches, "__next__"):  # A function that returned a batch, or a list.
        # generators.NOT_A_GENERATOR's words: this module imports nothing.
        raise TypeError(
            "from_generators: fn must be a generator function (use `yield`), so that "
            f"each producer yields its shard's batches one at a time; fn({shard!r}) "
            f"returned a {type(batches).__name__}."
        )
    yield from batches
