"""What every rank runs: build_stage, the stage runner, sampler, CUDA graphs, the rank loop and the two executors."""
