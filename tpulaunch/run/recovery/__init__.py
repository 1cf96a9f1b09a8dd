"""Recovery between attempts: a preempted slice made again (`recreate`), an elastic run shrinking
and growing back (`elastic`), spares swapped in and hung slices replaced (`resize`)."""
