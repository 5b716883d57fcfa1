"""One image across several GPUs: each model call's tokens split over worker processes, one per GPU, attention
gathered by yunchang's Ulysses all-to-all (sequence.py); ComfyUI's sampler, patches and LoRA handling stay in
ComfyUI's process (patch.py, workers.py)."""
