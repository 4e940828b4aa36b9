"""lmtrain: what every SLURM task (or local process) runs. Imports torch; never imported by the CLI."""
