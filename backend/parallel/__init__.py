"""Several ranks: the rank groups and their secret handshake, the wire format of a step, the
worker processes, rank 0's side of them, and the command other nodes run."""
