"""The training side: `stager.Stager` and its rooms (committer, failures, writers, host_copy, save_inputs,
marker, topology, collectives, shutdown). Import-free, so that `import stagerd` does not pay for torch."""
