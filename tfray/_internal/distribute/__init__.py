"""Which share of a source this process reads under tf.distribute (auto, shard, dynamic)."""
