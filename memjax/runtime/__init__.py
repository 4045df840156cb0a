"""Where the computation runs: the device mesh and logical sharding rules, joining the processes
of a multi-host job, and the host memory allocator."""
