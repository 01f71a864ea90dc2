"""``hydra/launcher=slurm`` for Hydra's plugin scan: the launcher (:mod:`jaxaot.sweeps.slurm_launcher`)
where hydra-submitit-launcher (``jaxaot[sweep]``) is installed, nothing where it is not, so a
plain install's runs print no plugin-import warning."""

from importlib.util import find_spec

if find_spec("hydra_plugins.hydra_submitit_launcher") is not None:
    from jaxaot.sweeps.slurm_launcher import JaxaotSlurmLauncher

    __all__ = ["JaxaotSlurmLauncher"]
