"""Device agent: capabilities, profiler, tensor-parallel engine, model families, trainer."""
