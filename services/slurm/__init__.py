"""Running a deployment on Slurm: one `srun` step per service, supervised and restarted."""
