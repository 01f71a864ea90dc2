"""``hydra/launcher=slurm`` for Hydra's plugin scan: the launcher (:mod:`jaxaot.sweeps.slurm_launcher`)
where hydra-submitit-launcher (``jaxaot[sweep]``) is installed, nothing where it is not, so a
plain install's runs print no plugin-import warning. Hydra instantiates only plugin classes
defined in the ``hydra_plugins`` package, hence the subclass here."""

from importlib.util import find_spec

if find_spec("hydra_plugins.hydra_submitit_launcher") is not None:
    import jaxaot.sweeps.slurm_launcher as _impl

    class JaxaotSlurmLauncher(_impl.JaxaotSlurmLauncher):
        """jaxaot's SLURM launcher (see :mod:`jaxaot.sweeps.slurm_launcher`)."""

    __all__ = ["JaxaotSlurmLauncher"]
