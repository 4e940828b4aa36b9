"""A real single-machine SLURM cluster (controller, two virtual nodes, slurmdbd on MariaDB)
for trying lmlaunch and for the integration tests. See :mod:`launcher.localcluster.cluster`."""
