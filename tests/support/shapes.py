"""The tiny FLUX of the CPU unit tests (hidden 256, 2 heads, 2 double + 2 single blocks, narrow text/vector widths),
as a FluxParams dict for core/models/synthetic.py. Imports nothing, so a process that loaded the plugin through
ComfyUI can build it with that copy of the plugin."""
TINY = dict(image_model="flux", in_channels=16, out_channels=16, patch_size=2, mlp_ratio=4.0, theta=10000,
            qkv_bias=True, axes_dim=[16, 56, 56], num_heads=2, hidden_size=256, context_in_dim=64, vec_in_dim=64,
            depth=2, depth_single_blocks=2, guidance_embed=True)
