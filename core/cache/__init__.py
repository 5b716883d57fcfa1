"""FluxAccel's persistence, one folder for every cache (folder.py: ComfyUI's user/fluxaccel/compile-cache, or
$FLUXACCEL_CACHE_DIR): inductor's artifacts (kernels.py), the compiled blocks' warm-start packages (packages.py), the
FP8 weights (fp8_weights.py); clear.py empties it. Each file is keyed by what made it; a stale, foreign or damaged one
is ignored with a warning and rebuilt."""
