"""The prepared GPU check (gpu_check.sh): the torch engine on CUDA, the draft service's D(b),
losslessness on the device and the StarSD planner for Jetson targets, in one run."""
