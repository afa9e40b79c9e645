"""Tools that show and test the integration, never imported by it: the reference messager, the
scripted GPU, the mixed workload, and the tensor-parallel harness with its rules and workloads."""
