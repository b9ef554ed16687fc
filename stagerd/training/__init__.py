"""The training side: `stager.Stager` and its rooms (host_pool, host_copy, optimizer_hook, placement,
shard_files, committer, failures, save_inputs, state_tree, marker, topology, collectives, loader,
shutdown). Import-free, so that `import stagerd` does not pay for torch."""
