"""What an iterator handed out of each work unit: the Python side of channel.h's Progress.

A source made of units (a generator's or a tf.data pipeline's shards)
labels each batch with its unit and its place in its bundle
(sources/bundles.py); the native iterator counts them as TF takes them, and
its checkpoint saves the count, which a restored epoch starts each unit
from (sources/resume.py). The job's position across workers
(distribute/position.py) is a Progress too.
"""

from typing import Dict, NamedTuple, Tuple


class Progress(NamedTuple):
    """Per unit, what was handed out.

    ``units`` maps a unit (a shard's number) to ``(batches, bundles)``: its
    batches handed out, and the bundles they began. ``partial`` maps a unit
    whose last bundle was handed out in part to ``(done, size)``: how many
    of its batches, of how many. One iterator leaves at most one such
    bundle, its last batch's; a job of several workers one per worker.
    """

    units: Dict[int, Tuple[int, int]]
    partial: Dict[int, Tuple[int, int]]

    @classmethod
    def decode(cls, encoded):
        """The Progress of the native encoding (channel.h), or None if it is empty."""
        if not encoded:
            return None
        units = {encoded[i]: (encoded[i + 1], encoded[i + 2]) for i in range(3, len(encoded), 3)}
        unit, done, size = encoded[:3]
        return cls(units, {unit: (done, size)} if done < size else {})
