"""jaxaot's SLURM launcher (``hydra/launcher=slurm``): submitit's, ending on every job state
and resuming requeued jobs from their last finished stage (see ``slurm_launcher``)."""
