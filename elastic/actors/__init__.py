"""Ray actors: training workers (ranks and hot spares), their group, and the controller host."""
