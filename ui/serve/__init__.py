"""One host's whole loop: the embedded scheduler, process supervision, the demo and `run`."""
