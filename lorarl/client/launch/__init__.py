"""What starts a job's services: on this host (local), on a Ray cluster, or as a Slurm script."""
