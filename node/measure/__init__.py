"""Measuring this box for the planner: the profiler and its profiling set, run in a child process
(`profilechild`), and the probes it uses (a layer's memory, the heap's holes in a child, a rank's peak
resident set, an all-reduce's CPU cost), with the allocator setting every training and profiling
process runs under."""
